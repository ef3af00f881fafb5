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
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all models, one process each")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: measure one model
    args = parser.parse_args()
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
