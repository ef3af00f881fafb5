"""Activation memory of a training step: the bytes autograd keeps from the forward for the backward.

Counts every tensor saved for backward (``torch.autograd.graph.saved_tensors_hooks``) once per storage,
so views of one buffer are not counted twice and parameters are left out. Eager runs also attribute the
bytes to the top-level blocks they were saved in (module hooks); compiled runs (``--compile``: Inductor
decides what to save or recompute) report the total only. Runs on CPU or GPU; the saved bytes depend on
the model, batch, resolution, dtype and device (autocast casts different ops on CPU and CUDA). On CUDA it
also reports what the allocator holds after the forward ("held", saved tensors and the loss) and its peaks
during the forward and the backward, relative to the memory allocated before the step (the weights are
excluded; the gradients are allocated inside the step and count in the backward's peak).

    python scripts/activation_memory.py --models gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny
    python scripts/activation_memory.py --models gspn2_tiny --compile --resolution 224 --batch 2
    python scripts/activation_memory.py --compile --aot-config ban_recompute_materialized_backward=False
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from typing import Optional

import timm
import torch
import torch.nn as nn

import gspn2.models  # noqa: F401  (registers the GSPN-2 models with timm)
from gspn2 import inductor
from gspn2.benchmark import aot_config


class SavedTensorCounter:
    """Context manager: bytes of the distinct storages saved for backward, total and per block."""

    def __init__(self, model: Optional[nn.Module] = None, block_names: Optional[list[str]] = None) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self.seen: set[int] = set()
        self.total = 0
        self.per_block: dict[str, int] = defaultdict(int)
        self.current = "(outside blocks)"
        self._handles = []
        if model is not None and block_names:
            modules = dict(model.named_modules())
            for name in block_names:
                self._handles.append(modules[name].register_forward_pre_hook(self._enter(name)))
                self._handles.append(modules[name].register_forward_hook(self._leave()))

    def _enter(self, name):
        def hook(module, args):
            self.current = name

        return hook

    def _leave(self):
        def hook(module, args, out):
            self.current = "(outside blocks)"

        return hook

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.params and storage.nbytes() > 0:
            self.seen.add(key)
            self.total += storage.nbytes()
            self.per_block[self.current] += storage.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()


def top_level_blocks(model: nn.Module) -> list[str]:
    """Names of the modules that hold one residual block each (``stages.i.blocks.j`` or ``layers.i.blocks.j``)."""
    names = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "blocks" and parts[-1].isdigit():
            names.append(name)
    return names


def measure(name: str, batch: int, resolution: int, dtype: torch.dtype, device: str, compile_model: bool) -> dict:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=1000).to(device).train()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, resolution, resolution, device=device).to(memory_format=torch.channels_last)
    blocks = [] if compile_model else top_level_blocks(model)
    fn = inductor.compile(model) if compile_model else model
    autocast = torch.autocast(device, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    if compile_model:  # compile outside the count, then count a second forward
        with autocast:
            fn(x).float().sum().backward()
        model.zero_grad(set_to_none=True)  # both modes allocate the gradients inside the counted step
    cuda = torch.device(device).type == "cuda"
    if cuda:  # what the device really holds: after the forward, and at the peak of the backward
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with SavedTensorCounter(model, blocks) as counter, autocast:
        loss = fn(x).float().sum()
    if cuda:
        torch.cuda.synchronize()
        held_after_forward, peak_forward = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak_backward = torch.cuda.max_memory_allocated() - base
    per_block = {}
    for b in blocks:
        per_block[b] = counter.per_block.get(b, 0)
    return dict(model=name, batch=batch, resolution=resolution, dtype=str(dtype).split(".")[1], compiled=compile_model,
                saved_bytes=counter.total, per_block=per_block,
                outside_blocks=counter.per_block.get("(outside blocks)", 0),
                **(dict(held_after_forward=held_after_forward, peak_forward=peak_forward, peak_backward=peak_backward)
                   if cuda else {}))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gspn2_tiny", "swin_tiny_patch4_window7_224", "convnext_tiny"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="autocast dtype (float32: no autocast)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (total only)")
    ap.add_argument("--aot-config", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._functorch.config.KEY (AOTAutograd's partitioner: what to save or recompute) "
                    "for the compiled runs, e.g. activation_memory_budget=0.8; repeatable")
    ap.add_argument("--blocks", action="store_true", help="print the bytes per block too")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.resolution < 32:
        ap.error("--batch must be >= 1 and --resolution >= 32")
    unknown = [m for m in args.models if not timm.is_model(m)]
    if unknown:
        ap.error(f"--models: unknown timm model(s) {unknown}")
    dtype = getattr(torch, args.dtype)
    try:
        aot = aot_config(args.aot_config)
    except ValueError as exc:
        ap.error(str(exc))
    with torch._functorch.config.patch(aot):
        rows = [measure(m, args.batch, args.resolution, dtype, args.device, args.compile) for m in args.models]
    mode = "compiled" if args.compile else "eager"
    if aot:
        mode += " with " + ", ".join(f"{k}={v}" for k, v in aot.items())
    print(f"saved for backward, {mode}, batch {args.batch}, {args.resolution}^2, {args.dtype} autocast, {args.device}")
    cuda = "peak_backward" in rows[0]
    extra = f" {'held MB':>9s} {'fwd peak':>9s} {'bwd peak':>9s}" if cuda else ""
    print(f"{'model':32s} {'MB':>9s} {'MB / image':>11s} {'vs first':>9s}{extra}")
    for r in rows:
        mb = r["saved_bytes"] / 2**20
        extra = "".join(f" {r[k] / 2**20:9.1f}" for k in ("held_after_forward", "peak_forward", "peak_backward")) if cuda else ""
        print(f"{r['model']:32s} {mb:9.1f} {mb / args.batch:11.2f} {r['saved_bytes'] / rows[0]['saved_bytes']:8.2f}x{extra}")
        if args.blocks:
            for b, n in r["per_block"].items():
                print(f"    {b:40s} {n / 2**20:8.2f} MB")
            print(f"    {'(stem, downsampling, head)':40s} {r['outside_blocks'] / 2**20:8.2f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
