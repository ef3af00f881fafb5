"""The validation loop shared by train.py and eval.py, so both report the same numbers."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from timm.utils import accuracy

from gspn2.train.distributed import DistInfo, all_reduce_sum

__all__ = ["AMP_DTYPES", "autocast", "batch_sizes", "evaluate", "resolve_channels_last", "warm_up"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def autocast(device: torch.device, precision: str):
    """Autocast context for ``precision`` (bf16 | fp16 | fp32); fp32 is a no-op."""
    if precision not in AMP_DTYPES:
        raise ValueError(f"precision must be one of {sorted(AMP_DTYPES)}, got {precision!r}")
    dtype = AMP_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def resolve_channels_last(setting: bool | None, device: torch.device) -> bool:
    """eval.py's ``channels_last``: ``None`` (the default) is on for a CUDA device, off elsewhere."""
    return device.type == "cuda" if setting is None else bool(setting)


def batch_sizes(loader) -> list[int]:
    """The sizes of the batches ``loader`` yields when every image is readable: the full batch size and
    that of the last, partial batch (if any), in the order they come."""
    n, b = len(loader.dataset), loader.batch_size
    return ([b] if n >= b else []) + ([n % b] if n % b else [])


@torch.no_grad()
def warm_up(
    model: torch.nn.Module,
    sizes: list[int],
    img_size: int,
    device: torch.device,
    precision: str = "fp32",
    channels_last: bool = False,
    rounds: int = 3,
) -> float:
    """Run ``model`` (in eval mode) on zeros of each batch size of ``sizes``, ``rounds`` times over; returns
    the seconds it took.

    For a ``torch.compile``d model this is its compilation, kept out of :func:`evaluate`'s timed forward:
    the first size compiles a graph for its static shape, a second size recompiles once with a dynamic
    batch dimension, and with CUDA graphs (``reduce-overhead``) each graph and shape is warmed up on its
    first run and recorded on its second, replayed from then on -- three rounds cover every step. The
    outputs are discarded; nothing in the model changes.
    """
    model.eval()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for n in sizes:
            images = torch.zeros(n, 3, img_size, img_size, device=device)
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast(device, precision):
                model(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader, info: DistInfo, precision: str = "fp32", channels_last: bool = False
) -> dict[str, float]:
    """Top-1, top-5 (percent), mean cross-entropy and forward throughput over this rank's shard,
    summed over all ranks (each sample is counted exactly once).

    Returns:
        ``{"top1", "top5", "loss", "images", "forward_s", "img_per_s"}``; ``forward_s`` is the
        wall time spent in the model's forward on this rank.
    """
    model.eval()
    device = info.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, correct@1, correct@5, n
    forward_s = 0.0
    for images, targets in loader:
        if targets.numel() == 0:  # every image of this batch was unreadable and skipped (data.bad_images)
            continue
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast(device, precision):
            logits = model(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        forward_s += time.perf_counter() - t0
        logits = logits.float()
        top1, top5 = accuracy(logits, targets, topk=(1, min(5, logits.shape[1])))
        n = targets.shape[0]
        sums += torch.tensor(
            [
                F.cross_entropy(logits, targets, reduction="sum").item(),
                round(top1.item() * n / 100.0),
                round(top5.item() * n / 100.0),
                n,
            ],
            dtype=torch.float64,
            device=device,
        )
    all_reduce_sum(sums, info)
    loss, c1, c5, n = sums.tolist()
    if n == 0:
        raise RuntimeError("the validation set is empty")
    return {
        "top1": 100.0 * c1 / n,
        "top5": 100.0 * c5 / n,
        "loss": loss / n,
        "images": int(n),
        "forward_s": forward_s,
        "img_per_s": n / info.world_size / forward_s if forward_s > 0 else float("nan"),
    }
