"""Where a training step's time goes: host (Python + dispatch) or GPU, for GSPN-2 and its peers.

For each model, in a fresh process each (``--repeats`` rounds, the models in turn, so order and process
effects show), one training step (bf16 autocast, channels_last, forward, cross-entropy, backward, fused
AdamW) is timed three ways:

* ``eager``: the step as ``scripts/bench_models.py`` times it (CUDA events around it, synchronised);
* ``host``: wall time until the step's Python call returns, started on an idle GPU (it includes any wait
  for a full launch queue, so it bounds the host's own work from above);
* ``graph``: the same step captured once in a CUDA graph and replayed (no Python, no dispatch): the GPU's
  own time for the step's kernels, the best eager could reach with zero host overhead. ``eager / graph``
  well above 1 means the GPU idles while Python and the dispatcher issue the step: the step is host-bound.

    python scripts/bench_step.py                                              # the tiny trio
    python scripts/bench_step.py --models gspn2_tiny swin_tiny_patch4_window7_224 --repeats 3 --json s.json

``--count-ops`` needs no GPU: it counts the ATen calls one training step's forward and backward dispatch
(the host work that makes a step host-bound; a custom op such as ``gspn2::propagate`` is one call whatever
its CPU implementation runs inside), at batch 1 (``--batch``), 224², bf16 autocast, channels_last, on the
CPU (``--device``), and prints the total, the most frequent ops and the forward calls per block type:

    python scripts/bench_step.py --count-ops --models gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_MODELS = ["gspn2_tiny", "swin_tiny_patch4_window7_224", "convnext_tiny"]


def _check_model(name: str) -> None:
    """SystemExit naming --models unless ``name`` is a registered timm (or gspn2_*) model."""
    import timm

    import gspn2  # noqa: F401  (registers the gspn2_* models)

    if not timm.is_model(name):
        raise SystemExit(f"--models: unknown timm model {name!r}")


def summarize(rows: list[dict], models: list[str], batch: int) -> str:
    """Markdown table of the per-model medians over rounds. ``eager / graph`` is the share of the eager
    step the GPU spends waiting for the host (1.00: none)."""
    lines = ["| model | eager ms | host ms | graph ms | eager img/s | graph img/s | eager / graph |",
             "|---|---|---|---|---|---|---|"]
    for spec in models:
        ok = [r for r in rows if r["model"] == spec and "error" not in r]
        if not ok:
            lines.append(f"| {spec} | failed | | | | | |")
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ("eager_ms", "host_ms", "graph_ms")}
        lines.append(f"| {spec} | {med['eager_ms']:.2f} | {med['host_ms']:.2f} | {med['graph_ms']:.2f} | "
                     f"{batch / med['eager_ms'] * 1e3:.0f} | {batch / med['graph_ms'] * 1e3:.0f} | "
                     f"{med['eager_ms'] / med['graph_ms']:.2f} |")
    return "\n".join(lines)


def measure(spec: str, batch: int, warmup: int, iters: int) -> dict:
    """One model in this process: eager, host and CUDA-graph times of a training step (ms)."""
    import timm
    import torch

    import gspn2  # noqa: F401  (registers the gspn2_* models)
    from gspn2.benchmark import median_ms

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = timm.create_model(spec, num_classes=1000).cuda().train().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True, capturable=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(zero: bool = True, cache: bool = True) -> None:
        # CUDA graphs need autocast's weight-cast cache off (torch.cuda.graphs docs); eager keeps it on.
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)

    row = {"model": spec, "batch": batch}
    eager = median_ms(step, warmup, iters)
    row["eager_ms"] = eager
    hosts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    row["host_ms"] = statistics.median(hosts)

    # Whole-step CUDA graph (torch.cuda.graphs' documented recipe: warm up on a side stream, capture
    # with gradients allocated by the warm-up and kept, replay).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(zero=False, cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(zero=False, cache=False)
    row["graph_ms"] = median_ms(graph.replay, warmup, iters)
    row["eager_img_per_s"] = batch / eager * 1e3
    row["graph_img_per_s"] = batch / row["graph_ms"] * 1e3
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return row


def _block_of(module_name: str, module, blocks: dict) -> None:
    """Record in ``blocks`` (name -> class name) the modules a forward call is attributed to: every module
    whose class name ends in ``Block`` (GSPN2Block, SwinTransformerBlock, ConvNeXtBlock, ...)."""
    if type(module).__name__.endswith("Block"):
        blocks[module_name] = type(module).__name__


def count_ops(spec: str, batch: int = 1, size: int = 224, device: str = "cpu") -> dict:
    """The ATen calls of one forward (cross-entropy included) and backward of ``spec`` in training mode.

    Returns ``{"model", "total", "forward", "backward", "ops": {op: calls}, "blocks": {class: {...}}}``:
    ``ops`` counts every call once by its overload packet (``aten.view``, ``gspn2.propagate``, ...) and sums
    to ``total``; ``blocks`` gives, per block class, the number of blocks, their forward calls in all and per
    block, and those per direct child of the block (``mixer``, ``mlp``, ...; ``(self)`` for the block's own).
    Ops dispatched inside a call the mode sees (a custom op's CPU implementation, a kernel's internals) are
    not counted: the mode is off while a call runs.
    """
    import timm
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import gspn2  # noqa: F401  (registers the gspn2_* models)

    if batch < 1 or size < 1:
        raise ValueError(f"count_ops: `batch` and `size` must be >= 1, got {batch} and {size}")
    torch.manual_seed(0)
    model = timm.create_model(spec, num_classes=1000).to(device).train().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    blocks: dict = {}
    for name, m in model.named_modules():
        _block_of(name, m, blocks)
    stack: list = []  # names of the modules whose forward runs now, outermost first

    def pre(name):
        def hook(module, args):
            stack.append(name)
        return hook

    def post(name):
        def hook(module, args, out):
            stack.pop()
        return hook

    def attribution():
        """(block class, direct child of that block or ``(self)``) of the call running now, or None."""
        for i, name in enumerate(stack):
            if name in blocks:
                child = stack[i + 1][len(name) + 1:].split(".")[0] if i + 1 < len(stack) else "(self)"
                return blocks[name], child
        return None

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(pre(name)))
        handles.append(m.register_forward_hook(post(name)))

    phase = ["forward"]
    ops: collections.Counter = collections.Counter()
    per_phase: collections.Counter = collections.Counter()
    per_block: dict = {}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = str(func.overloadpacket).replace("::", ".")
            ops[key] += 1
            per_phase[phase[0]] += 1
            if phase[0] == "forward":
                where = attribution()
                if where is not None:
                    per_block.setdefault(where[0], collections.Counter())[where[1]] += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        phase[0] = "backward"
        loss.backward()
    for h in handles:
        h.remove()
    n_blocks = collections.Counter(blocks.values())
    block_rows = {}
    for cls, children in per_block.items():
        calls = sum(children.values())
        block_rows[cls] = {"blocks": n_blocks[cls], "forward_calls": calls,
                           "per_block": calls / n_blocks[cls],
                           "children_per_block": {k: v / n_blocks[cls] for k, v in children.most_common()}}
    return {"model": spec, "batch": batch, "size": size, "total": sum(ops.values()),
            "forward": per_phase["forward"], "backward": per_phase["backward"],
            "ops": dict(ops.most_common()), "blocks": block_rows}


def format_counts(row: dict, top: int = 15) -> str:
    """The text ``--count-ops`` prints for one model."""
    lines = [f"{row['model']}: {row['total']} aten calls (forward {row['forward']}, backward {row['backward']}) "
             f"at batch {row['batch']}, {row['size']}x{row['size']}"]
    lines.append("  top ops: " + ", ".join(f"{k} {v}" for k, v in list(row["ops"].items())[:top]))
    for cls, b in row["blocks"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in b["children_per_block"].items())
        lines.append(f"  {cls} x{b['blocks']}: forward {b['per_block']:.1f} calls per block ({parts})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 128; 1 with --count-ops)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all models, one process each")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the aten calls of one forward+backward per model (no GPU; --batch defaults to 1)")
    parser.add_argument("--device", default="cpu", help="device of --count-ops")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: measure one model
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 1 if args.count_ops else 128
    for name in ("batch", "iters", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batch, args.warmup, args.iters)), flush=True)
        return 0

    for spec in args.models:  # fail on a bad name before anything runs
        _check_model(spec)
    if args.count_ops:
        rows = []
        for spec in args.models:
            rows.append(count_ops(spec, batch=args.batch, device=args.device))
            print(format_counts(rows[-1]), flush=True)
        if args.json:
            import timm
            import torch

            with open(args.json, "w") as f:
                json.dump({"env": {"torch": torch.__version__, "timm": timm.__version__}, "args": vars(args),
                           "rows": rows}, f, indent=1)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py needs a CUDA GPU")
    rows = []
    for rnd in range(args.repeats):
        for spec in args.models:
            cmd = [sys.executable, __file__, "--one", spec, "--batch", str(args.batch),
                   "--warmup", str(args.warmup), "--iters", str(args.iters)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if proc.returncode != 0:
                row = {"model": spec, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                print(f"round {rnd} {spec}: FAILED {proc.stderr[-2000:]}", flush=True)
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"round {rnd} {spec:32s} eager {row['eager_ms']:7.2f} ms  host {row['host_ms']:7.2f} ms  "
                      f"graph {row['graph_ms']:7.2f} ms  ({row['eager_img_per_s']:.0f} / "
                      f"{row['graph_img_per_s']:.0f} img/s)", flush=True)
            row["round"] = rnd
            rows.append(row)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print("\n" + summarize(rows, args.models, args.batch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
