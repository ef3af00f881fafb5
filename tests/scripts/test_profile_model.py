"""scripts/profile_model.py needs a GPU; on CPU it must refuse clearly (not crash inside timm or CUDA)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_model.py"


def _run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    runpy.run_path(str(SCRIPT), run_name="__main__")


def test_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _run(monkeypatch)


def test_unknown_model_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--model: unknown timm model 'no_such_net'"):
        _run(monkeypatch, "--model", "no_such_net")
