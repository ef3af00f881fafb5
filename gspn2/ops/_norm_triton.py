"""Triton kernel of ``gspn2::norm_gate_backward`` (:mod:`gspn2.ops.norm_backward`).

Rows are pixels, columns channels: every activation is a contiguous ``(N, E)`` row matrix. One program takes a
contiguous run of rows, ``BLOCK_M`` whole rows (``E`` padded to ``BLOCK_E``) at a time, so the LayerNorm
backward's two row sums stay in registers; per row block it reads the incoming gradient, ``x`` and the gate once
and writes ``grad_x``, ``grad_gate`` and the normalised, gated rows (the input of the GEMM's weight gradient)
once. The columns sums of the norm's weight and bias gradients accumulate per tile element over the program's
rows and are reduced over the tile's rows once at the end: every program writes its own ``(BLOCK_E,)`` partial
sums, which the caller adds in a fixed order (deterministic). Arithmetic is float32.

The launch configuration (rows per block, warps, programs) is an argument of :func:`backward`, with
:func:`config` giving the default.
"""

from __future__ import annotations

import triton
import triton.language as tl


def config(E: int) -> dict:
    """Default launch configuration for rows of ``E`` channels: ``block_e`` (``E`` padded to a power of two),
    ``block_m`` (rows per step, about 1024 tile elements), ``num_warps`` (8: about 4 tile elements per thread),
    ``num_stages`` (the row loop's software-pipelining depth) and ``per_sm`` (programs per SM). The fastest of
    ``scripts/bench_norm_backward.py --sweep`` at E = 480 (docs/benchmarks.md)."""
    block_e = max(16, triton.next_power_of_2(E))
    block_m = max(1, 1024 // block_e)
    return {"block_e": block_e, "block_m": block_m, "num_warps": 8, "num_stages": 1, "per_sm": 8}


@triton.jit
def _rows(G, X, Z, Mean, Rstd, GX, GZ, M, w, b, cols, cmask, rows, end, acc_w, acc_b, E: tl.constexpr):
    """One step of ``_kernel``: rows ``rows`` (those below ``end``); returns the column sums' accumulators."""
    rmask = rows < end
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * E + cols[None, :]
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(Mean + rows, mask=rmask, other=0.0)
    rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    # The normalised row as the forward stored it (rounded to the activations' dtype).
    n = (xhat * w[None, :] + b[None, :]).to(M.dtype.element_ty).to(tl.float32)
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    s = z * sig
    tl.store(GZ + offs, (g * n * sig * (1.0 + z * (1.0 - sig))).to(GZ.dtype.element_ty), mask=mask)
    tl.store(M + offs, (n * s).to(M.dtype.element_ty), mask=mask)
    gn = g * s  # the gradient of the norm's output
    acc_w += gn * xhat
    acc_b += gn
    gxh = gn * w[None, :]
    c1 = tl.sum(gxh * xhat, axis=1) / E
    c2 = tl.sum(gxh, axis=1) / E
    gx = (gxh - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    tl.store(GX + offs, gx.to(GX.dtype.element_ty), mask=mask)
    return acc_w, acc_b


@triton.jit
def _kernel(
    G, X, Z, Mean, Rstd, NW, NB, GX, GZ, M, PartW, PartB, N, rows_per_program,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program ``p``: rows ``[p * rows_per_program, (p + 1) * rows_per_program)``, ``BLOCK_M`` at a time."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    w = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(NB + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_w = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    if NUM_STAGES > 1:  # a software-pipelined row loop
        for i in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):
            acc_w, acc_b = _rows(G, X, Z, Mean, Rstd, GX, GZ, M, w, b, cols, cmask, start + i + tl.arange(0, BLOCK_M),
                                 end, acc_w, acc_b, E)
    else:  # a while loop: Triton 3.6's interpreter cannot take a kernel argument as a range() bound
        i = 0
        while i < rows_per_program:
            acc_w, acc_b = _rows(G, X, Z, Mean, Rstd, GX, GZ, M, w, b, cols, cmask, start + i + tl.arange(0, BLOCK_M),
                                 end, acc_w, acc_b, E)
            i += BLOCK_M
    tl.store(PartW + pid * BLOCK_E + cols, tl.sum(acc_w, axis=0))
    tl.store(PartB + pid * BLOCK_E + cols, tl.sum(acc_b, axis=0))


def backward(grad, x, gate, mean, rstd, norm_weight, norm_bias, grad_x, grad_gate, normed, part_w, part_b, *,
             block_m, block_e, num_warps, num_stages, rows_per_program):
    """Launch on contiguous rows; ``part_w``, ``part_b`` are ``(programs, block_e)`` float32 with ``programs =
    cdiv(N, rows_per_program)``."""
    N, E = x.shape
    _kernel[(part_w.shape[0],)](
        grad, x, gate, mean, rstd, norm_weight, norm_bias, grad_x, grad_gate, normed, part_w, part_b, N,
        rows_per_program, E=E, BLOCK_M=block_m, BLOCK_E=block_e, NUM_STAGES=num_stages, num_warps=num_warps,
    )
