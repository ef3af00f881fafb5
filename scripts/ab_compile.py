"""Compiled training (or inference) of one model under several settings, compiled in parallel, timed in turn.

Each variant is a name and environment settings (``GSPN2_*`` options, ``TORCHINDUCTOR_*`` variables, ...)
for a process of its own. All the processes build the model, compile it (``torch.compile``, mode
``reduce-overhead`` by default) and run their warm-up steps at the same time, which takes the time of the
slowest compilation instead of the sum; then they take turns on the GPU: one process times its step while the
others wait idle, round after round (the order reversed every other round, so drift shows), and the table
gives each variant's median over the rounds beside the first variant's (the first that did not fail; a
variant that fails is reported and the others still run).

    python scripts/ab_compile.py --variants base: "gemm:GSPN2_SMALL_GEMM=gemm" \\
        "pdl:TORCHINDUCTOR_ENABLE_PDL=1" "swin@swin_tiny_patch4_window7_224:" --rounds 3 --json ab.json

A variant's ``@MODEL`` replaces ``--model`` for it (a peer timed in the same run). A setting named
``inductor.KEY`` sets ``torch._inductor.config.KEY`` in that variant's process (for Inductor settings that
have no environment variable), e.g. ``"s128:inductor.triton.mix_order_reduction_split_size=128"``.

The step is ``scripts/bench_models.py``'s (``gspn2.benchmark.model_step``): bf16 autocast, channels_last,
fused AdamW (training), random inputs, batch 128 for training and 256 for inference at 224^2; each timing
is the median of ``--iters`` CUDA-event-timed steps after ``--warmup`` more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: ``--mode`` choices: torch.compile's modes, or ``eager`` (no compilation).
MODES = COMPILE_MODES + ("eager",)


def parse_variant(text: str) -> tuple[str, str | None, dict]:
    """``"name[@model]:VAR=value,VAR=value"`` -> ``(name, model or None, {VAR: value})``; SystemExit naming
    ``--variants`` if malformed."""
    head, sep, rest = text.partition(":")
    name, _, model = head.partition("@")
    if not sep or not name:
        raise SystemExit(
            f"--variants: expected NAME[@MODEL]:VAR=value,... (settings may be empty), got {text!r}"
        )
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise SystemExit(f"--variants: setting {item!r} of {name!r} is not VAR=value")
        env[var] = value
    return name, model or None, env


def split_settings(env: dict) -> tuple[dict, dict]:
    """The environment variables and the ``inductor.*`` settings (values read as Python literals where they
    parse: ``128``, ``True``; else strings) of a variant."""
    import ast

    plain, inductor = {}, {}
    for key, value in env.items():
        if key.startswith("inductor."):
            try:
                inductor[key[len("inductor."):]] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                inductor[key[len("inductor."):]] = value
        else:
            plain[key] = value
    return plain, inductor


def child(args: argparse.Namespace) -> None:
    """One variant: compile and warm up, print ``ready``, then one timing per ``time`` line on stdin."""
    import torch
    import torch._inductor.config as inductor_config

    import gspn2  # noqa: F401  (registers the gspn2_* models)
    from gspn2.benchmark import median_ms, model_step

    for key, value in json.loads(args.inductor).items():  # the variant's inductor.* settings
        target = inductor_config
        *path, attr = key.split(".")
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, attr):
            raise SystemExit(f"--variants: torch._inductor.config has no setting {key!r}")
        setattr(target, attr, value)
    dev = args.device
    cuda = dev == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    batch = args.batch or (128 if args.task == "train" else 256)
    mode = None if args.mode == "eager" else args.mode
    step, _ = model_step(args.model, args.task, args.resolution, batch, mode, device=dev)

    t0 = time.perf_counter()
    for _ in range(3):  # compilation, CUDA-graph recording, the optimizer's state
        step()
    if cuda:
        torch.cuda.synchronize()
    print(json.dumps({"ready": True, "compile_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "time":
            break
        ms = median_ms(step, args.warmup, args.iters, cuda=cuda)
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
        print(json.dumps({"ms": ms, "img_per_s": batch / ms * 1e3, "peak_mem_gb": peak}), flush=True)


def _read_json(proc: subprocess.Popen, name: str) -> dict:
    """The next JSON line of a child's stdout (other lines are passed through); raises if it exits first."""
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
        print(f"[{name}] {line}", flush=True)
    raise RuntimeError(f"variant {name!r} exited with status {proc.wait()} before reporting")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gspn2_tiny")
    parser.add_argument("--variants", nargs="+", default=[],
                        help="NAME[@MODEL]:VAR=value,VAR=value ... (one process each)")
    parser.add_argument("--task", choices=["train", "infer"], default="train")
    parser.add_argument("--mode", choices=MODES, default="reduce-overhead",
                        help="torch.compile mode, or eager")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a check of the script itself (no timing worth reporting)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batch", type=int, default=None, help="default 128 (train) / 256 (infer)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="write every timing here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inductor", default="{}", help=argparse.SUPPRESS)  # child: its inductor.* settings
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if not args.variants:
        raise SystemExit("--variants: name at least one variant (NAME[@MODEL]:VAR=value,...)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    for flag in ("resolution", "iters"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or (args.batch is not None and args.batch < 1):
        raise SystemExit(f"--warmup must be >= 0 and --batch >= 1, got {args.warmup} and {args.batch}")
    variants = [parse_variant(v) for v in args.variants]
    names = [n for n, _, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variants: names must differ, got {names}")
    import timm
    import torch

    import gspn2  # noqa: F401

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ab_compile.py needs a CUDA GPU (--device cpu checks the script itself)")
    for model in [args.model] + [m for _, m, _ in variants if m]:
        if not timm.is_model(model):
            raise SystemExit(f"--model / --variants: unknown timm model {model!r}")
    common = ["--task", args.task, "--mode", args.mode, "--device", args.device,
              "--resolution", str(args.resolution), "--warmup", str(args.warmup), "--iters", str(args.iters)]
    if args.batch:
        common += ["--batch", str(args.batch)]
    procs = {}
    for name, model, env in variants:
        plain, inductor = split_settings(env)
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--model", model or args.model, *common,
             "--inductor", json.dumps(inductor)],
            env={**os.environ, **plain}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
    results = {name: {"model": model or args.model, "env": env, "ms": []} for name, model, env in variants}
    try:
        for name in names:
            try:
                results[name].update(_read_json(procs[name], name))
            except RuntimeError as exc:  # a variant that fails is reported, the others are still timed
                results[name]["error"] = str(exc)
                print(exc, flush=True)
        for r in range(args.rounds):
            live = [name for name in names if "error" not in results[name]]
            for name in live if r % 2 == 0 else live[::-1]:
                procs[name].stdin.write("time\n")
                procs[name].stdin.flush()
                try:
                    got = _read_json(procs[name], name)
                except RuntimeError as exc:
                    results[name]["error"] = str(exc)
                    print(exc, flush=True)
                    continue
                results[name]["ms"].append(got["ms"])
                results[name]["peak_mem_gb"] = got["peak_mem_gb"]
    finally:
        for proc in procs.values():
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
            proc.wait()
    live = [name for name in names if "error" not in results[name]]
    base = statistics.median(results[live[0]]["ms"]) if live else float("nan")
    title = f"{args.task} {args.resolution}^2, {args.device}, mode={args.mode}, {args.rounds} rounds"
    header = ("| variant | model | settings | ms per step (median) | each round | vs first | peak GB "
              "| compile s |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|---|"]
    for name in names:
        res = results[name]
        settings = ", ".join(f"{k}={v}" for k, v in res["env"].items()) or "-"
        if "error" in res:
            lines.append(f"| {name} | {res['model']} | {settings} | failed: {res['error']} | | | | |")
            continue
        med = statistics.median(res["ms"])
        rounds = " / ".join(f"{m:.2f}" for m in res["ms"])
        peak = "-" if res["peak_mem_gb"] != res["peak_mem_gb"] else f"{res['peak_mem_gb']:.2f}"  # NaN: CPU
        lines.append(f"| {name} | {res['model']} | {settings} | {med:.2f} | {rounds} | {base / med:.3f}x | "
                     f"{peak} | {res['compile_s']} |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
