"""``gspn2::gelu_linear``: ``F.linear(F.gelu(h), weight, bias)`` as one op, the second half of an MLP.

An MLP's ``fc2(gelu(h))`` run as separate ops writes ``gelu(h)`` (the MLP's widest activation) and reads it
back for the GEMM; its backward writes ``grad_out @ weight``, reads it with ``h`` for GELU's derivative and
recomputes ``gelu(h)`` for the weight gradient: two more passes over the hidden width each way. Here:

* forward: one GEMM whose ``h`` tiles go through GELU as they are loaded; ``h`` is read once, ``gelu(h)``
  never written, and only ``h`` is kept for backward;
* backward: one GEMM for ``grad_out @ weight`` whose epilogue reads ``h`` once and writes ``grad_h`` and
  ``gelu(h)``; the weight gradient ``grad_out.T @ gelu(h)`` and the bias gradient are cuBLAS and a sum.

Ops (the public entry is :func:`gelu_linear`):

* ``gspn2::gelu_linear(h, weight, bias) -> out``;
* ``gspn2::gelu_linear_backward(grad_out, h, weight, has_bias) -> (grad_h, grad_weight, grad_bias)``
  (``grad_bias`` is empty without a bias).

Implementations: on CUDA for float16 and bfloat16 the Triton kernels of :mod:`gspn2.ops._gelu_gemm_triton`
(float32 accumulation, fixed launch configurations: deterministic); everywhere else, float32 on CUDA included
(whose GEMMs then follow PyTorch's TF32 setting), :func:`gelu_linear_ref` and
:func:`gelu_linear_backward_ref`, the same function in PyTorch. All three inputs share one dtype and device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gspn2.ops._amp import autocast_enabled, autocast_off, cast_optional
from gspn2.ops._checks import check_tensor, refuse_nested

__all__ = ["gelu_linear", "gelu_linear_backward_ref", "gelu_linear_ref", "triton_available"]

try:
    from gspn2.ops import _gelu_gemm_triton
except ImportError:  # no Triton (CPU-only torch builds): the reference runs everywhere
    _gelu_gemm_triton = None

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define("gelu_linear(Tensor h, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define(
    "gelu_linear_backward(Tensor grad_out, Tensor h, Tensor weight, bool has_bias) -> (Tensor, Tensor, Tensor)"
)


def triton_available() -> bool:
    """Whether the Triton kernels can be imported (16-bit CUDA tensors then run them)."""
    return _gelu_gemm_triton is not None


def _check(h, weight, bias) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument; each size compared on its own."""
    op = "gelu_linear"
    check_tensor(op, "h", h)
    check_tensor(op, "weight", weight)
    if bias is not None:
        check_tensor(op, "bias", bias)
    if h.dim() != 2 or h.shape[1] < 1:
        raise ValueError(f"{op}: `h` must be (M, K) rows with K >= 1, got shape {tuple(h.shape)}")
    K = h.shape[1]
    if weight.dim() != 2 or weight.shape[1] != K or weight.shape[0] < 1:
        raise ValueError(f"{op}: `weight` must be (N, K) with K = {K} (h's columns), got {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{op}: `bias` must be (N,) = ({weight.shape[0]},) or None, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != h.dtype:
            raise TypeError(f"{op}: `{name}` must have h's dtype {h.dtype}, got {t.dtype}")
        if t.device != h.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, `h` on {h.device}")


def _check_backward(grad_out, h, weight, has_bias) -> None:
    _check(h, weight, None)
    op = "gelu_linear_backward"
    check_tensor(op, "grad_out", grad_out)
    if grad_out.dim() != 2 or grad_out.shape[0] != h.shape[0] or grad_out.shape[1] != weight.shape[0]:
        raise ValueError(
            f"{op}: `grad_out` must be (M, N) = ({h.shape[0]}, {weight.shape[0]}), got {tuple(grad_out.shape)}"
        )
    if grad_out.dtype != h.dtype or grad_out.device != h.device:
        raise ValueError(f"{op}: `grad_out` must match h ({h.dtype}, {h.device}), got {grad_out.dtype}, {grad_out.device}")
    if not isinstance(has_bias, bool):
        raise TypeError(f"{op}: `has_bias` must be a bool, got {type(has_bias).__name__}")


def gelu_linear_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(F.gelu(h), weight, bias)`` in plain differentiable PyTorch (exact GELU), in the inputs' dtype."""
    _check(h, weight, bias)
    with autocast_off(h.device.type):
        return F.linear(F.gelu(h), weight, bias)


def gelu_linear_backward_ref(grad_out, h, weight, has_bias):
    """The gradients of :func:`gelu_linear_ref` written out: ``(grad_h, grad_weight, grad_bias)`` with
    ``grad_bias`` empty when ``has_bias`` is False. The input gradient's product is rounded to the inputs'
    dtype before GELU's derivative, as autograd of the separate ops computes it."""
    _check_backward(grad_out, h, weight, has_bias)
    with autocast_off(h.device.type):
        grad_h = torch.ops.aten.gelu_backward(grad_out @ weight, h)
        grad_w = grad_out.t() @ F.gelu(h)
        grad_b = grad_out.sum(0) if has_bias else grad_out.new_empty((0,))
    return grad_h, grad_w, grad_b


def _use_triton(t: torch.Tensor) -> bool:
    return _gelu_gemm_triton is not None and t.dtype in _KERNEL_DTYPES and t.shape[0] > 0


@torch.library.impl(_LIB, "gelu_linear", "CompositeExplicitAutograd")
def _forward_reference(h, weight, bias):
    return gelu_linear_ref(h, weight, bias)


def triton_forward(h, weight, bias, cfg):
    """The Triton forward on contiguous ``h (M >= 1, K)``, ``weight``, ``bias`` with the launch configuration
    ``cfg`` (:func:`gspn2.ops._gelu_gemm_triton.forward_config`'s keys)."""
    out = torch.empty((h.shape[0], weight.shape[0]), dtype=h.dtype, device=h.device)
    _gelu_gemm_triton.forward(h, weight, bias, out, **cfg)
    return out


def triton_backward(grad_out, h, weight, has_bias, cfg):
    """The Triton backward on contiguous rows with the launch configuration ``cfg`` of its input-side kernel
    (:func:`gspn2.ops._gelu_gemm_triton.backward_config`'s keys): ``(grad_h, grad_weight, grad_bias)``."""
    grad_h = torch.empty_like(h)
    a = torch.empty_like(h)
    _gelu_gemm_triton.backward(grad_out, weight, h, grad_h, a, **cfg)
    grad_b = grad_out.sum(0) if has_bias else grad_out.new_empty((0,))
    return grad_h, grad_out.t() @ a, grad_b


@torch.library.impl(_LIB, "gelu_linear", "CUDA")
def _forward_cuda(h, weight, bias):
    _check(h, weight, bias)
    if not _use_triton(h):
        return gelu_linear_ref(h, weight, bias)
    with torch.cuda.device(h.device):
        cfg = _gelu_gemm_triton.forward_config(weight.shape[0], h.shape[1])
        return triton_forward(h.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), cfg)


@torch.library.register_fake("gspn2::gelu_linear", lib=_LIB)
def _forward_fake(h, weight, bias):
    _check(h, weight, bias)
    return h.new_empty((h.shape[0], weight.shape[0]))


@torch.library.impl(_LIB, "gelu_linear_backward", "CompositeExplicitAutograd")
def _backward_reference(grad_out, h, weight, has_bias):
    return gelu_linear_backward_ref(grad_out, h, weight, has_bias)


@torch.library.impl(_LIB, "gelu_linear_backward", "CUDA")
def _backward_cuda(grad_out, h, weight, has_bias):
    _check_backward(grad_out, h, weight, has_bias)
    if not _use_triton(h):
        return gelu_linear_backward_ref(grad_out, h, weight, has_bias)
    with torch.cuda.device(h.device):
        cfg = _gelu_gemm_triton.backward_config(weight.shape[0], h.shape[1])
        return triton_backward(grad_out.contiguous(), h.contiguous(), weight.contiguous(), has_bias, cfg)


@torch.library.register_fake("gspn2::gelu_linear_backward", lib=_LIB)
def _backward_fake(grad_out, h, weight, has_bias):
    _check_backward(grad_out, h, weight, has_bias)
    return torch.empty_like(h), torch.empty_like(weight), grad_out.new_empty((weight.shape[0] if has_bias else 0,))


refuse_nested(_LIB, "gelu_linear", lambda *args: _check(*args))
refuse_nested(_LIB, "gelu_linear_backward", lambda *args: _check_backward(*args))


def _setup_context(ctx, inputs, output):
    h, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(h, weight)


def _backward(ctx, grad_out):
    h, weight = ctx.saved_tensors
    grad_h, grad_w, grad_b = torch.ops.gspn2.gelu_linear_backward.default(grad_out, h, weight, ctx.has_bias)
    return grad_h, grad_w, grad_b if ctx.has_bias else None


torch.library.register_autograd("gspn2::gelu_linear", _backward, setup_context=_setup_context, lib=_LIB)


def gelu_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(F.gelu(h), weight, bias)`` (exact GELU), keeping only ``h`` for backward.

    Args:
        h: ``(M, K)`` rows, the MLP's pre-activation.
        weight: ``(N, K)``; bias: ``(N,)`` or None (the MLP's second linear layer).

    Under autocast all three are cast to the autocast dtype, as ``F.linear`` casts them; the casts are outside
    the op, so the parameters' gradients reach them through the casts. Returns ``(M, N)`` in that dtype.
    Raises ``TypeError`` / ``ValueError`` naming the argument.
    """
    for name, t in (("h", h), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gelu_linear: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"gelu_linear: `bias` must be a torch.Tensor or None, got {type(bias).__name__}")
    device_type = h.device.type
    if autocast_enabled(device_type):
        dt = torch.get_autocast_dtype(device_type)
        h, weight, bias = h.to(dt), weight.to(dt), cast_optional(bias, dt)
    return torch.ops.gspn2.gelu_linear.default(h, weight, bias)
