"""Triton kernels of ``gspn2::gelu_linear`` and its backward (:mod:`gspn2.ops.gelu_gemm`).

Every tensor is a contiguous row matrix: ``h (M, K)`` (rows are pixels), ``weight (N, K)``, ``grad_out (M, N)``.
GEMMs on the tensor cores (``tl.dot``, float32 accumulation) with the GELU where the data already is:

* forward: ``out = gelu(h) @ weight.T + bias``; GELU is applied to each ``h`` tile as it is loaded (the
  operand of the product), so ``gelu(h)`` is never written;
* backward, input side: ``grad_a = grad_out @ weight`` tile by tile, and in the same program's epilogue
  ``grad_h = grad_a * gelu'(h)`` and ``a = gelu(h)`` (the weight gradient's operand, ``grad_out.T @ a``),
  reading ``h`` once; ``grad_a`` stays in float32 registers.

GELU is the exact (erf) form, computed in float32 from the activation dtype and rounded to it before the
product, as ``F.linear(F.gelu(h), ...)`` computes it. Launch configurations are arguments; :func:`forward_config`
and :func:`backward_config` give the defaults.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


def _pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` (at least 16), at most ``cap``."""
    b = 16
    while b < cap and n % (2 * b) == 0:
        b *= 2
    return b


def forward_config(N: int, K: int) -> dict:
    """Launch configuration of the forward for ``N`` outputs and ``K`` inputs per row: the fastest of
    ``scripts/bench_gelu_linear.py --sweep`` on gspn2_tiny's shapes (H200, bf16; docs/benchmarks.md)."""
    if N > 128:
        return dict(block_m=128, block_n=256, block_k=_pow2_at_most(K, 64), group_m=8, num_warps=8, num_stages=3)
    block_n = max(16, triton.next_power_of_2(N))
    return dict(block_m=64, block_n=block_n, block_k=_pow2_at_most(K, 64), group_m=8, num_warps=4, num_stages=4)


def backward_config(N: int, K: int) -> dict:
    """Launch configuration of the backward's input-side kernel (``K`` outputs per row, ``N`` inner): the
    fastest of the same sweep."""
    block_k = min(128, max(16, triton.next_power_of_2(K)))
    return dict(block_m=64, block_k=block_k, block_n=_pow2_at_most(N, 64), group_m=8, num_warps=4, num_stages=4)


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))


@triton.jit
def _tile(pid, M, NC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order of the output tiles (``GROUP_M`` row tiles share their column tiles in L2):
    ``(pid_m, pid_c)``."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_c: tl.constexpr = (NC + BLOCK_C - 1) // BLOCK_C
    width = GROUP_M * grid_c
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _forward_kernel(
    H, W, Bias, Out, M,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # GELU between the load and the product keeps Triton's pipeliner from staging the h tiles: the next
    # step's tiles are loaded by hand before this step's GELU and product.
    a_next = tl.load(H + rm[:, None] * K + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
    b_next = tl.load(W + rn[None, :] * K + rk[:, None], mask=nmask[None, :] & (rk < K)[:, None], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        a = a_next
        b = b_next
        kk = k0 + BLOCK_K + rk
        kmask = kk < K  # past the last step: all masked, nothing read
        a_next = tl.load(H + rm[:, None] * K + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b_next = tl.load(W + rn[None, :] * K + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        a = _gelu(a.to(tl.float32)).to(a.dtype)  # gelu(0) = 0: the masked entries add nothing
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm[:, None] * N + rn[None, :], acc.to(Out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _backward_kernel(
    G, W, H, GradH, A, M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_k = _tile(tl.program_id(0), M, K, BLOCK_M, BLOCK_K, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N)
    mmask = rm < M
    kmask = rk < K
    mask = mmask[:, None] & kmask[None, :]
    offs = rm[:, None] * K + rk[None, :]
    x = tl.load(H + offs, mask=mask, other=0.0)  # issued first: its latency hides behind the product
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        nn = n0 + rn
        nmask = nn < N
        g = tl.load(G + rm[:, None] * N + nn[None, :], mask=mmask[:, None] & nmask[None, :], other=0.0)
        w = tl.load(W + nn[:, None] * K + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(g, w, acc)
    x = x.to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
    pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    tl.store(GradH + offs, (acc * (cdf + x * pdf)).to(GradH.dtype.element_ty), mask=mask)
    tl.store(A + offs, (x * cdf).to(A.dtype.element_ty), mask=mask)


def forward(h, weight, bias, out, *, block_m, block_n, block_k, group_m, num_warps, num_stages):
    """Launch the forward on contiguous ``h (M, K)``, ``weight (N, K)``, ``bias (N,)`` or None into ``out``."""
    M, K = h.shape
    N = weight.shape[0]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _forward_kernel[grid](
        h, weight, bias if bias is not None else weight, out, M, N=N, K=K, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages,
    )


def backward(grad_out, weight, h, grad_h, a, *, block_m, block_k, block_n, group_m, num_warps, num_stages):
    """Launch the input side of the backward: ``grad_h`` and ``a = gelu(h)`` (both ``(M, K)``, preallocated)."""
    M, K = h.shape
    N = weight.shape[0]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(K, block_k),)
    _backward_kernel[grid](
        grad_out, weight, h, grad_h, a, M, N=N, K=K, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n,
        GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )
