"""Training throughput under DDP on synthetic data: img/s per GPU for a timm model (GSPN-2-T by default).

Each rank trains on one fixed random batch (no data loading, so this measures the model, the optimizer
and the gradient all-reduce): bf16 autocast, channels_last, AdamW, grad-norm clipping, as train.py does.

    torchrun --nproc_per_node=1 scripts/bench_ddp.py                      # gspn2_tiny, 224^2, 128/GPU, bf16
    torchrun --nproc_per_node=2 scripts/bench_ddp.py --steps 50 --json runs/bench_ddp_2gpu.json
    torchrun --nproc_per_node=1 scripts/bench_ddp.py --model convnext_tiny  # a timm peer, same settings
    python scripts/bench_ddp.py --device cpu --model gspn2_micro --img-size 32 --batch-size 8 --steps 2

Only torch, timm and gspn2 are imported (no Hydra, OmegaConf or W&B). Report numbers together with the
GPU, precision, batch size and software versions this script prints.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from torch.nn.parallel import DistributedDataParallel

import gspn2  # noqa: F401  (registers the gspn2_* models with timm)
from gspn2 import inductor
from gspn2.train.distributed import all_gather_object, destroy, init_distributed

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gspn2_tiny", help="timm model name")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (cudnn autotune, allocator)")
    p.add_argument("--precision", choices=sorted(AMP), default="bf16")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--backend", default="auto", help="process group backend (auto: nccl on GPU, gloo on CPU)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (rank 0)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    info = init_distributed(args.device, args.backend)
    device = info.device
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = device.type == "cuda"

    model = timm.create_model(args.model, num_classes=args.num_classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    train_model = inductor.compile(model) if args.compile else model
    if info.enabled:
        train_model = DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None
        )

    g = torch.Generator(device="cpu").manual_seed(1234 + info.rank)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g).to(device)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)
    amp = AMP[args.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    def step() -> None:
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = F.cross_entropy(train_model(images), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if info.enabled:
            dist.barrier()

    train_model.train()
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    elapsed = time.perf_counter() - t0

    per_rank = all_gather_object(args.batch_size * args.steps / elapsed, info)
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    if info.is_main:
        hw = (
            f"{info.world_size} x {torch.cuda.get_device_name(device)}"
            if device.type == "cuda"
            else f"{info.world_size} x CPU process"
        )
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{args.model} ({params / 1e6:.1f} M params) | {hw} | {args.precision} | "
            f"{'channels_last' if args.channels_last else 'contiguous'}"
            f"{' | compiled' if args.compile else ''} | "
            f"batch {args.batch_size}/GPU | {args.img_size}x{args.img_size} | torch {torch.__version__} | "
            f"timm {timm.__version__}"
        )
        print(
            f"step {elapsed / args.steps * 1e3:.1f} ms | {sum(per_rank) / len(per_rank):.1f} img/s per GPU "
            f"(min {min(per_rank):.1f}) | {sum(per_rank):.1f} img/s total | peak memory "
            f"{'n/a' if peak_gb is None else f'{peak_gb:.1f} GB'}"
        )
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "model": args.model,
                        "params": params,
                        "world_size": info.world_size,
                        "device": hw,
                        "precision": args.precision,
                        "channels_last": args.channels_last,
                        "compile": args.compile,
                        "batch_per_gpu": args.batch_size,
                        "img_size": args.img_size,
                        "steps": args.steps,
                        "img_per_s_per_gpu": per_rank,
                        "img_per_s_total": sum(per_rank),
                        "peak_memory_gb": peak_gb,
                        "torch": torch.__version__,
                        "timm": timm.__version__,
                    },
                    indent=2,
                )
            )
    destroy(info)


if __name__ == "__main__":
    main()
