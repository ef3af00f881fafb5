"""Per-operator GPU time of one model's training step (or inference), from the torch profiler.

    python scripts/profile_model.py                                   # gspn2_tiny, train, 224^2, batch 128
    python scripts/profile_model.py --model gspn2_tiny --task infer --batch-size 256 --rows 30
    python scripts/profile_model.py --trace runs/gspn2_tiny_trace.json   # also a Chrome trace
    python scripts/profile_model.py --compile --by-shape              # also the GEMMs by their shapes

bf16 autocast and channels_last, as scripts/bench_models.py measures. The table lists the operators by
their own CUDA time (``self_cuda_time_total``), summed over ``--steps`` profiled steps, with the share of
the total kernel time (each kernel counted once: see ``operator_table``): the list of what to make faster
first.
"""

from __future__ import annotations

import argparse

import timm
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2 import inductor


def operator_table(events) -> tuple[float, list]:
    """(total kernel time, host-side operators by the kernel time they launched, largest first).

    The profiler reports each kernel twice: as a device event of its own and inside the self device time
    of the operator that launched it. The total counts the device events only; the table lists the
    operators only (``aten::*``, compiled Triton calls, ...), so no kernel is counted twice.
    """
    total = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    ops = [e for e in events if e.device_type != DeviceType.CUDA and e.self_device_time_total > 0]
    return total, sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)


#: The operators ``--by-shape`` lists by input shape.
SHAPED_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::cudnn_convolution", "aten::convolution_backward",
              "gspn2::")


def print_stacks(prof, op: str, steps: int, depth: int = 4) -> None:
    """The calls of operator ``op`` grouped by input shape (and call site where the profiler records Python
    frames: none for calls from Inductor's generated code in torch 2.11): CUDA ms per step, calls per step,
    the shapes and the innermost ``depth`` frames, largest first."""
    groups = prof.key_averages(group_by_input_shape=True, group_by_stack_n=depth)
    hits = [e for e in groups if e.key == op and e.device_type != DeviceType.CUDA]
    hits.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"\n{op}: {len(hits)} groups")
    for e in hits:
        print(f"{e.self_device_time_total / steps / 1e3:8.3f} ms/step {e.count / steps:6.1f} calls/step  "
              f"{e.input_shapes}")
        for frame in (e.stack or [])[:depth]:
            print(f"        {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gspn2_tiny")
    p.add_argument("--task", choices=["train", "infer"], default="train")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="profiled steps (after 5 warm-up steps)")
    p.add_argument("--rows", type=int, default=40, help="operators to list")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--stacks", default=None, metavar="OP",
                   help="also list the calls of operator OP (e.g. aten::sum) by input shape with their CUDA "
                        "time, and the innermost Python frames where the profiler records them")
    p.add_argument("--by-shape", action="store_true",
                   help="also list the GEMMs and convolutions (aten::mm, addmm, ...) by their input shapes (the "
                        "per-operator rows stay right, but on an H200 with torch 2.11 the total line came out about "
                        "3x the step's kernel time: take the total from a run without it)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_model.py needs a CUDA GPU")
    if not timm.is_model(args.model):
        raise SystemExit(f"--model: unknown timm model {args.model!r}")
    torch.backends.cudnn.benchmark = True
    model = timm.create_model(args.model, num_classes=1000).cuda().to(memory_format=torch.channels_last)
    model.train(args.task == "train")
    fwd = inductor.compile(model) if args.compile else model
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device="cuda")
    x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        if args.task == "infer":
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                fwd(x)
            return
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / args.steps
    print(f"{args.model} {args.task} {args.img_size}^2 batch {args.batch_size}: {ms:.2f} ms/step, "
          f"{args.batch_size / ms * 1e3:.0f} img/s (unprofiled)")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    shapes = args.by_shape or bool(args.stacks)
    with profile(activities=activities, record_shapes=shapes, with_stack=bool(args.stacks)) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    total, rows = operator_table(prof.key_averages())
    print(f"profiled CUDA time per step: {total / args.steps / 1e3:.2f} ms (sum of kernel times)")
    print(f"{'self CUDA ms/step':>18s} {'share':>6s} {'calls/step':>10s}  operator")
    for e in rows[: args.rows]:
        print(f"{e.self_device_time_total / args.steps / 1e3:18.3f} {100 * e.self_device_time_total / total:5.1f}% "
              f"{e.count / args.steps:10.1f}  {e.key[:110]}")
    if args.by_shape:
        gemms = [e for e in prof.key_averages(group_by_input_shape=True)
                 if e.device_type != DeviceType.CUDA and e.self_device_time_total > 0 and e.key.startswith(SHAPED_OPS)]
        gemms.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print(f"\n{'self CUDA ms/step':>18s} {'calls/step':>10s}  operator  input shapes")
        for e in gemms[: args.rows]:
            print(f"{e.self_device_time_total / args.steps / 1e3:18.3f} {e.count / args.steps:10.1f}  {e.key}  "
                  f"{e.input_shapes}")
    if args.stacks:
        print_stacks(prof, args.stacks, args.steps)
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
