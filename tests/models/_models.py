"""Names of the registered model family and a small-model factory, shared by the model tests."""

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
