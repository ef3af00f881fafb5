"""LayerNorm over the last dimension, optionally followed by GELU, as one custom op with a CUDA kernel.

PyTorch's CUDA LayerNorm gives each row a thread block. gspn2's norms run over the channels of
channels-last rows, and their rows are short (40 to 960 channels in gspn2_tiny, millions of rows at the
early stages). On those rows PyTorch's kernels reach a few percent of the memory bandwidth. Eagerly, that
makes the stem's two norms cost more than its convolutions (docs/benchmarks.md, "LayerNorm over
channels"). gspn2's kernel (``gspn2/csrc/layer_norm_rows.cu``) spreads a row over 1 to 32 lanes of a warp:
several rows per warp, 16- or 4-byte accesses, fp32 statistics and warp shuffles. Its backward sums the
weight and bias gradients per thread block, in registers and then in shared memory, and the host adds the
blocks' partial rows in a fixed order, so it is deterministic. With ``gelu`` the same pass applies GELU (erf
form) to the normalised rows, and the backward recomputes the pre-activation from the saved statistics.

Ops (schemas here; the CUDA implementations and their autograd are registered in C++,
``gspn2/csrc/layer_norm.cpp``; every other device runs the ATen formula below):

* ``gspn2::layer_norm(x, weight, bias, eps, gelu) -> (y, mean, rstd)``. ``y`` is contiguous with ``x``'s
  shape and dtype; ``mean`` and ``rstd`` are float32 with shape ``x.shape[:-1]``.
* ``gspn2::layer_norm_backward(grad_y, x, mean, rstd, weight, bias, gelu, output_mask) ->
  (grad_x, grad_weight, grad_bias)``. An output that ``output_mask`` does not ask for, or whose
  parameter is absent, is an empty tensor.

The kernel takes float32, float16 and bfloat16 rows whose byte size is a multiple of 4 and that are at most
:func:`max_channels` long. Weight and bias may have any floating dtype: the kernel reads them as float32,
and their gradients come back in their own dtypes.

:func:`layer_norm` is the public entry. It takes the kernel on CUDA tensors outside ``torch.compile`` where
the option ``layer_norm`` allows it (:mod:`gspn2.ops.options`, ``GSPN2_LAYER_NORM``). Everywhere else it
runs ``F.layer_norm`` (then ``F.gelu``), which Inductor fuses with the ops around it. The pure-PyTorch
specification is :func:`layer_norm_ref`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from gspn2.ops import _cuda
from gspn2.ops import options as _options
from gspn2.ops._amp import autocast_enabled
from gspn2.ops._checks import check_tensor, refuse_forward_ad, refuse_nested

__all__ = ["kernel_call", "kernel_supported", "layer_norm", "layer_norm_ref", "max_channels", "use_kernel"]

_EXTENSION = _cuda.extension_available()
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LIMITS = _cuda.limits() if _EXTENSION else {}

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, bool gelu) -> (Tensor, Tensor, Tensor)")
_LIB.define(
    "layer_norm_backward(Tensor grad_y, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, "
    "bool gelu, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"
)


def max_channels(dtype: torch.dtype, row_bytes_multiple_of_16: bool = True) -> int:
    """The longest row (C) the kernel takes in ``dtype`` (0 without the extension): with 16-byte vectors,
    or (``row_bytes_multiple_of_16=False``) with the 4-byte vectors of rows whose size is not a multiple of
    16 bytes."""
    if not _EXTENSION:
        return 0
    limit = int(_LIMITS["layer_norm_max_channels_32bit" if dtype == torch.float32 else "layer_norm_max_channels_16bit"])
    return limit if row_bytes_multiple_of_16 else limit * 4 // 16


def kernel_supported(x: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes the rows of ``x`` (the last dimension): a built extension, a CUDA
    tensor of float32 / float16 / bfloat16, rows of a multiple of 4 bytes, at most :func:`max_channels`."""
    if not (_EXTENSION and x.is_cuda and x.dtype in _KERNEL_DTYPES and x.dim() >= 1 and x.numel() > 0):
        return False
    row_bytes = x.shape[-1] * x.element_size()
    return row_bytes % 4 == 0 and x.shape[-1] <= max_channels(x.dtype, row_bytes % 16 == 0)


def _check(name: str, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps) -> None:
    check_tensor(name, "x", x)
    for pname, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, pname, t)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: `x` must have a non-empty last dimension, got {tuple(x.shape)}")
    C = x.shape[-1]
    for pname, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != C:
            raise ValueError(f"{name}: `{pname}` must be (C,) with C = {C} (x's last dimension), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name}: `{pname}` is on {t.device}, `x` on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{name}: `eps` must be a float >= 0, got {eps!r}")


def layer_norm_ref(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    gelu: bool = False,
) -> torch.Tensor:
    """The specification: ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased
    variance), then ``gelu`` (erf form) if asked, computed in float32 (float64 for float64 input) and
    returned in ``x.dtype``."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).square().mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(dt)
    if bias is not None:
        y = y + bias.to(dt)
    if gelu:
        y = F.gelu(y)
    return y.to(x.dtype)


def _stats_shape(x: torch.Tensor):
    return tuple(x.shape[:-1])


@torch.library.impl(_LIB, "layer_norm", "CompositeExplicitAutograd")
def _forward_aten(x, weight, bias, eps, gelu):
    _check("layer_norm", x, weight, bias, eps)
    C = x.shape[-1]
    w = weight.to(x.dtype) if weight is not None else None
    b = bias.to(x.dtype) if bias is not None else None
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, (C,), w, b, eps)
    if gelu:
        y = F.gelu(y)
    return y.contiguous(), mean.float().reshape(_stats_shape(x)), rstd.float().reshape(_stats_shape(x))


@torch.library.register_fake("gspn2::layer_norm", lib=_LIB)
def _forward_fake(x, weight, bias, eps, gelu):
    _check("layer_norm", x, weight, bias, eps)
    stats = x.new_empty(_stats_shape(x), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.clone()


def _check_backward(grad_y, x, mean, rstd, weight, bias, output_mask):
    _check("layer_norm_backward", x, weight, bias, 0.0)
    check_tensor("layer_norm_backward", "grad_y", grad_y)
    if tuple(grad_y.shape) != tuple(x.shape) or grad_y.dtype != x.dtype or grad_y.device != x.device:
        raise ValueError(
            f"layer_norm_backward: `grad_y` must match `x` in shape, dtype and device ({tuple(x.shape)}, {x.dtype}, "
            f"{x.device}), got {tuple(grad_y.shape)}, {grad_y.dtype}, {grad_y.device}"
        )
    rows = x.numel() // x.shape[-1]
    for name, t in (("mean", mean), ("rstd", rstd)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != rows or t.device != x.device:
            raise ValueError(f"layer_norm_backward: `{name}` must be float32 with one value per row of x ({rows}) "
                             f"on {x.device}")
    if len(output_mask) != 3:
        raise ValueError(f"layer_norm_backward: `output_mask` must have 3 entries, got {list(output_mask)}")


def _empty_unless(wanted: bool, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if wanted else like.new_empty(0)


@torch.library.impl(_LIB, "layer_norm_backward", "CompositeExplicitAutograd")
def _backward_aten(grad_y, x, mean, rstd, weight, bias, gelu, output_mask):
    """The gradients in float32 arithmetic (float64 for float64 input): with ``g`` the gradient at the
    norm's output (through GELU when ``gelu``) and ``xhat`` the normalised rows, ``grad_x = rstd * (g*w -
    mean(g*w) - xhat * mean(g*w * xhat))``, ``grad_weight = sum(g * xhat)``, ``grad_bias = sum(g)``."""
    _check_backward(grad_y, x, mean, rstd, weight, bias, output_mask)
    dt = torch.promote_types(x.dtype, torch.float32)
    C = x.shape[-1]
    xhat = (x.to(dt) - mean.to(dt).reshape(*x.shape[:-1], 1)) * rstd.to(dt).reshape(*x.shape[:-1], 1)
    w = weight.to(dt) if weight is not None else None
    g = grad_y.to(dt)
    if gelu:
        u = xhat * w if w is not None else xhat
        if bias is not None:
            u = u + bias.to(dt)
        g = torch.ops.aten.gelu_backward(g, u)
    gw = g * w if w is not None else g
    grad_x = rstd.to(dt).reshape(*x.shape[:-1], 1) * (
        gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True)
    )
    rows = g.reshape(-1, C)
    grad_w = (rows * xhat.reshape(-1, C)).sum(0).to(weight.dtype) if weight is not None else None
    grad_b = rows.sum(0).to(bias.dtype) if bias is not None else None
    return (
        _empty_unless(output_mask[0], grad_x.to(x.dtype).contiguous(), x),
        _empty_unless(output_mask[1] and weight is not None, grad_w, x),
        _empty_unless(output_mask[2] and bias is not None, grad_b, x),
    )


@torch.library.register_fake("gspn2::layer_norm_backward", lib=_LIB)
def _backward_fake(grad_y, x, mean, rstd, weight, bias, gelu, output_mask):
    _check_backward(grad_y, x, mean, rstd, weight, bias, output_mask)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else x.new_empty(0),
        torch.empty_like(weight) if output_mask[1] and weight is not None else x.new_empty(0),
        torch.empty_like(bias) if output_mask[2] and bias is not None else x.new_empty(0),
    )


refuse_nested(_LIB, "layer_norm", lambda x, weight, bias, eps, gelu: _check("layer_norm", x, weight, bias, eps))
refuse_nested(
    _LIB, "layer_norm_backward",
    lambda grad_y, x, mean, rstd, weight, bias, gelu, mask: _check_backward(grad_y, x, mean, rstd, weight, bias, mask),
)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, gelu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.gelu = gelu
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], weight is not None and need[1], bias is not None and need[2]]
    gx, gw, gb = torch.ops.gspn2.layer_norm_backward.default(
        grad_y.contiguous(), x, mean, rstd, weight, bias, ctx.gelu, mask
    )
    return gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None


# Every device but CUDA, whose formula (the same one) is registered in C++ for the AutogradCUDA key.
torch.library.register_autograd("gspn2::layer_norm", _backward, setup_context=_setup_context, lib=_LIB)

_DIRECT = _cuda.direct_call("layer_norm")
_OP = torch.ops.gspn2.layer_norm.default


def use_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`layer_norm` takes the CUDA kernel for ``x`` under the current options: not while
    Dynamo traces; ``auto`` where :func:`kernel_supported`; ``cuda`` always on CUDA tensors (an error names
    what the kernel cannot take); ``aten`` never."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return False
    choice = _options.current().layer_norm
    if choice == "aten":
        return False
    if kernel_supported(x):
        return True
    if choice == "cuda":
        C = x.shape[-1] if x.dim() else 0
        raise ValueError(
            f"{_options.LAYER_NORM_ENV}=cuda, but the LayerNorm kernel cannot take `x` ({x.dtype}, C = {C}): it "
            f"needs the extension, float32/float16/bfloat16, C * element size a multiple of 4 bytes and "
            f"C <= {max_channels(x.dtype)} ({max_channels(x.dtype, False)} where C * element size is not a "
            f"multiple of 16 bytes)"
        )
    return False


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    gelu: bool = False,
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``, then GELU (erf form) if ``gelu``; in ``x.dtype``.

    Args:
        x: ``(..., C)``; a non-contiguous ``x`` is copied to contiguous rows first.
        weight, bias: ``(C,)`` or None, any floating dtype (used in float32 by the kernel).
        eps: Added to the biased variance.
        gelu: Apply ``F.gelu`` to the normalised rows in the same pass.

    Runs in ``x.dtype`` with float32 statistics whether or not autocast is on (autocast would run
    ``layer_norm`` in float32). Returns a contiguous tensor of ``x``'s shape: the CUDA kernel where
    :func:`use_kernel` says so, ``F.layer_norm`` (with the parameters cast to ``x.dtype``) and ``F.gelu``
    otherwise.
    """
    if not isinstance(gelu, bool):
        raise TypeError(f"layer_norm: `gelu` must be a bool, got {type(gelu).__name__}")
    if not isinstance(x, torch.Tensor):
        check_tensor("layer_norm", "x", x)  # raises the TypeError
    if use_kernel(x):
        return kernel_call(x, weight, bias, eps, gelu)
    _check("layer_norm", x, weight, bias, eps)
    device_type = "cuda" if x.is_cuda else x.device.type
    if autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return _aten_layer_norm(x, weight, bias, eps, gelu)
    return _aten_layer_norm(x, weight, bias, eps, gelu)


def kernel_call(x, weight, bias, eps: float, gelu: bool) -> torch.Tensor:
    """The op's output ``y`` for a caller that has already found :func:`use_kernel` true (the layers'
    norms): the extension's direct entry where allowed, else ``torch.ops``."""
    refuse_forward_ad("layer_norm", x=x, weight=weight, bias=bias)
    if _DIRECT is not None and _cuda.direct_call_allowed((x, weight, bias)):
        return _DIRECT(x, weight, bias, float(eps), gelu)[0]
    return _OP(x, weight, bias, float(eps), gelu)[0]


def _aten_layer_norm(x, weight, bias, eps, gelu):
    y = F.layer_norm(x, x.shape[-1:], _cast(weight, x.dtype), _cast(bias, x.dtype), eps)
    return F.gelu(y) if gelu else y


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t.to(dtype) if t is not None else None
