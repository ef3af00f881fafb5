"""The GPU benchmarks refuse clearly on a machine without CUDA (not deep inside timm or CUDA). CUDA is
reported absent by monkeypatching, so the check runs on GPU machines too."""

from __future__ import annotations

import re

import pytest
import torch

from tests.scripts._load import script_module


@pytest.mark.parametrize(
    "script,models", [("bench_models", "gspn2_tiny"), ("bench_step", "gspn2_micro")]
)
def test_refuses_to_run_without_a_gpu(script, models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--models", models])
    with script_module(script) as module, pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main()


def test_bench_dwconv_refuses_without_a_gpu_and_checks_its_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["bench_dwconv.py"])
    with script_module("bench_dwconv") as module, pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main()
    monkeypatch.setattr("sys.argv", ["bench_dwconv.py", "--variants", "t5v3"])
    with script_module("bench_dwconv") as module, pytest.raises(SystemExit):
        module.main()


def test_gpu_profile_dwconv_refuses_an_unknown_variant_first(monkeypatch):
    monkeypatch.setattr("sys.argv", ["gpu_profile.py", "dwconv", "auto", "t9v4"])
    with script_module("gpu_profile") as module, pytest.raises(
        SystemExit, match=re.escape("dwconv: a depthwise variant must be auto or one of t0v4, t0v8, t1v4, t1v8, t2v4, t2v8, got 't9v4'")
    ):
        module.main()


@pytest.mark.parametrize("script", ["bench_merge", "bench_gelu_linear"])
def test_fused_op_benchmarks_refuse_without_a_gpu_and_check_their_arguments(script, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--sweep"])
    with script_module(script) as module, pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main()
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--batch", "0"])
    with script_module(script) as module, pytest.raises(SystemExit):
        module.main()


def test_gpu_profile_refuses_an_unknown_shape_before_any_call(monkeypatch):
    monkeypatch.setattr("sys.argv", ["gpu_profile.py", "run", "big@4", "big@3"])
    with script_module("gpu_profile") as module, pytest.raises(SystemExit, match=re.escape("unknown shape 'big@3'")):
        module.main()
    monkeypatch.setattr("sys.argv", ["gpu_profile.py", "run", "huge"])
    with script_module("gpu_profile") as module, pytest.raises(SystemExit, match=re.escape("unknown shape 'huge'")):
        module.main()
    monkeypatch.setattr("sys.argv", ["gpu_profile.py", "rnu", "big"])
    with script_module("gpu_profile") as module, pytest.raises(SystemExit, match="must be run, variants or dwconv"):
        module.main()
