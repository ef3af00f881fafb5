"""Model-level throughput and memory: GSPN-2 against timm peers, side by side in one run.

Inference (img/s, forward only, ``torch.inference_mode``) and training (img/s for forward + backward +
AdamW step, and peak memory) under bf16 autocast and channels_last, eager and ``torch.compile``.

    python scripts/bench_models.py                                  # the full table (H200: ~10 min)
    python scripts/bench_models.py --models gspn2_tiny swin_tiny_patch4_window7_224 --modes eager
    python scripts/bench_models.py --json out/models.json --md out/models.md --plot out/models.png

Absolute figures drift between machines and runs; compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.benchmark import aot_config, median_ms, model_at, model_step

DEFAULT_MODELS = [
    "gspn2_tiny",
    "gspn2_small",
    "gspn2_base",
    "convnext_tiny",
    "convnext_small",
    "convnext_base",
    "swin_tiny_patch4_window7_224",
    "swin_small_patch4_window7_224",
    "swin_base_patch4_window7_224",
    "deit_small_patch16_224",
    "mambaout_tiny",
]
# Inference batch per resolution (as the anchors of docs/spec.md 4.2: 256 at 224^2, 8 at 1024^2).
INFER_BATCH = {224: 256, 512: 32, 1024: 8}


@dataclass
class Result:
    model: str
    task: str  # "infer" or "train"
    mode: str  # "eager", "compile" or "compile-ro" (see COMPILE_MODES)
    resolution: int
    batch: int
    params_m: float
    img_per_s: float | None = None
    ms_per_iter: float | None = None
    peak_mem_gb: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


#: ``--modes`` other than eager -> the ``torch.compile`` mode ("compile-ro": CUDA graphs on top of Inductor;
#: "compile-ma": also Inductor's autotuned GEMM templates, which can take the pointwise ops around a GEMM).
COMPILE_MODES = {"compile": "default", "compile-ro": "reduce-overhead", "compile-ma": "max-autotune"}
#: The modes whose compiled model replays CUDA graphs (their memory pool is allocated while recording).
GRAPH_MODES = ("compile-ro", "compile-ma")


def _create(name: str, resolution: int) -> torch.nn.Module:
    return model_at(name, resolution)


def bench_infer(name: str, mode: str, resolution: int, batch: int, warmup: int, iters: int) -> Result:
    step, model = model_step(name, "infer", resolution, batch, COMPILE_MODES.get(mode))
    res = Result(name, "infer", mode, resolution, batch, sum(p.numel() for p in model.parameters()) / 1e6)
    torch.cuda.reset_peak_memory_stats()
    res.extra["first_call_s"] = _first_call_s(step)
    ms = median_ms(step, warmup, iters)
    res.ms_per_iter, res.img_per_s = ms, batch / ms * 1e3
    res.peak_mem_gb = torch.cuda.max_memory_allocated() / 1e9
    return res


def _first_call_s(step) -> float:
    """Seconds of the first call (for compiled modes mostly the compilation), synchronised."""
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 1)


def bench_train(name: str, mode: str, resolution: int, batch: int, warmup: int, iters: int) -> Result:
    step, model = model_step(name, "train", resolution, batch, COMPILE_MODES.get(mode))
    res = Result(name, "train", mode, resolution, batch, sum(p.numel() for p in model.parameters()) / 1e6)
    # The peak is this model's own: without the reset, a compile-ro run would report the largest peak of
    # every model measured before it in this process.
    torch.cuda.reset_peak_memory_stats()
    res.extra["first_call_s"] = _first_call_s(step)
    step()  # the optimizer state exists before the peak memory is measured
    torch.cuda.synchronize()
    # CUDA graphs (compile-ro, compile-ma) allocate their memory pool while recording, in these first steps,
    # and replays allocate nothing: the peak must include the recording, so it is not reset for them.
    if mode not in GRAPH_MODES:
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, warmup, iters)
    res.ms_per_iter, res.img_per_s = ms, batch / ms * 1e3
    res.peak_mem_gb = torch.cuda.max_memory_allocated() / 1e9
    return res


def run_one(fn, *args) -> Result:
    name, mode, resolution, batch = args[:4]
    task = "infer" if fn is bench_infer else "train"
    try:
        return fn(*args)
    except torch.OutOfMemoryError as exc:
        return Result(name, task, mode, resolution, batch, float("nan"), error=f"OOM: {str(exc)[:80]}")
    finally:
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def environment() -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timm": timm.__version__,
        "python": platform.python_version(),
        "gspn2_backend": _gspn2_backend(),
        "inductor_env": inductor_env(),
        "gspn2_options": gspn2_options(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def inductor_env() -> dict:
    """The ``TORCHINDUCTOR_*`` environment variables of the run (Inductor's settings given that way), by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHINDUCTOR_")}


def gspn2_options() -> dict:
    """gspn2's op options in force (:mod:`gspn2.ops.options`: from its ``GSPN2_*`` variables), by name."""
    import dataclasses

    from gspn2.ops import options

    return dataclasses.asdict(options.current())


def _gspn2_backend() -> str:
    from gspn2.ops import _cuda

    return _cuda.describe()


def save_json(path: str | None, env: dict, args: argparse.Namespace, results: list[Result]) -> None:
    """Write everything measured so far (after every result, so a run cut short keeps its figures)."""
    if path:
        with open(path, "w") as f:
            json.dump({"env": env, "args": vars(args), "results": [asdict(r) for r in results]}, f, indent=1)


def to_markdown(results: list[Result], env: dict) -> str:
    lines = [
        f"GPU {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), timm {env['timm']}, "
        f"bf16 autocast, channels_last. gspn2 backend: {env['gspn2_backend']}."
        + (f" torch._functorch.config: {env['aot_config']}." if env.get("aot_config") else "")
        + (" Inductor: " + ", ".join(f"{k}={v}" for k, v in env["inductor_env"].items()) + "."
           if env.get("inductor_env") else "")
        + (" gspn2 options: " + ", ".join(f"{k}={v}" for k, v in env["gspn2_options"].items()) + "."
           if env.get("gspn2_options") else ""),
        "",
        "| model | params (M) | task | mode | res | batch | img/s | ms/iter | peak mem (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.model} | | {r.task} | {r.mode} | {r.resolution} | {r.batch} | {r.error} | | |")
            continue
        lines.append(
            f"| {r.model} | {r.params_m:.1f} | {r.task} | {r.mode} | {r.resolution} | {r.batch} | "
            f"{r.img_per_s:.0f} | {r.ms_per_iter:.2f} | {r.peak_mem_gb:.1f} |"
        )
    return "\n".join(lines) + "\n"


def ratios(results: list[Result], ours: str, peers: list[str]) -> list[str]:
    """``ours / peer`` throughput ratios for every (task, mode, resolution) both ran."""
    index = {(r.model, r.task, r.mode, r.resolution): r for r in results if not r.error}
    out = []
    for (model, task, mode, res), r in sorted(index.items()):
        if model != ours:
            continue
        for peer in peers:
            p = index.get((peer, task, mode, res))
            if p is not None:
                out.append(f"{ours} / {peer} [{task}, {mode}, {res}^2]: {r.img_per_s / p.img_per_s:.2f}x "
                           f"throughput, {r.peak_mem_gb / p.peak_mem_gb:.2f}x peak memory")
    return out


def plot(results: list[Result], path: str) -> None:
    """Bar chart: one panel per (task, resolution), one bar per model and mode (GSPN-2 in red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in results if not r.error and r.img_per_s]
    panels = sorted({(r.task, r.resolution) for r in rows}, key=lambda p: (p[0] != "infer", p[1]))
    if not panels:
        raise ValueError("nothing to plot: no successful results")
    models = list(dict.fromkeys(r.model for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    hatches = {m: h for m, h in zip(modes, ("", "//", "..", "xx"))}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 2, 0.45 * len(models) * len(modes) + 1.5),
                             squeeze=False)
    height = 0.8 / len(modes)
    for i, (ax, (task, res)) in enumerate(zip(axes[0], panels)):
        for k, mode in enumerate(modes):
            for y, model in enumerate(models):
                r = next((r for r in rows if (r.model, r.task, r.mode, r.resolution) == (model, task, mode, res)), None)
                if r is None:
                    continue
                ax.barh(y + (k - (len(modes) - 1) / 2) * height, r.img_per_s, height=height, hatch=hatches[mode],
                        color="tab:red" if model.startswith("gspn2") else "tab:gray", edgecolor="black",
                        linewidth=0.4)
        ax.set_yticks(range(len(models)))
        ax.set_yticklabels(models if i == 0 else [""] * len(models))
        ax.invert_yaxis()
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.set_xlabel("img/s (bf16, channels_last)")
        ax.set_title(f"{task} {res}^2")
    handles = [Patch(facecolor="white", edgecolor="black", hatch=hatches[m], label=m) for m in modes]
    fig.legend(handles=handles, loc="upper right", ncol=len(modes), fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_json(path: str) -> tuple[dict, list[Result]]:
    """The environment and results of a ``--json`` file of an earlier run."""
    with open(path) as f:
        data = json.load(f)
    return data["env"], [Result(**r) for r in data["results"]]


def report(results: list[Result], env: dict, args: argparse.Namespace) -> None:
    """Print the table and the ratios; write --md and --plot when asked."""
    table = to_markdown(results, env)
    lines = []
    for ours, peers in (
        ("gspn2_tiny", ["swin_tiny_patch4_window7_224", "convnext_tiny", "mambaout_tiny", "deit_small_patch16_224"]),
        ("gspn2_small", ["swin_small_patch4_window7_224", "convnext_small"]),
        ("gspn2_base", ["swin_base_patch4_window7_224", "convnext_base"]),
    ):
        lines += ratios(results, ours, peers)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    if args.plot:
        plot(results, args.plot)
    print(table)
    print("\n".join(lines))


def _print(r: Result) -> None:
    if r.error:
        what = r.error
    else:
        what = f"{r.img_per_s:9.0f} img/s  {r.peak_mem_gb:6.1f} GB  first call {r.extra.get('first_call_s')} s"
    print(f"{r.model:32s} {r.task} {r.mode:10s} {r.resolution:5d}: {what}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", *COMPILE_MODES],
                        help="eager, compile (torch.compile default mode), compile-ro (mode='reduce-overhead'), "
                             "compile-ma (mode='max-autotune': long compiles)")
    parser.add_argument("--train-resolutions", nargs="*", type=int, default=[224])
    parser.add_argument("--infer-resolutions", nargs="*", type=int, default=[224, 512, 1024])
    parser.add_argument("--train-batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--aot-config", action="append", default=[], metavar="KEY=VALUE",
                        help="torch._functorch.config.KEY for every compiled model of the run (what AOTAutograd "
                        "saves or recomputes), e.g. ban_recompute_materialized_backward=False; repeatable")
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--md", default=None, help="write the markdown table here")
    parser.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="render --md / --plot from the --json file of an earlier run instead of measuring "
                        "(no GPU needed)")
    args = parser.parse_args()
    if args.from_json:
        env, results = load_json(args.from_json)
        report(results, env, args)
        return
    try:
        aot = aot_config(args.aot_config)
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit("bench_models.py needs a CUDA GPU")
    unknown = [m for m in args.models if not timm.is_model(m)]
    if unknown:
        raise SystemExit(f"--models: unknown timm model(s) {unknown}")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    env = environment()
    env["aot_config"] = aot
    results: list[Result] = []
    with torch._functorch.config.patch(aot):  # every compilation of the run (they happen at first calls)
        for name in args.models:
            for mode in args.modes:
                for res in args.infer_resolutions:
                    r = run_one(bench_infer, name, mode, res, INFER_BATCH.get(res, 8), args.warmup, args.iters)
                    results.append(r)
                    save_json(args.json, env, args, results)
                    _print(r)
                for res in args.train_resolutions:
                    r = run_one(bench_train, name, mode, res, args.train_batch, args.warmup, args.iters)
                    results.append(r)
                    save_json(args.json, env, args, results)
                    _print(r)

    report(results, env, args)


if __name__ == "__main__":
    main()
