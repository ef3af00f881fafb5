"""Process-group setup from the launcher's environment, and the few collectives the trainer needs.

Launchers understood, in order:

* ``torchrun`` (and anything else that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``);
* submitit (the Hydra SLURM and local launchers) with more than one task: ranks come from
  ``submitit.JobEnvironment`` and the first host of the job becomes the rendezvous;
* otherwise a single process, no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "init_distributed",
    "configure_torch",
    "broadcast_object",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "destroy",
]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _env_from_submitit() -> None:
    """Translate a multi-task submitit job into torchrun's environment variables."""
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return
    os.environ["RANK"] = str(job.global_rank)
    os.environ["LOCAL_RANK"] = str(job.local_rank)
    os.environ["WORLD_SIZE"] = str(job.num_tasks)
    os.environ.setdefault("MASTER_ADDR", job.hostnames[0])
    # every task of the job derives the same port from the job id
    job_digits = "".join(c for c in str(job.job_id) if c.isdigit())
    os.environ.setdefault("MASTER_PORT", str(20000 + int(job_digits or "0") % 20000))


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Join the process group the launcher describes and pick this process's device.

    Args:
        device: ``auto`` (CUDA if available), ``cuda`` or ``cpu``.
        backend: ``auto`` (NCCL on CUDA, gloo on CPU), or a torch.distributed backend name.
    """
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
        _env_from_submitit()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"trainer.device must be auto, cpu or cuda, got {device!r}")

    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def configure_torch(device: torch.device, tf32: bool, cpu_threads: int | None) -> None:
    """Per-process torch settings: TF32 matmuls/convolutions, cuDNN autotuning, CPU thread count."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = device.type == "cuda"
    if device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)


def broadcast_object(obj: Any, info: DistInfo, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=info.device if info.device.type == "cuda" else None)
    return box[0]


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def destroy(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
