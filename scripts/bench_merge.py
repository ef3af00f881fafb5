"""The mixer's output chain as one op against the formulation the models train with, on gspn2_tiny's shapes.

    python scripts/bench_merge.py                       # the four stages of gspn2_tiny at batch 128, bf16
    python scripts/bench_merge.py --sweep               # also the Triton kernels alone, over launch configs
    python scripts/bench_merge.py --json out/merge.json

Per stage (N = batch x side^2 rows, E = 1.5 C hidden channels, R = 8 merged proxy channels, C outputs), from
``uh (N, R)``, ``v (N, E)`` and ``z (N, E)`` to the mixer's output ``(N, C)``, forward and forward + backward:

* ``separate``: ``rows_linear`` (proj_up plus the skip), then ``norm_linear`` (the norm, the gate and
  out_proj in one autograd function): what ``GSPN2Mixer.forward_fused`` runs, eagerly;
* ``compiled``: the same under ``torch.compile`` (Inductor fuses the skip, the norm and the gate, forward
  and backward, into its own kernels; the GEMMs stay cuBLAS), what a compiled model runs;
* ``fused``: ``merge_norm_gate`` (proj_up, the skip, the norm and the gate in one op), then ``rows_linear``
  (out_proj).

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), bf16 autocast with float32
parameters as in training. ``--sweep`` times the forward and backward kernels alone over launch
configurations around the default (``gspn2.ops._merge_triton.config``). The last lines are a markdown table.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from gspn2.benchmark import cudagraph_ms, fused_op_args, fwd_and_fwd_bwd_ms, selected_stages

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


def _kernel_times(a, p, cfg: dict, per_sm: int) -> tuple[float, float]:
    """The forward and the backward Triton kernels alone (with their small host-side sums), launched with
    ``cfg`` and ``per_sm`` backward programs per SM."""
    from gspn2.ops.merge import row_programs, triton_backward, triton_forward

    uh, v, z = (t.detach() for t in a.values())
    w, b, s, nw, nb = (p[k].detach() for k in ("w_up", "b_up", "skip", "nw", "nb"))
    N, E = v.shape
    programs = row_programs(v.device, N, E, cfg, per_sm)
    go = torch.randn_like(v)
    _, mean, rstd = triton_forward(uh, w, b, v, s, nw, nb, 1e-6, z, cfg)
    return (
        cudagraph_ms(lambda: triton_forward(uh, w, b, v, s, nw, nb, 1e-6, z, cfg)),
        cudagraph_ms(lambda: triton_backward(go, uh, w, b, v, s, nw, nb, z, mean, rstd, cfg, programs)),
    )


def _sweep(base: dict):
    """Launch configurations around the default: the forward's rows and warps, the backward's rows, channels
    per chunk, warps and programs per SM."""
    yield dict(base), 4
    for fm, fw in ((2 * base["fwd_block_m"], base["fwd_warps"]), (base["fwd_block_m"], 2 * base["fwd_warps"])):
        yield dict(base, fwd_block_m=fm, fwd_warps=fw), 4
    for chunk_e, warps, per_sm in itertools.product((32, 64), (2, 4, 8), (2, 4, 8)):
        if chunk_e <= base["block_e"]:
            yield dict(base, chunk_e=chunk_e, bwd_warps=warps), per_sm
    yield dict(base, bwd_block_m=32), 4


def main(argv=None) -> None:
    args = fused_op_args("bench_merge.py", __doc__, argv)
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.ops import _merge_triton as K

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows, sweep = [], []
    for side, C in selected_stages(args.sides):
        N, E = args.batch * side * side, int(round(1.5 * C))
        a, p = _inputs(N, E, C, dtype)
        leaves = [*a.values(), *p.values()]
        compiled = torch.compile(_separate, fullgraph=True)
        sep = fwd_and_fwd_bwd_ms(lambda: _separate(a, p), leaves, dtype)
        com = fwd_and_fwd_bwd_ms(lambda: compiled(a, p), leaves, dtype)
        fus = fwd_and_fwd_bwd_ms(lambda: _fused(a, p), leaves, dtype)
        rows.append(dict(side=side, N=N, E=E, C=C, separate=sep, compiled=com, fused=fus))
        print(f"{side}^2 N={N} E={E}: separate {sep[0]:.4f} / {sep[1]:.4f} ms, compiled {com[0]:.4f} / {com[1]:.4f} "
              f"ms, fused {fus[0]:.4f} / {fus[1]:.4f} ms", flush=True)
        if args.sweep:
            for cfg, per_sm in _sweep(K.config(E)):
                what = (f"fwd {cfg['fwd_block_m']} rows / {cfg['fwd_warps']} warps, bwd {cfg['bwd_block_m']} rows x "
                        f"{cfg['chunk_e']} channels / {cfg['bwd_warps']} warps, {per_sm} programs/SM")
                try:
                    t = _kernel_times(a, p, cfg, per_sm)
                except Exception as exc:  # a configuration the GPU cannot run (shared memory, registers)
                    print(f"  {what}: {type(exc).__name__}")
                    continue
                sweep.append(dict(side=side, config=cfg, programs_per_sm=per_sm, fwd_ms=t[0], bwd_ms=t[1]))
                print(f"  {what}: {t[0]:.4f} / {t[1]:.4f} ms", flush=True)
    if args.json:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch, dtype=args.dtype)
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, sweep=sweep), f, indent=1)
    print("\n| stage | N x E | separate fwd / fwd+bwd ms | compiled fwd / fwd+bwd ms | fused fwd / fwd+bwd ms | "
          "fused / compiled (fwd+bwd) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        (sf, sb), (cf, cb), (ff, fb) = r["separate"], r["compiled"], r["fused"]
        print(f"| {r['side']}^2 | {r['N']} x {r['E']} | {sf:.4f} / {sb:.4f} | {cf:.4f} / {cb:.4f} | {ff:.4f} / {fb:.4f} "
              f"| {fb / cb:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
