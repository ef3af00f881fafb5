"""The mixer's output chain as one op against the formulation the models train with, on gspn2_tiny's shapes.

    python scripts/bench_merge.py                       # the four stages of gspn2_tiny at batch 128, bf16
    python scripts/bench_merge.py --sweep               # also the Triton kernels alone, over launch configs
    python scripts/bench_merge.py --json out/merge.json

Per stage (N = batch x side^2 rows, E = 1.5 C hidden channels, R = 8 merged proxy channels, C outputs), from
``uh (N, R)``, ``v (N, E)`` and ``z (N, E)`` to the mixer's output ``(N, C)``, forward and forward + backward:

* ``separate``: ``rows_linear`` (proj_up plus the skip), then ``norm_linear`` (the norm, the gate and
  out_proj in one autograd function): what ``GSPN2Mixer.forward_fused`` runs;
* ``fused``: ``merge_norm_gate`` (proj_up, the skip, the norm and the gate in one op), then ``rows_linear``
  (out_proj).

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), bf16 autocast with float32
parameters as in training. ``--sweep`` times the forward and backward kernels alone for each
``(block_m, num_warps)`` and backward programs per SM. The last lines are a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

#: gspn2_tiny: (side of the feature map at 224^2, C); the mixer's hidden width is 1.5 C.
STAGES = ((56, 80), (28, 160), (14, 320), (7, 640))
R = 8


def _inputs(N: int, E: int, C: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dt).requires_grad_()

    acts = dict(uh=r(N, R, dt=dtype), v=r(N, E, dt=dtype), z=r(N, E, dt=dtype))
    params = dict(w_up=r(E, R, scale=0.3), b_up=r(E), skip=r(E), nw=r(E, scale=0.1), nb=r(E, scale=0.1),
                  w_out=r(C, E, scale=E**-0.5), b_out=r(C))
    return acts, params


def _separate(a, p):
    from gspn2.layers import norm_linear, rows_linear

    y = rows_linear(a["uh"], p["w_up"], p["b_up"], a["v"], p["skip"])
    return norm_linear(y, p["nw"], p["nb"], 1e-6, p["w_out"], p["b_out"], chunks=1, gate=a["z"])[0]


def _fused(a, p):
    from gspn2.layers import rows_linear
    from gspn2.ops import merge_norm_gate

    m = merge_norm_gate(a["uh"], p["w_up"], p["b_up"], a["v"], p["skip"], p["nw"], p["nb"], 1e-6, a["z"])
    return rows_linear(m, p["w_out"], p["b_out"])


def _ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def _chain_times(chain, a, p, dtype) -> tuple[float, float]:
    leaves = [*a.values(), *p.values()]

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            chain(a, p)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=dtype):
            out = chain(a, p)
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    fwd_bwd()  # autograd's first run outside the graph capture
    return _ms(fwd), _ms(fwd_bwd)


def _kernel_times(a, p, cfg: dict, programs_per_sm: int) -> tuple[float, float]:
    """The forward and backward Triton kernels alone, launched with ``cfg``."""
    from gspn2.ops import _merge_triton as K

    uh, v, z = (t.detach() for t in a.values())
    w, b, s, nw, nb = (p[k].detach() for k in ("w_up", "b_up", "skip", "nw", "nb"))
    N, E = v.shape
    out, mean, rstd = torch.empty_like(v), v.new_empty(N, dtype=torch.float32), v.new_empty(N, dtype=torch.float32)
    fwd_cfg = dict(block_m=cfg["fwd_block_m"], num_warps=cfg["fwd_warps"], block_e=cfg["block_e"])
    bwd_cfg = dict(block_m=cfg["bwd_block_m"], num_warps=cfg["bwd_warps"], block_e=cfg["block_e"])
    sms = torch.cuda.get_device_properties(v.device).multi_processor_count
    blocks = -(-N // cfg["bwd_block_m"])
    programs = max(1, min((blocks + 1) // 2, programs_per_sm * sms))
    gx, gv, gz = torch.empty_like(uh), torch.empty_like(v), torch.empty_like(z)
    pv = torch.empty(programs, 4, E, device=v.device)
    pw = torch.empty(programs, E, R, device=v.device)
    go = torch.randn_like(v)
    K.forward(uh, w, b, v, s, nw, nb, 1e-6, z, out, mean, rstd, **fwd_cfg)
    return (
        _ms(lambda: K.forward(uh, w, b, v, s, nw, nb, 1e-6, z, out, mean, rstd, **fwd_cfg)),
        _ms(lambda: K.backward(go, uh, w, b, v, s, nw, nb, z, mean, rstd, gx, gv, gz, pv, pw, **bwd_cfg)),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels over launch configurations")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_merge.py needs a CUDA GPU")
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.ops import _merge_triton as K

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows, sweep = [], []
    for side, C in STAGES:
        N, E = args.batch * side * side, int(round(1.5 * C))
        a, p = _inputs(N, E, C, dtype)
        sep = _chain_times(_separate, a, p, dtype)
        fus = _chain_times(_fused, a, p, dtype)
        rows.append(dict(side=side, N=N, E=E, C=C, separate=sep, fused=fus))
        print(f"{side}^2 N={N} E={E}: separate {sep[0]:.4f} / {sep[1]:.4f} ms, fused {fus[0]:.4f} / {fus[1]:.4f} ms",
              flush=True)
        if args.sweep:
            base = K.config(E)
            for fm, bm, warps, pps in itertools.product((4, 16, 64), (16, 32, 64), (4, 8), (1, 2, 4)):
                cfg = dict(base, fwd_block_m=fm, bwd_block_m=bm, fwd_warps=warps, bwd_warps=warps)
                try:
                    t = _kernel_times(a, p, cfg, pps)
                except Exception as exc:  # a configuration the GPU cannot run (shared memory, registers)
                    print(f"  fwd_m={fm} bwd_m={bm} warps={warps} programs/SM={pps}: {type(exc).__name__}")
                    continue
                sweep.append(dict(side=side, fwd_block_m=fm, bwd_block_m=bm, warps=warps, programs_per_sm=pps,
                                  fwd_ms=t[0], bwd_ms=t[1]))
                print(f"  fwd_m={fm} bwd_m={bm} warps={warps} programs/SM={pps}: {t[0]:.4f} / {t[1]:.4f} ms",
                      flush=True)
    if args.json:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch, dtype=args.dtype)
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, sweep=sweep), f, indent=1)
    print("\n| stage | N x E | separate fwd / fwd+bwd ms | fused fwd / fwd+bwd ms | fused / separate (fwd+bwd) |")
    print("|---|---|---|---|---|")
    for r in rows:
        (sf, sb), (ff, fb) = r["separate"], r["fused"]
        print(f"| {r['side']}^2 | {r['N']} x {r['E']} | {sf:.4f} / {sb:.4f} | {ff:.4f} / {fb:.4f} | {fb / sb:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
