"""The block MLP (1x1 conv, GELU, 1x1 conv) as two GEMMs on channels-last rows."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from gspn2.layers._trace import recording_graph
from gspn2.layers.pointwise import Conv1x1, from_rows, gelu_linear, norm_linear, to_rows

__all__ = ["PointwiseMlp"]


class PointwiseMlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` with 1x1 convolutions: timm's ``Mlp(use_conv=True)`` without dropout.

    Same submodules and parameters as that ``Mlp`` (``fc1``, ``act``, ``fc2``; ``fc1.weight`` of shape
    ``(hidden, C, 1, 1)``), so checkpoints are interchangeable. The fast path runs both convolutions as
    GEMMs on the channels-last rows (:class:`~gspn2.layers.Conv1x1`) and, when autograd records, fuses
    GELU into ``fc2`` with :func:`~gspn2.layers.gelu_linear`, which keeps the ``(hidden)`` pre-activation
    for backward but not also the activation: half of the MLP's saved activations. On that path ``fc2``
    itself is not called, so forward hooks on ``fc2`` see only no-grad (inference) calls.

    Shapes: ``(B, C, H, W) -> (B, C, H, W)``.

    Args:
        in_features: Input and output channels ``C``.
        hidden_features: Hidden channels.
        fast_path: ``False`` runs the module-by-module reference (``nn.Conv2d``, ``nn.GELU``).
    """

    def __init__(self, in_features: int, hidden_features: int, fast_path: bool = True) -> None:
        super().__init__()
        self.fc1 = Conv1x1(in_features, hidden_features, fast_path=fast_path)
        self.act = nn.GELU()
        self.fc2 = Conv1x1(hidden_features, in_features, fast_path=fast_path)
        self.fast_path = fast_path

    def forward(self, x: torch.Tensor, norm: Optional[Any] = None) -> torch.Tensor:
        """``(B, C, H, W) -> (B, C, H, W)``; with ``norm`` (a :class:`~gspn2.layers.LayerNorm2d`), the MLP of
        ``norm(x)`` (in training on the fast path the norm and ``fc1`` are one
        :func:`~gspn2.layers.norm_linear`, and ``norm``'s forward hooks do not run).

        ``norm`` is typed ``Any`` because TorchScript cannot type a module argument; a scripted MLP takes
        no ``norm`` (the scripted block normalises first)."""
        if torch.jit.is_scripting():
            if norm is not None:
                raise RuntimeError("PointwiseMlp: a scripted MLP takes no `norm`; normalise before calling it")
            return self.fc2(self.act(self.fc1(x)))
        if self.fast_path and torch.is_grad_enabled() and not recording_graph():
            B, _, H, W = x.shape
            if norm is not None and norm.fast_path:
                w, b = self.fc1.weight.flatten(1), self.fc1.bias
                (h,) = norm_linear(to_rows(x), norm.weight, norm.bias, norm.eps, w, b)
            else:
                h = to_rows(self.fc1(norm(x) if norm is not None else x))
            return from_rows(gelu_linear(h, self.fc2.weight.flatten(1), self.fc2.bias), B, H, W)
        return self.fc2(self.act(self.fc1(norm(x) if norm is not None else x)))
