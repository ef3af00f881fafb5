"""The GPU benchmarks refuse clearly on a machine without CUDA (not deep inside timm or CUDA). CUDA is
reported absent by monkeypatching, so the check runs on GPU machines too."""

from __future__ import annotations

import pytest
import torch

from tests.scripts._load import script_module


@pytest.mark.parametrize(
    "script,models", [("bench_models", "gspn2_tiny"), ("bench_fast_path", "gspn2_tiny"), ("bench_step", "gspn2_micro")]
)
def test_refuses_to_run_without_a_gpu(script, models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--models", models])
    with script_module(script) as module, pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main()
