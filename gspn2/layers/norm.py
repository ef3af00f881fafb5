"""LayerNorm over channels that stays in the activation dtype under autocast."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import LayerNorm2d as _TimmLayerNorm2d
from timm.layers import register_notrace_function

from gspn2.ops._amp import autocast_enabled
from gspn2.ops.layernorm import kernel_call as layer_norm_kernel
from gspn2.ops.layernorm import use_kernel as use_layer_norm_kernel

__all__ = [
    "LayerNorm2d", "layer_norm2d_gelu", "layer_norm_last_dim", "layer_norm_rows", "layer_norm_rows_backward"
]

torch.fx.wrap("layer_norm_last_dim")  # the same for a plain torch.fx.symbolic_trace
torch.fx.wrap("layer_norm2d_gelu")


def layer_norm_rows(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)``: LayerNorm over the last dimension of ``x`` in plain ops, for ``torch.compile``.

    The statistics and the affine step are float32 (float64 for float64 ``x``) and ``weight`` and ``bias``
    enter as they are: float32 parameters are not rounded to ``x.dtype`` first, as ATen's one-dtype kernel
    needs (whose casts, and the casts of their gradients back, are kernels of their own in a compiled
    step). ``y`` has ``x.dtype``; ``mean`` and ``rstd`` are float32 with a trailing dimension of 1, as
    ``native_layer_norm`` returns them. Inductor fuses these ops as it fuses its own decomposition of the
    norm; their backward is autograd's, or :func:`layer_norm_rows_backward`.

    Shapes: ``(..., C) -> (..., C), (..., 1), (..., 1)``; ``weight`` and ``bias`` are ``(C,)`` or None.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype), mean, rstd


def layer_norm_rows_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    mask: List[bool],
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of :func:`layer_norm_rows` for rows ``x (N, C)``: ``(grad_x, grad_weight, grad_bias)``, those
    that ``mask`` asks for (else None), in float32 (float64 for float64 ``x``) but ``grad_x`` (``x.dtype``),
    from the forward's ``mean`` and ``rstd`` (``(N, 1)``), as ``native_layer_norm_backward`` computes
    them."""
    ct = torch.promote_types(x.dtype, torch.float32)
    g = grad.to(ct)
    xhat = (x.to(ct) - mean) * rstd
    grad_x = grad_w = grad_b = None
    if mask[0]:
        gw = g * weight if weight is not None else g
        c1 = gw.mean(-1, keepdim=True)
        c2 = (gw * xhat).mean(-1, keepdim=True)
        grad_x = (rstd * (gw - c1 - xhat * c2)).to(x.dtype)
    if mask[1] and weight is not None:
        grad_w = (g * xhat).sum(0)
    if mask[2]:
        grad_b = g.sum(0)
    return grad_x, grad_w, grad_b


@register_notrace_function  # torch.fx: the autocast query must run when the graph runs
def layer_norm_last_dim(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``, computed and returned in ``x.dtype``.

    Autocast runs ``layer_norm`` in fp32: a bf16 input is copied to fp32, normalised by the fp32 kernel,
    saved for backward in fp32 and copied back to bf16 by the next convolution or GEMM. Here the kernel
    reads and writes the activation dtype instead (its statistics are fp32 inside the kernel either way)
    and ``weight``/``bias`` are cast to that dtype, as ATen's CUDA kernel wants one dtype for all three.
    Without autocast this is plain ``F.layer_norm``. Eagerly on CUDA tensors, gspn2's LayerNorm kernel
    (:func:`gspn2.ops.layer_norm`, the option ``layer_norm``) computes it instead, in ``x.dtype`` with the
    parameters read in their own dtype; under ``torch.compile`` with autocast, :func:`layer_norm_rows` does
    the same in plain ops.

    Shapes: ``(..., C) -> (..., C)``; ``weight`` and ``bias`` are ``(C,)`` or None.
    """
    if torch.jit.is_scripting():  # the autocast query is not scriptable: plain F.layer_norm
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if x.is_cuda and use_layer_norm_kernel(x):  # eager CUDA: gspn2's kernel, float32 parameters read as they are
        return layer_norm_kernel(x, weight, bias, eps, False)
    device_type = x.device.type
    if autocast_enabled(device_type) and torch.compiler.is_compiling():
        with torch.autocast(device_type, enabled=False):
            return layer_norm_rows(x, weight, bias, eps)[0]
    if autocast_enabled(device_type):
        dt = x.dtype
        weight = weight.to(dt) if weight is not None else None
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@register_notrace_function
def layer_norm2d_gelu(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """``F.gelu(LayerNorm2d(x))`` over the channels of ``(B, C, H, W)``: one pass of gspn2's kernel where
    :func:`layer_norm_last_dim` would take it (eager CUDA), else the norm and then ``F.gelu``, as the two
    modules compute it."""
    rows = x.permute(0, 2, 3, 1)
    if torch.jit.is_scripting():  # the option query is not scriptable: the two modules' formula
        return F.gelu(layer_norm_last_dim(rows, weight, bias, eps).permute(0, 3, 1, 2))
    if x.is_cuda and use_layer_norm_kernel(rows):
        return layer_norm_kernel(rows, weight, bias, eps, True).permute(0, 3, 1, 2)
    return F.gelu(layer_norm_last_dim(rows, weight, bias, eps).permute(0, 3, 1, 2))


class LayerNorm2d(_TimmLayerNorm2d):
    """timm's ``LayerNorm2d`` (same parameters ``weight``, ``bias``) that keeps the activation dtype.

    ``(B, C, H, W) -> (B, C, H, W)``. For channels_last memory the NHWC view ``x.permute(0, 2, 3, 1)`` is
    contiguous, so the norm is a plain last-dimension LayerNorm with no layout copy; a contiguous NCHW
    input is copied once to NHWC by ``layer_norm`` (the output then has channels_last memory). Under
    autocast it runs in the input's dtype (:func:`layer_norm_last_dim`), where timm's runs in fp32. The
    constructor is timm's (``num_channels``, ``eps=1e-6``, ...).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = layer_norm_last_dim(x.permute(0, 2, 3, 1), self.weight, self.bias, self.eps)
        return y.permute(0, 3, 1, 2)

    @torch.jit.unused
    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``F.gelu(self(x))`` (erf form), through :func:`layer_norm2d_gelu`."""
        return layer_norm2d_gelu(x, self.weight, self.bias, self.eps)
