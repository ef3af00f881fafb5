"""torch.hub.load on a checkout (hubconf.py at the repository root)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_hub_load_local_checkout():
    spec = importlib.util.spec_from_file_location("gspn2_hubconf", REPO / "hubconf.py")
    hubconf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hubconf)
    assert all(callable(getattr(hubconf, n)) for n in ("gspn2_micro", "gspn2_tiny", "gspn2_small", "gspn2_base"))
    model = torch.hub.load(str(REPO), "gspn2_micro", source="local", num_classes=7)
    assert type(model).__name__ == "GSPN2"
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="no pretrained weights"):
        torch.hub.load(str(REPO), "gspn2_micro", source="local", pretrained=True)
