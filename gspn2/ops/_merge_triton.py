"""Triton kernels of ``gspn2::merge_norm_gate`` and its backward (:mod:`gspn2.ops.merge`).

Rows are pixels, columns channels: every tensor is a contiguous ``(N, E)`` (or ``(N, R)``) row matrix. The
forward and the backward's row terms hold whole rows per program, so the LayerNorm's row reductions stay in
registers. Arithmetic is float32; activations are read and written in their own dtype; parameters are read
in theirs.

* forward: ``y = x @ weight.T + bias + skip_input * skip`` (R multiply-adds per element, no tensor cores),
  ``out = layer_norm(y) * silu(gate)``; writes ``out`` and the row statistics.
* backward, two kernels. The row terms: the LayerNorm backward's two row means (whole rows per program).
  The columns: a program per channel chunk and contiguous run of row blocks recomputes ``y`` the same way,
  writes ``grad_gate``, ``grad_skip_input`` and its chunk's share of ``grad_x`` (a tile product with the
  weight), and accumulates the column sums of the parameter gradients (``weight`` by a tile product,
  ``bias``, ``skip``, the norm's weight and bias) in registers over its rows. Every program writes its own
  partial sums; the caller adds them in a fixed order, so the result is deterministic.

The launch configuration (rows, channels and warps per program; the backward's programs) is an argument of
the launchers, with :func:`config` giving the default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def config(E: int) -> dict:
    """Default launch configuration for rows of ``E`` channels, about 8 tile elements per thread:

    * ``block_e``: the channels padded to a power of two (whole rows: forward and row terms);
    * ``fwd_block_m``, ``fwd_warps``: rows and warps of a forward program, and of a row-terms program;
    * ``bwd_block_m``, ``chunk_e``, ``bwd_warps``: rows per step (16 at least: the tile products), channels
      and warps of a backward column program.
    """
    block_e = max(16, triton.next_power_of_2(E))
    fwd_m = max(1, 1024 // block_e)
    # 32 channels by 16 rows over 4 warps: 113 registers on sm_90 (Triton 3.8), four programs per SM.
    chunk_e = min(block_e, 32)
    return {
        "block_e": block_e,
        "fwd_block_m": fwd_m,
        "fwd_warps": max(4, min(16, fwd_m * block_e // 256)),
        "bwd_block_m": 16,
        "chunk_e": chunk_e,
        "bwd_warps": 4,
    }


@triton.jit
def _merged(X, W, Bias, v, s, rows, cols, rmask, cmask, R: tl.constexpr):
    """``x @ W.T + bias + v * s`` for a tile, in float32 (``v``, ``s`` already loaded)."""
    b = tl.load(Bias + cols, mask=cmask, other=0.0).to(tl.float32)
    y = v * s[None, :] + b[None, :]
    for k in tl.static_range(R):
        xk = tl.load(X + rows * R + k, mask=rmask, other=0.0).to(tl.float32)
        wk = tl.load(W + cols * R + k, mask=cmask, other=0.0).to(tl.float32)
        y += xk[:, None] * wk[None, :]
    return y


@triton.jit
def _whole_rows(X, W, Bias, V, S, N, E, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's ``BLOCK_M`` whole rows: their indices, masks and offsets, and ``y`` there."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < N
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * E + cols[None, :]
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + cols, mask=cmask, other=0.0).to(tl.float32)
    return rows, cols, rmask, cmask, mask, offs, _merged(X, W, Bias, v, s, rows, cols, rmask, cmask, R)


@triton.jit
def _forward_kernel(
    X, W, Bias, V, S, NW, NB, Z, Out, Mean, Rstd, N, E, eps,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows, cols, rmask, cmask, mask, offs, y = _whole_rows(X, W, Bias, V, S, N, E, R, BLOCK_M, BLOCK_E)
    mean = tl.sum(y, axis=1) / E  # padded columns hold 0
    d = tl.where(mask, y - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / E + eps)
    nw = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    nb = tl.load(NB + cols, mask=cmask, other=0.0).to(tl.float32)
    a = d * rstd[:, None] * nw[None, :] + nb[None, :]
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    out = a * (z * tl.sigmoid(z))
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=rmask)
    tl.store(Rstd + rows, rstd, mask=rmask)


@triton.jit
def _row_terms_kernel(
    GradOut, X, W, Bias, V, S, NW, NB, Z, Mean, Rstd, C1, C2, N, E,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """The LayerNorm backward's two row means, ``mean(g)`` and ``mean(g * n)`` with ``g`` the gradient of
    the normalised row (after the norm's weight) and ``n`` the normalised row: whole rows per program."""
    rows, cols, rmask, cmask, mask, offs, y = _whole_rows(X, W, Bias, V, S, N, E, R, BLOCK_M, BLOCK_E)
    mean = tl.load(Mean + rows, mask=rmask, other=0.0)
    rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
    n = tl.where(mask, (y - mean[:, None]) * rstd[:, None], 0.0)
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(GradOut + offs, mask=mask, other=0.0).to(tl.float32)
    nw = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    gn = go * (z * tl.sigmoid(z)) * nw[None, :]
    tl.store(C1 + rows, tl.sum(gn, axis=1) / E, mask=rmask)
    tl.store(C2 + rows, tl.sum(gn * n, axis=1) / E, mask=rmask)


@triton.jit
def _column_kernel(
    GradOut, X, W, Bias, V, S, NW, NB, Z, Mean, Rstd, C1, C2,
    GradX, GradV, GradZ, PartVec, PartW, N, E, blocks_per_program,
    R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_E: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    """Program ``(c, p)``: channels ``[c * CHUNK_E, (c + 1) * CHUNK_E)`` of the ``p``-th contiguous run of row
    blocks. Writes ``grad_gate`` and ``grad_skip_input`` there, this chunk's share of ``grad_x``
    (``GradX[c]``, float32, summed over the chunks by the caller) and the chunk's column sums of the five
    parameter gradients (``PartVec[p]``, ``PartW[p]``)."""
    chunk = tl.program_id(0)
    pid = tl.program_id(1)
    cols = chunk * CHUNK_E + tl.arange(0, CHUNK_E)
    cmask = cols < E
    ks = tl.arange(0, R_PAD)
    kmask = ks < R
    s = tl.load(S + cols, mask=cmask, other=0.0).to(tl.float32)
    nw = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    nb = tl.load(NB + cols, mask=cmask, other=0.0).to(tl.float32)
    # the weight's chunk as (CHUNK_E, R_PAD), for this chunk's share of grad_x = grad_y @ weight
    wt = tl.load(W + cols[:, None] * R + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
    # The column sums per tile element, reduced over the tile's rows once after the loop: no cross-warp
    # reduction per row block.
    acc_nw = tl.zeros((BLOCK_M, CHUNK_E), tl.float32)
    acc_nb = tl.zeros((BLOCK_M, CHUNK_E), tl.float32)
    acc_s = tl.zeros((BLOCK_M, CHUNK_E), tl.float32)
    acc_b = tl.zeros((BLOCK_M, CHUNK_E), tl.float32)
    acc_w = tl.zeros((CHUNK_E, R_PAD), tl.float32)
    gx_base = GradX + chunk.to(tl.int64) * N * R
    # A contiguous run of row blocks (the last ones may be empty). A while loop: Triton 3.6's interpreter
    # cannot take a kernel argument as a range() bound.
    i = 0
    while i < blocks_per_program:
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + (pid * blocks_per_program + i) * BLOCK_M
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * E + cols[None, :]
        v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
        y = _merged(X, W, Bias, v, s, rows, cols, rmask, cmask, R)
        mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        n = tl.where(mask, (y - mean[:, None]) * rstd[:, None], 0.0)
        z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
        sg = tl.sigmoid(z)
        go = tl.load(GradOut + offs, mask=mask, other=0.0).to(tl.float32)
        ga = go * (z * sg)  # gradient of the norm's output
        gz = go * (n * nw[None, :] + nb[None, :]) * (sg * (1.0 + z * (1.0 - sg)))
        tl.store(GradZ + offs, gz.to(GradZ.dtype.element_ty), mask=mask)
        acc_nw += ga * n
        acc_nb += ga
        c1 = tl.load(C1 + rows, mask=rmask, other=0.0)
        c2 = tl.load(C2 + rows, mask=rmask, other=0.0)
        gy = tl.where(mask, rstd[:, None] * (ga * nw[None, :] - c1[:, None] - n * c2[:, None]), 0.0)
        tl.store(GradV + offs, (gy * s[None, :]).to(GradV.dtype.element_ty), mask=mask)
        acc_s += gy * v
        acc_b += gy
        xt = tl.load(X + rows[:, None] * R + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if DOT_IEEE:  # float32 activations: full float32 products
            acc_w += tl.dot(tl.trans(gy), xt.to(tl.float32), input_precision="ieee")
            gx = tl.dot(gy, wt.to(tl.float32), input_precision="ieee")
        else:  # 16-bit activations: the products in their dtype, as a GEMM on them would run
            gy16 = gy.to(xt.dtype)
            acc_w += tl.dot(tl.trans(gy16), xt)
            gx = tl.dot(gy16, wt.to(xt.dtype))
        tl.store(gx_base + rows[:, None] * R + ks[None, :], gx, mask=rmask[:, None] & kmask[None, :])
        i += 1
    base = PartVec + pid.to(tl.int64) * 4 * E
    tl.store(base + cols, tl.sum(acc_nw, axis=0), mask=cmask)
    tl.store(base + E + cols, tl.sum(acc_nb, axis=0), mask=cmask)
    tl.store(base + 2 * E + cols, tl.sum(acc_s, axis=0), mask=cmask)
    tl.store(base + 3 * E + cols, tl.sum(acc_b, axis=0), mask=cmask)
    tl.store(PartW + pid.to(tl.int64) * E * R + cols[:, None] * R + ks[None, :], acc_w,
             mask=cmask[:, None] & kmask[None, :])


def forward(x, weight, bias, v, skip, norm_weight, norm_bias, eps, gate, out, mean, rstd, *, block_m, num_warps,
            block_e):
    """Launch the forward on contiguous row matrices (``out``, ``mean``, ``rstd`` preallocated)."""
    N, E = v.shape
    grid = (triton.cdiv(N, block_m),)
    _forward_kernel[grid](
        x, weight, bias, v, skip, norm_weight, norm_bias, gate, out, mean, rstd, N, E, eps,
        R=x.shape[1], BLOCK_M=block_m, BLOCK_E=block_e, num_warps=num_warps,
    )


def backward(grad_out, x, weight, bias, v, skip, norm_weight, norm_bias, gate, mean, rstd, c1, c2, grad_x_parts,
             grad_v, grad_gate, part_vec, part_w, *, block_e, rows_block_m, rows_warps, block_m, chunk_e, num_warps):
    """Launch the backward: the row terms (``c1``, ``c2``: (N,) float32 scratch), then
    ``part_vec.shape[0]`` runs of row blocks for each of the ``grad_x_parts.shape[0]`` channel chunks of
    ``chunk_e`` channels. ``grad_x_parts (chunks, N, R)`` float32 receives each chunk's share of ``grad_x``;
    ``part_vec (programs, 4, E)`` and ``part_w (programs, E, R)`` each run's column sums (norm weight, norm
    bias, skip, bias; weight)."""
    N, E = v.shape
    R = x.shape[1]
    _row_terms_kernel[(triton.cdiv(N, rows_block_m),)](
        grad_out, x, weight, bias, v, skip, norm_weight, norm_bias, gate, mean, rstd, c1, c2, N, E,
        R=R, BLOCK_M=rows_block_m, BLOCK_E=block_e, num_warps=rows_warps,
    )
    programs = part_vec.shape[0]
    _column_kernel[(grad_x_parts.shape[0], programs)](
        grad_out, x, weight, bias, v, skip, norm_weight, norm_bias, gate, mean, rstd, c1, c2,
        grad_x_parts, grad_v, grad_gate, part_vec, part_w, N, E, triton.cdiv(triton.cdiv(N, block_m), programs),
        R=R, R_PAD=max(16, triton.next_power_of_2(R)), BLOCK_M=block_m, CHUNK_E=chunk_e,
        DOT_IEEE=x.dtype == torch.float32, num_warps=num_warps,
        # No software pipelining of the row loop: its staged tiles would take shared memory for little gain.
        num_stages=1,
    )
