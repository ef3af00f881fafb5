"""Shared, cached model instances: building GSPN-2-B (89 M parameters) takes seconds on CPU, so each of
T/S/B is built once per test session at its default (1000-class) configuration and only run under
``torch.no_grad`` by the tests that share it."""

from __future__ import annotations

from typing import Dict

import pytest
import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)


@pytest.fixture(scope="session")
def default_models() -> Dict[str, torch.nn.Module]:
    """name -> model built with defaults (1000 classes), eval mode; built lazily on first use."""

    class _Lazy(dict):
        def __missing__(self, name: str) -> torch.nn.Module:
            torch.manual_seed(0)
            model = timm.create_model(name).eval()
            self[name] = model
            return model

    return _Lazy()
