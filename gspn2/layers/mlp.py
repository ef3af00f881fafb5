"""The block MLP (1x1 conv, GELU, 1x1 conv) as two GEMMs on channels-last rows."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gspn2.layers.pointwise import Conv1x1, NormParams, from_rows, gelu_linear, norm_linear, to_rows

__all__ = ["PointwiseMlp"]


class PointwiseMlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` with 1x1 convolutions: timm's ``Mlp(use_conv=True)`` without dropout.

    Same parameters as that ``Mlp`` (``fc1.weight`` of shape ``(hidden, C, 1, 1)``, ``fc1.bias``,
    ``fc2.*``), so checkpoints are interchangeable. Both convolutions are GEMMs on the channels-last rows
    (:class:`~gspn2.layers.Conv1x1`).

    Shapes: ``(B, C, H, W) -> (B, C, H, W)``.

    Args:
        in_features: Input and output channels ``C``.
        hidden_features: Hidden channels.
    """

    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = Conv1x1(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = Conv1x1(hidden_features, in_features)

    def forward(self, x: torch.Tensor, norm: Optional[NormParams] = None) -> torch.Tensor:
        """``(B, C, H, W) -> (B, C, H, W)``: the MLP of ``x``, module by module.

        With ``norm``, the ``(weight, bias, eps)`` of a LayerNorm over the channels, the MLP of the
        normalised ``x`` in the training formulation: the norm fused into ``fc1``
        (:func:`~gspn2.layers.norm_linear`) and GELU into ``fc2`` (:func:`~gspn2.layers.gelu_linear`),
        which keep only the norm's input and the ``(hidden)`` pre-activation for backward. ``fc1`` and
        ``fc2`` are then not called (their forward hooks do not run). Not for ``torch.fx``,
        ``torch.jit.trace`` or TorchScript (:mod:`gspn2.layers._trace`).
        """
        if norm is None:
            return self.fc2(self.act(self.fc1(x)))
        B, _, H, W = x.shape
        norm_weight, norm_bias, eps = norm
        w1, b1 = self.fc1.weight.flatten(1), self.fc1.bias
        h = norm_linear(to_rows(x), norm_weight, norm_bias, eps, w1, b1, chunks=1, gate=None)[0]
        return from_rows(gelu_linear(h, self.fc2.weight.flatten(1), self.fc2.bias), B, H, W)
