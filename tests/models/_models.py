"""Names of the registered model family, a small-model factory and a fixed input batch, shared by the model
tests."""

from __future__ import annotations

import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)

MODEL_NAMES = ("gspn2_micro", "gspn2_tiny", "gspn2_small", "gspn2_base")
BIG_MODELS = ("gspn2_tiny", "gspn2_small", "gspn2_base")


def micro(**kwargs) -> torch.nn.Module:
    """``gspn2_micro`` with 10 classes, initialised from seed 0; ``kwargs`` go to ``timm.create_model``."""
    torch.manual_seed(0)
    return timm.create_model("gspn2_micro", num_classes=10, **kwargs)


def images(
    B: int, H: int, W: int, channels: int = 3, seed: int = 1, channels_last: bool = False
) -> torch.Tensor:
    """A ``(B, channels, H, W)`` batch of standard-normal values drawn from ``seed``."""
    x = torch.randn(B, channels, H, W, generator=torch.Generator().manual_seed(seed))
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x
