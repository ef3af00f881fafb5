"""Shared, cached model instances: building GSPN-2-B (89 M parameters) takes seconds on CPU, so each of
T/S/B is built once per test run at its default (1000-class) configuration and only run under
``torch.no_grad`` by the tests that share it."""

from __future__ import annotations

from typing import Dict

import pytest
import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)


@pytest.fixture(scope="package", autouse=True)
def one_intra_op_thread():
    """Run the model tests on one intra-op thread, restored afterwards.

    These tests run many small ops and a few 224^2 forwards on a 2-core machine that other jobs share;
    there, OpenMP's spinning second thread made them about twice as slow as one thread. Results do not
    depend on the thread count.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


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
