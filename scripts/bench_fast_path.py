"""The fast path of the GSPN-2 blocks against their reference formulation, side by side on one GPU.

Each model is built twice with the same weights, ``fast_path=True`` and ``fast_path=False`` (the
module-by-module reference), and measured the way
``scripts/bench_models.py`` measures (bf16 autocast, channels_last, CUDA events, median): inference img/s,
training img/s (forward, backward, fused AdamW step) and training peak memory. Before timing, the two paths
are compared on the GPU (batch 8, 224^2): logits, input gradient and the worst parameter gradient, relative
to the largest magnitude, in fp32 with TF32 off (must agree to 1e-4, else exit code 1) and under bf16
autocast (each path's error against the fp32 reference, for information).

    python scripts/bench_fast_path.py                                  # gspn2_tiny, eager
    python scripts/bench_fast_path.py --models gspn2_tiny gspn2_small --modes eager compile --json fast.json
"""

from __future__ import annotations

import argparse
import json
import time

import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.benchmark import median_ms

FP32_TOLERANCE = 1e-4


def _build(name: str, fast_path: bool, state_dict: dict | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=1000, fast_path=fast_path)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.cuda().to(memory_format=torch.channels_last)


def _grads(model: torch.nn.Module, x: torch.Tensor, bf16: bool):
    model.train()  # default models have no drop path: train mode is deterministic
    model.zero_grad(set_to_none=True)
    x = x.detach().clone(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    weight = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    (out.float() * weight).sum().backward()
    params = {n: p.grad.float() for n, p in model.named_parameters()}
    return out.detach().float(), x.grad.float(), params


def _errors(got, ref) -> dict:
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    worst = max(ref[2], key=lambda n: rel(got[2][n], ref[2][n]))
    return {"logits": rel(got[0], ref[0]), "input_grad": rel(got[1], ref[1]),
            "worst_param_grad": rel(got[2][worst], ref[2][worst]), "worst_param": worst}


def compare(name: str) -> dict:
    """Agreement of the two paths on one batch (fp32 with TF32 off, and bf16 autocast)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        fast = _build(name, True, None)
        ref = _build(name, False, {k: v.cpu() for k, v in fast.state_dict().items()})
        x = torch.randn(8, 3, 224, 224, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        exact = _grads(ref, x, bf16=False)
        out = {"fp32 fast vs reference": _errors(_grads(fast, x, bf16=False), exact),
               "bf16 fast vs fp32 reference": _errors(_grads(fast, x, bf16=True), exact),
               "bf16 reference vs fp32 reference": _errors(_grads(ref, x, bf16=True), exact)}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return out


def measure(name: str, fast_path: bool, mode: str, args) -> dict:
    model = _build(name, fast_path, None)  # same seed: the same weights for both paths
    fwd = torch.compile(model) if mode == "compile" else model
    row = {"model": name, "fast_path": fast_path, "mode": mode}
    try:
        model.eval()
        x = torch.randn(args.infer_batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)

        def infer():
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                fwd(x)

        ms = median_ms(infer, args.warmup, args.iters)
        row["infer_img_per_s"] = args.infer_batch / ms * 1e3

        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
        x = torch.randn(args.train_batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (args.train_batch,), device="cuda")

        def train():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):  # optimizer state exists before the peak is measured
            train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = median_ms(train, args.warmup, args.iters)
        row["train_img_per_s"] = args.train_batch / ms * 1e3
        row["train_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    except torch.OutOfMemoryError as exc:
        row["error"] = f"OOM: {str(exc)[:80]}"
    finally:
        del model, fwd
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return row


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=["gspn2_tiny"])
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compile"])
    parser.add_argument("--infer-batch", type=int, default=256)
    parser.add_argument("--train-batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the agreement and the timings here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fast_path.py needs a CUDA GPU")
    unknown = [m for m in args.models if not m.startswith("gspn2_") or not timm.is_model(m)]
    if unknown:
        raise SystemExit(f"--models: not a registered gspn2_* model: {unknown}")
    torch.backends.cudnn.benchmark = True

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "timm": timm.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    report = {"env": env, "agreement": {}, "rows": []}
    ok = True
    for name in args.models:
        agreement = compare(name)
        report["agreement"][name] = agreement
        for what, errs in agreement.items():
            print(f"{name} {what}: logits {errs['logits']:.2e}, input grad {errs['input_grad']:.2e}, worst "
                  f"param grad {errs['worst_param_grad']:.2e} ({errs['worst_param']})", flush=True)
        fp32 = agreement["fp32 fast vs reference"]
        ok = ok and max(fp32["logits"], fp32["input_grad"], fp32["worst_param_grad"]) <= FP32_TOLERANCE
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for name in args.models:
        for mode in args.modes:
            rows = [measure(name, fast_path, mode, args) for fast_path in (False, True)]
            report["rows"] += rows
            for r in rows:
                label = f"{name} {'fast' if r['fast_path'] else 'reference':9s} {mode:7s}"
                print(label, r.get("error") or (
                    f"infer {r['infer_img_per_s']:7.0f} img/s | train {r['train_img_per_s']:7.0f} img/s, "
                    f"peak {r['train_peak_mem_gb']:5.1f} GB"), flush=True)
            ref, fast = rows
            if "error" not in ref and "error" not in fast:
                keys = ("infer_img_per_s", "train_img_per_s", "train_peak_mem_gb")
                infer, train, mem = (fast[k] / ref[k] for k in keys)
                print(f"{name} {mode} fast / reference: infer {infer:.2f}x, train {train:.2f}x, "
                      f"peak memory {mem:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not ok:
        print(f"FAILED: the fast path differs from the reference by more than {FP32_TOLERANCE:g} in fp32")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
