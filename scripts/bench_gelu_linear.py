"""The MLP's ``fc2(gelu(h))`` as one op against the separate ops, on gspn2_tiny's shapes.

    python scripts/bench_gelu_linear.py                  # the four stages of gspn2_tiny at batch 128, bf16
    python scripts/bench_gelu_linear.py --sweep          # also the two Triton kernels over launch configs
    python scripts/bench_gelu_linear.py --json out/gelu_linear.json

Per stage (M = batch x side^2 rows, K = 4 C hidden channels, N = C outputs), forward and forward + backward
(the gradients of ``h``, the weight and the bias):

* ``eager``: ``gspn2.layers.gelu_linear`` with the option ``mlp="separate"`` (GELU, then cuBLAS) run eagerly;
* ``compiled``: the same under ``torch.compile`` (Inductor fuses GELU's forward, its derivative and the
  recomputed GELU into its own kernels; the GEMMs stay cuBLAS), what a compiled model runs;
* ``fused``: ``gspn2.ops.gelu_linear`` (GELU inside the GEMMs).

``floor``: the bytes the fused op must move (forward: read h, write out; backward: read grad_out twice and h
once, write grad_h and gelu(h) and read gelu(h) back for the weight gradient) at the device-to-device copy
rate measured in the same run. Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``),
bf16 autocast with float32 parameters as in training. ``--sweep`` times each Triton kernel alone over launch
configurations around the default, next to the cuBLAS GEMM plus the elementwise kernel it replaces. The last
lines are a markdown table.
"""

from __future__ import annotations

import json
import sys

import torch

from gspn2.benchmark import cudagraph_ms, fused_op_args, fwd_and_fwd_bwd_ms, selected_stages



def _forward_configs(N: int, K: int):
    from gspn2.ops import _gelu_gemm_triton as T

    base = T.forward_config(N, K)
    yield base
    yield dict(base, num_warps=4, num_stages=4)
    yield dict(base, block_m=64, num_warps=4, num_stages=4)
    yield dict(base, block_n=64, num_warps=4, num_stages=4)
    if N > 128:
        yield dict(base, block_n=256, num_warps=8, num_stages=3)


def _backward_configs(N: int, K: int):
    from gspn2.ops import _gelu_gemm_triton as T

    base = T.backward_config(N, K)
    yield base
    yield dict(base, num_warps=4, num_stages=4)
    yield dict(base, block_m=64, num_warps=4, num_stages=4)
    yield dict(base, block_k=64, num_warps=4, num_stages=4)
    yield dict(base, block_k=256, num_warps=8, num_stages=3)


def _sweep(M: int, K: int, N: int, dtype: torch.dtype):
    """Each Triton kernel alone over launch configurations, and the cuBLAS GEMM plus elementwise kernel it
    replaces (eager: GELU then ``F.linear``; ``mm`` then GELU's derivative and GELU)."""
    import torch.nn.functional as F

    from gspn2.ops import _gelu_gemm_triton as T

    h = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    go = torch.randn(M, N, device="cuda", dtype=dtype)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    grad_h, a = torch.empty_like(h), torch.empty_like(h)
    rows = [dict(kernel="forward", config="cuBLAS + GELU", ms=cudagraph_ms(lambda: F.linear(F.gelu(h), w, b)))]
    rows.append(dict(kernel="backward", config="cuBLAS + GELU'", ms=cudagraph_ms(
        lambda: (torch.ops.aten.gelu_backward(go @ w, h), F.gelu(h)))))
    for cfg in _forward_configs(N, K):
        try:
            t = cudagraph_ms(lambda: T.forward(h, w, b, out, **cfg))
        except Exception as exc:  # a configuration the GPU cannot run (shared memory, registers)
            t = f"{type(exc).__name__}"
        rows.append(dict(kernel="forward", config=cfg, ms=t))
    for cfg in _backward_configs(N, K):
        try:
            t = cudagraph_ms(lambda: T.backward(go, w, h, grad_h, a, **cfg))
        except Exception as exc:
            t = f"{type(exc).__name__}"
        rows.append(dict(kernel="backward", config=cfg, ms=t))
    return rows


def main(argv=None) -> None:
    args = fused_op_args("bench_gelu_linear.py", __doc__, argv)
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.benchmark import copy_bandwidth
    from gspn2.layers import gelu_linear as layer_gelu_linear
    from gspn2.ops import gelu_linear, options

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    size = torch.finfo(dtype).bits // 8
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows, sweep = [], []
    for side, C in selected_stages(args.sides):
        M, K, N = args.batch * side * side, 4 * C, C
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(M, K, generator=g, device="cuda")).to(dtype).requires_grad_()
        w = (torch.randn(N, K, generator=g, device="cuda") / K**0.5).requires_grad_()
        b = torch.randn(N, generator=g, device="cuda").requires_grad_()
        with options.override(mlp="separate"):  # read when each is traced: on their first calls, here
            eager = fwd_and_fwd_bwd_ms(lambda: layer_gelu_linear(h, w, b), (h, w, b), dtype)
            separate = torch.compile(layer_gelu_linear, fullgraph=True)
            compiled = fwd_and_fwd_bwd_ms(lambda: separate(h, w, b), (h, w, b), dtype)
        fused = fwd_and_fwd_bwd_ms(lambda: gelu_linear(h, w, b), (h, w, b), dtype)
        floor = (size * (M * K + M * N) / rate * 1e3, size * (2 * M * N + 4 * M * K) / rate * 1e3)
        rows.append(dict(side=side, M=M, K=K, N=N, eager=eager, compiled=compiled, fused=fused, floor=floor))
        print(f"{side}^2 M={M} K={K} N={N}: eager {eager[0]:.4f} / {eager[1]:.4f} ms, compiled {compiled[0]:.4f} / "
              f"{compiled[1]:.4f} ms, fused {fused[0]:.4f} / {fused[1]:.4f} ms, floor {floor[0]:.4f} / "
              f"{floor[0] + floor[1]:.4f} ms", flush=True)
        if args.sweep:
            for r in _sweep(M, K, N, dtype):
                sweep.append(dict(side=side, **r))
                ms = f"{r['ms']:.4f} ms" if isinstance(r["ms"], float) else r["ms"]
                print(f"  {r['kernel']:8s} {r['config']}: {ms}", flush=True)
    if args.json:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch, dtype=args.dtype,
                   copy_rate_tb_s=rate / 1e12)
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, sweep=sweep), f, indent=1)
    print("\n| stage | M x K -> N | eager fwd / fwd+bwd ms | compiled fwd / fwd+bwd ms | fused fwd / fwd+bwd ms | "
          "fused floor fwd / fwd+bwd ms | fused / compiled (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        (ef, eb), (cf, cb), (ff, fb), (lf, lb) = r["eager"], r["compiled"], r["fused"], r["floor"]
        print(f"| {r['side']}^2 | {r['M']} x {r['K']} -> {r['N']} | {ef:.4f} / {eb:.4f} | {cf:.4f} / {cb:.4f} | "
              f"{ff:.4f} / {fb:.4f} | {lf:.4f} / {lf + lb:.4f} | {fb / cb:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
