"""Benchmark of the fused propagation kernel on one GPU (four directions per call).

    python scripts/bench_op.py --out-dir docs/bench            # everything (about a minute on an H200)
    python scripts/bench_op.py --quick                          # the headline shapes only
    python scripts/bench_op.py --cluster-choice                 # streaming vs cluster kernels, bf16 and fp32
    python scripts/bench_op.py --host-overhead                  # host cost of one op call, tiny inputs
    python scripts/bench_op.py --short-lines                    # short-line vs streaming kernels, H, W <= 32

For every shape: forward and backward time of the kernels the op picks (the short-line kernels where H
and W are at most 32, the streaming kernels for lines of up to 1024 pixels, with the cluster kernels for the horizontal directions of the float32 forward
on tall images and of the backward on large problems; the general ones beyond) and, side by side, of the general kernels (``kernel="general"``)
where both apply and of the streaming kernels alone (``kernel="fast"``) where the cluster kernel runs; kernel time (median of CUDA-graph replays, triton's
``do_bench_cudagraph``; ``do_bench`` with CUDA events where graphs are unavailable), the achieved fraction
of the bandwidth floor, the pure-PyTorch reference's time where affordable (one iteration) and
FlashAttention (``scaled_dot_product_attention``, bf16, batch B, 4 heads x 64, the same token count H*W)
where affordable.

Bandwidth floor: every byte each direction needs read once per direction (x, that direction's lam and
gates; backward also grad_h and the saved h), every output byte written once, divided by the
device-to-device copy rate measured in the same run (bytes read + bytes written per second).
Writes ``bench_op.json``, ``bench_op.md`` (a markdown table) and ``bench_op_sweep.png`` (log-log time vs
resolution) into ``--out-dir``.

``--host-overhead``: the host cost of one call of each gspn2 op on tiny inputs, as the wall time per call of
back-to-back calls minus the kernel time per call (CUDA-graph replay of the same call). Forward alone
(``gspn_propagate`` and the raw ``torch.ops`` call), and forward plus backward through autograd, for which the
autograd engine's own cost per ``backward()`` (measured on ``torch.addcmul(a, b, c)``: three leaves, as the ops
have, and kernels as short) is shown and subtracted. Writes ``bench_host_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import gspn2  # noqa: F401
from gspn2.benchmark import copy_bandwidth
from gspn2.ops import _cuda, depthwise_conv2d, gspn_propagate, gspn_propagate_ref
from gspn2.ops.dwconv import variant as dwconv_variant


def fwd(x, lam, gates, kernel="auto", cluster_ctas=0):
    """The CUDA forward (below autograd: no input requires grad here)."""
    return torch.ops.gspn2.propagate(x, lam, gates, None, kernel, cluster_ctas)


def bwd(grad_h, x, lam, gates, h, kernel="auto", cluster_ctas=0):
    return torch.ops.gspn2.propagate_backward(grad_h, x, lam, gates, h, None, kernel, cluster_ctas)

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (label, B, C, H, W, K, dtype); the GSPN-1 anchors are those of docs/spec.md 4.1, as the same scan work
TABLE_SHAPES = [
    ("GSPN-1 anchor, K=C", 16, 2, 1024, 1024, 2, "fp32"),
    ("GSPN-1 anchor, K=C", 16, 2, 1024, 1024, 2, "bf16"),
    ("GSPN-1 anchor 32x196, four directions", 32, 49, 32, 32, 49, "fp32"),
    ("GSPN-1 anchor 1x32x128, four directions", 1, 8, 128, 128, 8, "fp32"),
]
for _c in (2, 8):
    for _r in (56, 28, 14, 7):
        TABLE_SHAPES.append((f"model, C_proxy={_c}, K=1", 128, _c, _r, _r, 1, "bf16"))
        TABLE_SHAPES.append((f"model, C_proxy={_c}, K=1", 128, _c, _r, _r, 1, "fp32"))
SWEEP = [64, 128, 256, 512, 1024, 2048]


def median_ms(fn, graph: bool = True) -> float:
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        try:
            return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))
        except Exception:  # noqa: BLE001  (e.g. an op that cannot be captured)
            pass
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def once_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def floor_bytes(B, C, H, W, K, esize):
    px = B * H * W
    fwd = 4 * (3 * px * C + 3 * px * K)  # read x, lam_d, gates_d; write h_d
    bwd = 4 * (5 * px * C + 6 * px * K) + px * C  # read grad_h, x, lam, gates, h; write grad_lam/gates; grad_x
    return fwd * esize, bwd * esize


def inputs(B, C, H, W, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, C, H, W, device="cuda", dtype=dtype, generator=g)
    lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dtype, generator=g)
    gates = 2 * torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dtype, generator=g)
    return x, lam, gates


def sdpa_ms(B, N, budget_flops=2e13):
    """FlashAttention fwd and fwd+bwd, bf16, batch B, 4 heads x 64, N tokens; None if too costly."""
    flops = 4 * B * 4 * N * N * 64  # fwd: QK^T and PV
    if flops > budget_flops:
        return None, None
    q, k, v = (torch.randn(B, 4, N, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    if flops > budget_flops / 20:
        fwd = once_ms(lambda: f(q, k, v))
        fb = once_ms(lambda: f(q, k, v).sum().backward())
    else:
        fwd = median_ms(lambda: f(q, k, v), graph=False)
        fb = median_ms(lambda: f(q, k, v).sum().backward(), graph=False)
    return fwd, fb


def bench_shape(label, B, C, H, W, K, dt, bw, with_ref, with_sdpa):
    dtype = DT[dt]
    x, lam, gates = inputs(B, C, H, W, K, dtype)
    h = fwd(x, lam, gates)
    grad_h = torch.randn_like(h)
    rec = dict(label=label, B=B, C=C, H=H, W=W, K=K, dtype=dt)
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dt]
    rec["plan_fwd"] = _cuda.plan(B, C, H, W, K, name, False, kernel="auto", cluster_ctas=0)
    rec["plan_bwd"] = _cuda.plan(B, C, H, W, K, name, True, kernel="auto", cluster_ctas=0)
    rec["fwd_ms"] = median_ms(lambda: fwd(x, lam, gates))
    rec["bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h))
    # The streaming kernels alone where auto runs the cluster or the short-line kernels, same run.
    if rec["plan_fwd"].get("cluster_ctas") or rec["plan_fwd"]["kernel"] == "short":
        rec["stream_fwd_ms"] = median_ms(lambda: fwd(x, lam, gates, "fast"))
    if rec["plan_bwd"].get("cluster_ctas") or rec["plan_bwd"]["kernel"] == "short":
        rec["stream_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h, "fast"))
    if rec["plan_fwd"].get("kernel") in ("fast", "short"):  # the general kernels on the same inputs, same run
        rec["general_fwd_ms"] = median_ms(lambda: fwd(x, lam, gates, "general"))
        rec["general_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h, "general"))
    fb, bb = floor_bytes(B, C, H, W, K, BYTES[dtype])
    rec["fwd_floor_ms"] = fb / bw * 1e3
    rec["bwd_floor_ms"] = bb / bw * 1e3
    rec["fwd_pct_floor"] = 100 * rec["fwd_floor_ms"] / rec["fwd_ms"]
    rec["bwd_pct_floor"] = 100 * rec["bwd_floor_ms"] / rec["bwd_ms"]
    if with_ref:
        rec["ref_fwd_ms"] = once_ms(lambda: gspn_propagate_ref(x, lam, gates))
        ref = gspn_propagate_ref(x, lam, gates).double()
        rec["rel_err_vs_ref"] = ((h.double() - ref).norm() / ref.norm()).item()  # same-dtype reference
        del ref
    if with_sdpa:
        rec["sdpa_fwd_ms"], rec["sdpa_fwdbwd_ms"] = sdpa_ms(B, H * W)
    del x, lam, gates, h, grad_h
    torch.cuda.empty_cache()
    return rec


def fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def kernel_name(plan) -> str:
    """The plan in a few words: family, channels per block, the cluster kernels' CTAs per line (horizontal,
    with the tiles per input copy where a copy brings several, then the split vertical lines)."""
    name = f"{plan.get('kernel', 'general')} ({plan['cs']})"
    name += f" + cluster x{plan['cluster_ctas']}" if plan.get("cluster_ctas") else ""
    if plan.get("cluster_ctas") and plan.get("cluster_sub", 1) > 1:
        name += f" ({plan['cluster_sub']} tiles per copy)"
    return name + (f" + split x{plan['split_ctas']}" if plan.get("split_ctas") else "")


def markdown(records, bw, env):
    lines = [
        f"GPU: {env['gpu']}; torch {env['torch']}, CUDA {env['cuda']}; copy bandwidth {bw / 1e12:.2f} TB/s "
        "(device-to-device, read + write). Times: median ms, four directions per call, chunk = None.",
        "",
        "| shape (B x C x H x W, K) | dtype | fwd ms | fwd floor ms | fwd % floor | bwd ms | bwd floor ms | "
        "bwd % floor | general kernels fwd / bwd ms | streaming-only fwd / bwd ms | reference fwd ms | "
        "SDPA fwd / fwd+bwd ms | kernel fwd; bwd (channels per block) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        pf = r["plan_fwd"]
        sd = "-" if r.get("sdpa_fwd_ms") is None else f"{fmt(r['sdpa_fwd_ms'])} / {fmt(r['sdpa_fwdbwd_ms'])}"
        gk = "-" if r.get("general_fwd_ms") is None else f"{fmt(r['general_fwd_ms'])} / {fmt(r['general_bwd_ms'])}"
        st = "-" if r.get("stream_fwd_ms") is None and r.get("stream_bwd_ms") is None else \
            f"{fmt(r.get('stream_fwd_ms'))} / {fmt(r.get('stream_bwd_ms'))}"
        pb = r.get("plan_bwd")
        lines.append(
            f"| {r['label']}: {r['B']}x{r['C']}x{r['H']}x{r['W']}, K={r['K']} | {r['dtype']} | {fmt(r['fwd_ms'])} | "
            f"{fmt(r['fwd_floor_ms'])} | {r['fwd_pct_floor']:.0f}% | {fmt(r['bwd_ms'])} | {fmt(r['bwd_floor_ms'])} | "
            f"{r['bwd_pct_floor']:.0f}% | {gk} | {st} | {fmt(r.get('ref_fwd_ms'))} | {sd} | "
            f"{kernel_name(pf)}; {kernel_name(pb) if pb else '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in records if r["label"].startswith("sweep")]
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for dt in sorted({r["dtype"] for r in sweep}):
        rs = sorted((r for r in sweep if r["dtype"] == dt), key=lambda r: r["H"])
        res = [r["H"] for r in rs]
        ax.plot(res, [r["fwd_ms"] for r in rs], "o-", label=f"GSPN-2 kernel fwd ({dt})")
        ax.plot(res, [r["bwd_ms"] for r in rs], "s-", label=f"GSPN-2 kernel bwd ({dt})")
        ax.plot(res, [r["fwd_floor_ms"] for r in rs], ":", color="gray", label=f"fwd bandwidth floor ({dt})")
        ref = [(r["H"], r["ref_fwd_ms"]) for r in rs if r.get("ref_fwd_ms") is not None]
        if ref and dt == "fp32":
            ax.plot(*zip(*ref), "x--", label="PyTorch reference fwd (fp32)")
        sd = [(r["H"], r["sdpa_fwd_ms"]) for r in rs if r.get("sdpa_fwd_ms") is not None]
        if sd and dt == "bf16":
            ax.plot(*zip(*sd), "^--", label="SDPA / FlashAttention fwd (bf16, 4x64)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("resolution (H = W)")
    ax.set_ylabel("time per call, ms (median)")
    ax.set_title(f"B=1, C=8, K=1, four directions ({torch.cuda.get_device_name()})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# Where the cluster kernels pay: (B, C, H, K), W = H; bf16 and float32 ...
CLUSTER_CHOICE_SHAPES = [(1, 8, h, 1) for h in (256, 384, 512, 768, 1024)] + [
    (16, 2, 512, 2), (16, 2, 768, 2), (16, 2, 1024, 2), (4, 2, 1024, 2), (64, 2, 256, 2)]
# ... and smaller problems around the backward's threshold (2^20 elements).
CLUSTER_CHOICE_SMALL = [(32, 49, 32, 49), (128, 2, 32, 1), (128, 8, 64, 1), (1, 8, 64, 1), (1, 8, 128, 8),
                        (16, 2, 128, 2), (64, 2, 128, 2), (16, 4, 128, 2), (1, 8, 192, 1), (16, 2, 256, 2)]


def cluster_choice(out_dir: str) -> list:
    """Forward and backward time of the streaming kernels alone, with the cluster kernels at 2, 4 and 8 CTAs
    per line (``cluster_ctas``: the horizontal lines and the split vertical ones) and under ``auto``, same
    inputs, same run: the data behind the planner's choice."""
    rows = []
    cases = [(shape, dt) for dt in ("bf16", "fp32") for shape in CLUSTER_CHOICE_SHAPES + CLUSTER_CHOICE_SMALL]
    for (B, C, H, K), dt in cases:
        x, lam, gates = inputs(B, C, H, H, K, DT[dt])
        h = fwd(x, lam, gates)
        grad_h = torch.randn_like(h)
        row = dict(B=B, C=C, H=H, W=H, K=K, dtype=dt)
        name = {"fp32": "float32", "bf16": "bfloat16"}[dt]
        row["stream_ms"] = median_ms(lambda: fwd(x, lam, gates, "fast"))
        row["stream_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h, "fast"))
        for n in (2, 4, 8):
            if (H + n - 1) // n <= 512:
                row[f"cluster{n}_ms"] = median_ms(lambda: fwd(x, lam, gates, "cluster", n))
                row[f"cluster{n}_stages"] = _cuda.plan(B, C, H, H, K, name, kernel="cluster", cluster_ctas=n)[
                    "cluster_stages"]
            if (H + n - 1) // n <= (256 if dt == "bf16" else 128):  # the backward kernel's rows per CTA
                row[f"cluster{n}_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h, "cluster", n))
        row["auto_ms"] = median_ms(lambda: fwd(x, lam, gates))
        row["auto_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h))
        for pas, backward in (("", False), ("_bwd", True)):
            plan = _cuda.plan(B, C, H, H, K, name, backward, kernel="auto", cluster_ctas=0)
            row["auto_ctas" + pas] = plan["cluster_ctas"]
            row["auto_split" + pas] = plan.get("split_ctas", 0)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, lam, gates, h, grad_h
        torch.cuda.empty_cache()
    lines = ["| B x C x H x W, K | dtype | pass | streaming only ms | cluster, 2 CTAs/line | 4 | 8 | auto ms | "
             "auto picks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for pas, sfx in (("fwd", ""), ("bwd", "_bwd")):
            cells = [fmt(r.get(f"cluster{n}{sfx}_ms")) for n in (2, 4, 8)]
            picks = "streaming"
            if r[f"auto_ctas{sfx}"]:
                picks = f"cluster x{r[f'auto_ctas{sfx}']}"
                picks += f" + split x{r[f'auto_split{sfx}']}" if r[f"auto_split{sfx}"] else ""
            lines.append(f"| {r['B']}x{r['C']}x{r['H']}x{r['W']}, K={r['K']} | {r['dtype']} | {pas} | "
                         f"{fmt(r[f'stream{sfx}_ms'])} | " + " | ".join(cells)
                         + f" | {fmt(r[f'auto{sfx}_ms'])} | {picks} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench_cluster_choice.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "bench_cluster_choice.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(md)
    return rows


# (B, C, H, W, K): the model stages with lines of up to 32 pixels (C_proxy 2 and 8), the GSPN-1 anchor of
# 32 x 196 channels at 32^2, and batch-1 and multi-group images.
SHORT_LINE_SHAPES = [(128, c, r, r, 1) for c in (2, 8) for r in (28, 14, 7)] + [
    (32, 49, 32, 32, 49), (1, 8, 32, 32, 1), (16, 2, 32, 32, 2), (64, 4, 16, 16, 4)]


def short_lines(out_dir: str) -> list:
    """The short-line kernels (auto on these shapes) against the streaming kernels alone (``kernel="fast"``),
    forward and backward, bf16 and fp32, same inputs, same run; with the bandwidth floor, one launch (a
    one-element copy kernel replayed the same way) and the model-shape target of 3 x floor + one launch."""
    bw = copy_bandwidth()
    a, b = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    launch_ms = median_ms(lambda: b.copy_(a))
    rows = []
    for dt in ("bf16", "fp32"):
        for B, C, H, W, K in SHORT_LINE_SHAPES:
            x, lam, gates = inputs(B, C, H, W, K, DT[dt])
            h = fwd(x, lam, gates, "fast")
            grad_h = torch.randn_like(h)
            name = {"fp32": "float32", "bf16": "bfloat16"}[dt]
            row = dict(B=B, C=C, H=H, W=W, K=K, dtype=dt,
                       kernel=_cuda.plan(B, C, H, W, K, name, False, kernel="auto", cluster_ctas=0)["kernel"],
                       kernel_bwd=_cuda.plan(B, C, H, W, K, name, True, kernel="auto", cluster_ctas=0)["kernel"])
            row["fwd_ms"] = median_ms(lambda: fwd(x, lam, gates))
            row["bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h))
            row["stream_fwd_ms"] = median_ms(lambda: fwd(x, lam, gates, "fast"))
            row["stream_bwd_ms"] = median_ms(lambda: bwd(grad_h, x, lam, gates, h, "fast"))
            fb, bb = floor_bytes(B, C, H, W, K, BYTES[DT[dt]])
            row["fwd_floor_ms"], row["bwd_floor_ms"] = fb / bw * 1e3, bb / bw * 1e3
            row["fwd_target_ms"] = 3 * row["fwd_floor_ms"] + launch_ms
            row["bwd_target_ms"] = 3 * row["bwd_floor_ms"] + launch_ms
            rows.append(row)
            print(json.dumps(row), flush=True)
            del x, lam, gates, h, grad_h
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; one launch {launch_ms * 1e3:.2f} us; target = 3 x floor + one "
             "launch; ms", "",
             "| B x C x H x W, K | dtype | auto fwd / bwd | fwd | streaming fwd | fwd target | bwd | streaming bwd | "
             "bwd target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(key):
            met = r[key] <= r[key.replace("_ms", "_target_ms")]
            return f"**{fmt(r[key])}**" if met else fmt(r[key])
        lines.append(f"| {r['B']}x{r['C']}x{r['H']}x{r['W']}, K={r['K']} | {r['dtype']} | {r['kernel']} / "
                     f"{r['kernel_bwd']} | {cell('fwd_ms')} | {fmt(r['stream_fwd_ms'])} | {fmt(r['fwd_target_ms'])} | "
                     f"{cell('bwd_ms')} | {fmt(r['stream_bwd_ms'])} | {fmt(r['bwd_target_ms'])} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench_short_lines.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "bench_short_lines.json"), "w") as f:
        json.dump(dict(copy_bandwidth_Bps=bw, launch_ms=launch_ms, rows=rows), f, indent=1)
    print(md)
    return rows


def _per_call_us(fn, n: int) -> float:
    """Wall time per call of ``n`` back-to-back calls (after a warm-up), synchronised at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_overhead(out_dir: str, n: int = 2000) -> list:
    """Host cost per call = wall time per back-to-back call - kernel time per call (CUDA-graph replay)."""
    rows = []
    dev = "cuda"
    x, lam, gates = inputs(2, 2, 8, 8, 1, torch.bfloat16)
    xg, lg, gg = (t.detach().clone().requires_grad_(True) for t in (x, lam, gates))
    gh = torch.randn(2, 4, 2, 8, 8, device=dev, dtype=torch.bfloat16)
    xd = torch.randn(2, 16, 8, 8, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    wd, bd = torch.randn(16, 1, 3, 3, device=dev), torch.randn(16, device=dev)
    xdg = xd.detach().clone().requires_grad_(True)
    wdg, bdg = wd.clone().requires_grad_(True), bd.clone().requires_grad_(True)
    gyd = torch.randn_like(xd)
    # The engine's own cost: an aten op with as many leaves (three, each with an AccumulateGrad) as the ops.
    xa, ya, za = (torch.randn(2, 4, 2, 8, 8, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def train_step(f, grad, *params):
        def step():
            f().backward(grad)
            for p in params:
                p.grad = None
        return step

    cases = [
        ("gspn_propagate forward", lambda: gspn_propagate(x, lam, gates), None),
        ("torch.ops.gspn2.propagate forward", lambda: torch.ops.gspn2.propagate(x, lam, gates, None, "auto", 0), None),
        ("depthwise_conv2d forward (3x3, kernel)", lambda: depthwise_conv2d(xd, wd, bd, True), None),
        ("autograd engine: addcmul(a, b, c), 3 leaves, forward + backward",
         train_step(lambda: torch.addcmul(xa, ya, za), gh, xa, ya, za), "engine"),
        ("gspn_propagate forward + backward", train_step(lambda: gspn_propagate(xg, lg, gg), gh, xg, lg, gg), "op"),
        ("depthwise_conv2d forward + backward", train_step(lambda: depthwise_conv2d(xdg, wdg, bdg, True), gyd, xdg, wdg, bdg), "op"),
    ]
    kernel_us = {
        "gspn_propagate forward": median_ms(lambda: fwd(x, lam, gates)) * 1e3,
        "depthwise_conv2d forward (3x3, kernel)": median_ms(lambda: depthwise_conv2d(xd, wd, bd, True)) * 1e3,
    }
    kernel_us["torch.ops.gspn2.propagate forward"] = kernel_us["gspn_propagate forward"]
    h = fwd(x, lam, gates)
    kernel_us["gspn_propagate forward + backward"] = kernel_us["gspn_propagate forward"] + median_ms(
        lambda: bwd(gh, x, lam, gates, h)) * 1e3
    kernel_us["depthwise_conv2d forward + backward"] = kernel_us["depthwise_conv2d forward (3x3, kernel)"] + median_ms(
        lambda: torch.ops.gspn2.depthwise_conv2d_backward(gyd, xd, wd, True, True, *dwconv_variant(3))) * 1e3
    a, b, c = xa.detach(), ya.detach(), za.detach()
    kernel_us["autograd engine: addcmul(a, b, c), 3 leaves, forward + backward"] = median_ms(
        lambda: (torch.addcmul(a, b, c), gh * c, gh * b, gh.clone())) * 1e3
    engine = None
    for name, fn, kind in cases:
        wall = _per_call_us(fn, n)
        host = max(wall - kernel_us[name], 0.0)
        row = dict(case=name, wall_us=wall, kernel_us=kernel_us[name], host_us=host)
        if kind == "engine":
            engine = host
        elif kind == "op" and engine is not None:
            row["host_minus_engine_us"] = max(host - engine, 0.0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = ["| call (tiny inputs, bf16) | wall per call µs | kernel µs | host µs | host minus the autograd engine µs |",
             "|---|---|---|---|---|"]
    for r in rows:
        extra = fmt(r["host_minus_engine_us"]) if "host_minus_engine_us" in r else ""
        lines.append(f"| {r['case']} | {r['wall_us']:.1f} | {r['kernel_us']:.1f} | {r['host_us']:.1f} | {extra} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench_host_overhead.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "bench_host_overhead.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(md)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="headline shapes only, no sweep")
    ap.add_argument("--cluster-choice", action="store_true",
                    help="only streaming vs cluster kernels at 2/4/8 CTAs per line, forward and backward, bf16 and fp32")
    ap.add_argument("--host-overhead", action="store_true", help="only the host cost of one call of each op")
    ap.add_argument("--short-lines", action="store_true",
                    help="only the short-line kernels against the streaming kernels (H, W <= 32), bf16 and fp32")
    args = ap.parse_args()
    assert torch.cuda.is_available() and _cuda.extension_available(), "needs a GPU and the built extension"
    os.makedirs(args.out_dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
    )
    if args.cluster_choice:
        cluster_choice(args.out_dir)
        return
    if args.host_overhead:
        host_overhead(args.out_dir)
        return
    if args.short_lines:
        short_lines(args.out_dir)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {env['gpu']}", flush=True)
    shapes = TABLE_SHAPES[:3] if args.quick else TABLE_SHAPES
    records = []
    for label, B, C, H, W, K, dt in shapes:
        t0 = time.time()
        small = B * C * H * W <= (1 << 22)
        with_ref = dt == "fp32" and (small or (B, C, H, W) == (16, 2, 1024, 1024))
        rec = bench_shape(label, B, C, H, W, K, dt, bw, with_ref=with_ref, with_sdpa=dt == "bf16" or small)
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if not k.startswith("plan")}), f"({time.time() - t0:.1f}s)",
              flush=True)
    if not args.quick:
        for r in SWEEP:
            for dt in ("fp32", "bf16"):
                t0 = time.time()
                rec = bench_shape(f"sweep {r}x{r}", 1, 8, r, r, 1, dt, bw, with_ref=dt == "fp32" and r <= 512,
                                  with_sdpa=dt == "bf16")
                records.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if not k.startswith("plan")}),
                      f"({time.time() - t0:.1f}s)", flush=True)
    out = dict(env=env, copy_bandwidth_Bps=bw, records=records)
    with open(os.path.join(args.out_dir, "bench_op.json"), "w") as f:
        json.dump(out, f, indent=1)
    md = markdown(records, bw, env)
    with open(os.path.join(args.out_dir, "bench_op.md"), "w") as f:
        f.write(md)
    plot(records, os.path.join(args.out_dir, "bench_op_sweep.png"))
    print(md)


if __name__ == "__main__":
    main()
