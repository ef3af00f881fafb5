"""LayerNorm over channels that stays in the activation dtype under autocast."""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import LayerNorm2d as _TimmLayerNorm2d
from timm.layers import register_notrace_function

from gspn2.ops._amp import autocast_enabled

__all__ = ["LayerNorm2d", "layer_norm_last_dim"]

torch.fx.wrap("layer_norm_last_dim")  # the same for a plain torch.fx.symbolic_trace


@register_notrace_function  # torch.fx: the autocast query must run when the graph runs
def layer_norm_last_dim(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``, computed and returned in ``x.dtype``.

    Autocast runs ``layer_norm`` in fp32: a bf16 input is copied to fp32, normalised by the fp32 kernel,
    saved for backward in fp32 and copied back to bf16 by the next convolution or GEMM. Here the kernel
    reads and writes the activation dtype instead (its statistics are fp32 inside the kernel either way)
    and ``weight``/``bias`` are cast to that dtype, as the CUDA kernel wants one dtype for all three.
    Without autocast this is plain ``F.layer_norm``.

    Shapes: ``(..., C) -> (..., C)``; ``weight`` and ``bias`` are ``(C,)`` or None.
    """
    if torch.jit.is_scripting():  # the autocast query is not scriptable: plain F.layer_norm
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    device_type = x.device.type
    if autocast_enabled(device_type):
        dt = x.dtype
        weight = weight.to(dt) if weight is not None else None
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


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
