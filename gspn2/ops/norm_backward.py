"""``gspn2::norm_gate_backward``: the backward of a LayerNorm over channels followed by a SiLU gate, in one pass.

The mixer's output is ``out_proj(layer_norm(y) * silu(z))`` (docs/spec.md, section 2). Given ``grad``, the
gradient of the gated rows (``grad_out @ out_proj.weight``), the rest of the chain's backward is elementwise
work and two row sums per row::

    n = layer_norm(y) (recomputed from the forward's row statistics)       m = n * silu(z)
    grad_z = grad * n * silu'(z)                                             grad_n = grad * silu(z)
    grad_y = LayerNorm backward of grad_n                                    (and the norm's weight, bias)

This op reads ``grad``, ``y`` and ``z`` once and writes ``grad_y``, ``grad_z`` and ``m`` (the input of
``out_proj``'s weight gradient) once. Eagerly the separate ops read and write each several times; under
``torch.compile`` Inductor fuses them into one reduction kernel as well, and keeps ``m`` from the forward
instead of recomputing it (docs/benchmarks.md, "The gated norm's backward as one op").

``gspn2::norm_gate_backward(grad, x, gate, mean, rstd, norm_weight, norm_bias) -> (grad_x, grad_gate,
grad_norm_weight, grad_norm_bias, normed)``, all rows ``(N, E)`` but the ``(N,)`` float32 statistics and the
``(E,)`` parameters; the outputs in the dtype of the input they belong to, ``normed`` in ``grad``'s.

Implementations: on CUDA for float32, float16 and bfloat16 rows the Triton kernel of
:mod:`gspn2.ops._norm_triton` (float32 arithmetic; the parameter gradients as per-program partial sums added
in a fixed order: deterministic); everywhere else (and for float64) :func:`norm_gate_backward_ref`, the same
formulas in PyTorch. The training mixer takes it in the backward of its gated norm with the option
``norm_backward="fused"`` (:mod:`gspn2.ops.options`; ``auto`` keeps the separate ops, measured faster).
"""

from __future__ import annotations

import torch

from gspn2.ops._amp import autocast_off
from gspn2.ops._checks import check_tensor, refuse_nested
from gspn2.ops.merge import sm_count
from gspn2.ops.reference import _compute_dtype

__all__ = ["norm_gate_backward", "norm_gate_backward_ref", "triton_available"]

try:
    from gspn2.ops import _norm_triton
except ImportError:  # no Triton (CPU-only torch builds): the reference runs everywhere
    _norm_triton = None

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OP = "norm_gate_backward"

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define(
    "norm_gate_backward(Tensor grad, Tensor x, Tensor gate, Tensor mean, Tensor rstd, Tensor norm_weight, "
    "Tensor norm_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def triton_available() -> bool:
    """Whether the Triton kernel can be imported (CUDA tensors then run it)."""
    return _norm_triton is not None


def _check(grad, x, gate, mean, rstd, norm_weight, norm_bias) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument; each size compared on its own."""
    names = ("grad", "x", "gate", "mean", "rstd", "norm_weight", "norm_bias")
    tensors = (grad, x, gate, mean, rstd, norm_weight, norm_bias)
    for name, t in zip(names, tensors):
        check_tensor(_OP, name, t)
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"{_OP}: `x` must be (N, E) rows with E >= 1, got shape {tuple(x.shape)}")
    N, E = x.shape
    for name, t in (("grad", grad), ("gate", gate)):
        if tuple(t.shape) != (N, E):
            raise ValueError(f"{_OP}: `{name}` must be (N, E) = {(N, E)} like `x`, got {tuple(t.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        if tuple(t.shape) != (N,):
            raise ValueError(f"{_OP}: `{name}` must be (N,) = ({N},), got {tuple(t.shape)}")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if tuple(t.shape) != (E,):
            raise ValueError(f"{_OP}: `{name}` must be (E,) = ({E},), got {tuple(t.shape)}")
    for name, t in zip(names, tensors):
        if t.device != x.device:
            raise ValueError(f"{_OP}: `{name}` is on {t.device}, `x` on {x.device}")


def norm_gate_backward_ref(grad, x, gate, mean, rstd, norm_weight, norm_bias):
    """The op's formulas in PyTorch, computed in float32 (float64 for float64 rows): ``(grad_x, grad_gate,
    grad_norm_weight, grad_norm_bias, normed)``, each in its input's dtype (``normed`` in ``grad``'s)."""
    _check(grad, x, gate, mean, rstd, norm_weight, norm_bias)
    ct = _compute_dtype(x.dtype)
    with autocast_off(x.device.type):
        E = x.shape[1]
        xhat = (x.to(ct) - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
        w = norm_weight.to(ct)
        # The normalised rows as a forward in x's dtype stores them.
        n = (xhat * w + norm_bias.to(ct)).to(x.dtype).to(ct)
        z = gate.to(ct)
        sig = torch.sigmoid(z)
        s = z * sig
        g = grad.to(ct)
        grad_gate = g * n * sig * (1 + z * (1 - sig))
        gn = g * s
        gxh = gn * w
        grad_x = rstd.to(ct)[:, None] * (
            gxh - (gxh * xhat).sum(1, keepdim=True) / E * xhat - gxh.sum(1, keepdim=True) / E
        )
        return (
            grad_x.to(x.dtype), grad_gate.to(gate.dtype), (gn * xhat).sum(0).to(norm_weight.dtype),
            gn.sum(0).to(norm_bias.dtype), (n * s).to(grad.dtype),
        )


@torch.library.impl(_LIB, _OP, "CompositeExplicitAutograd")
def _reference(grad, x, gate, mean, rstd, norm_weight, norm_bias):
    return norm_gate_backward_ref(grad, x, gate, mean, rstd, norm_weight, norm_bias)


def triton_backward(grad, x, gate, mean, rstd, norm_weight, norm_bias, cfg, programs):
    """The Triton kernel on contiguous rows (N >= 1) with the launch configuration ``cfg``
    (:func:`gspn2.ops._norm_triton.config`'s keys) over ``programs`` runs of rows: the op's five outputs."""
    N, E = x.shape
    block_m = cfg["block_m"]
    rows = -(-N // programs)
    rows = -(-rows // block_m) * block_m  # whole row blocks per program
    programs = -(-N // rows)
    grad_x = torch.empty((N, E), dtype=x.dtype, device=x.device)
    grad_gate = torch.empty((N, E), dtype=gate.dtype, device=x.device)
    normed = torch.empty((N, E), dtype=grad.dtype, device=x.device)
    # Every program writes its whole partial row: no initialisation.
    part_w = torch.empty((programs, cfg["block_e"]), dtype=torch.float32, device=x.device)
    part_b = torch.empty_like(part_w)
    _norm_triton.backward(
        grad, x, gate, mean, rstd, norm_weight, norm_bias, grad_x, grad_gate, normed, part_w, part_b,
        block_m=block_m, block_e=cfg["block_e"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        rows_per_program=rows,
    )
    return (
        grad_x, grad_gate, part_w.sum(0)[:E].to(norm_weight.dtype), part_b.sum(0)[:E].to(norm_bias.dtype), normed,
    )


@torch.library.impl(_LIB, _OP, "CUDA")
def _cuda(grad, x, gate, mean, rstd, norm_weight, norm_bias):
    _check(grad, x, gate, mean, rstd, norm_weight, norm_bias)
    if (_norm_triton is None or x.dtype not in _KERNEL_DTYPES or grad.dtype not in _KERNEL_DTYPES
            or gate.dtype not in _KERNEL_DTYPES or x.shape[0] == 0):
        return norm_gate_backward_ref(grad, x, gate, mean, rstd, norm_weight, norm_bias)
    cfg = _norm_triton.config(x.shape[1])
    with torch.cuda.device(x.device):
        return triton_backward(
            grad.contiguous(), x.contiguous(), gate.contiguous(), mean.float().contiguous(),
            rstd.float().contiguous(), norm_weight.contiguous(), norm_bias.contiguous(), cfg,
            cfg["per_sm"] * sm_count(x.device.index),
        )


@torch.library.register_fake(f"gspn2::{_OP}", lib=_LIB)
def _fake(grad, x, gate, mean, rstd, norm_weight, norm_bias):
    _check(grad, x, gate, mean, rstd, norm_weight, norm_bias)
    rows = torch.contiguous_format
    return (
        torch.empty_like(x, memory_format=rows), torch.empty_like(gate, memory_format=rows),
        torch.empty_like(norm_weight), torch.empty_like(norm_bias), torch.empty_like(grad, memory_format=rows),
    )


refuse_nested(_LIB, _OP, lambda *args: _check(*args))


def norm_gate_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
):
    """The backward of ``layer_norm(x, weight=norm_weight, bias=norm_bias) * F.silu(gate)`` over the last
    dimension, from the gradient ``grad`` of that product and the forward's row statistics.

    Returns ``(grad_x, grad_gate, grad_norm_weight, grad_norm_bias, normed)``, where ``normed`` is the
    product itself, recomputed (``layer_norm(x)`` rounded to ``x.dtype``, times ``silu(gate)``, in
    ``grad.dtype``), for the weight gradient of the GEMM that consumed it.

    Shapes: ``grad, x, gate (N, E)``, ``mean, rstd (N,)`` (float32 for the kernel; ``rstd = 1 / sqrt(var +
    eps)``), ``norm_weight, norm_bias (E,)``. Not differentiable (a backward). Argument errors raise
    ``TypeError`` / ``ValueError`` naming the argument.
    """
    # Before the schema, which refuses a non-tensor without naming it; the op's implementations check the rest.
    for name, t in (("grad", grad), ("x", x), ("gate", gate), ("mean", mean), ("rstd", rstd),
                    ("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    return torch.ops.gspn2.norm_gate_backward(grad, x, gate, mean, rstd, norm_weight, norm_bias)
