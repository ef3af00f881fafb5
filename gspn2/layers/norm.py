"""LayerNorm over channels that stays in the activation dtype under autocast."""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import LayerNorm2d as _TimmLayerNorm2d
from timm.layers import register_notrace_function

from gspn2.ops._amp import autocast_enabled
from gspn2.ops.layernorm import kernel_call as layer_norm_kernel
from gspn2.ops.layernorm import use_kernel as use_layer_norm_kernel

__all__ = ["LayerNorm2d", "layer_norm2d_gelu", "layer_norm_last_dim"]

torch.fx.wrap("layer_norm_last_dim")  # the same for a plain torch.fx.symbolic_trace
torch.fx.wrap("layer_norm2d_gelu")


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
    parameters read in their own dtype.

    Shapes: ``(..., C) -> (..., C)``; ``weight`` and ``bias`` are ``(C,)`` or None.
    """
    if torch.jit.is_scripting():  # the autocast query is not scriptable: plain F.layer_norm
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if x.is_cuda and use_layer_norm_kernel(x):  # eager CUDA: gspn2's kernel, float32 parameters read as they are
        return layer_norm_kernel(x, weight, bias, eps, False)
    device_type = x.device.type
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
