"""The CPU-testable parts of scripts/bench_models.py (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.scripts._load import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_models") as module:
        yield module


def test_default_models_are_registered(bench):
    import timm

    assert [m for m in bench.DEFAULT_MODELS if not timm.is_model(m)] == []


def test_window_models_get_the_benchmark_resolution(bench):
    model = bench._create("swin_tiny_patch4_window7_224", 448).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 448, 448)).shape == (1, 1000)


def test_markdown_and_ratios(bench):
    R = bench.Result
    results = [
        R("gspn2_tiny", "infer", "eager", 224, 256, 24.1, img_per_s=3000.0, ms_per_iter=85.3, peak_mem_gb=4.0),
        R("swin_tiny_patch4_window7_224", "infer", "eager", 224, 256, 28.3, img_per_s=6000.0,
          ms_per_iter=42.7, peak_mem_gb=2.0),
        R("convnext_tiny", "infer", "eager", 224, 256, float("nan"), error="OOM: out of memory"),
    ]
    env = dict(gpu="GPU", torch="2", cuda="13", timm="1", gspn2_backend="cuda")
    table = bench.to_markdown(results, env)
    assert "| gspn2_tiny | 24.1 | infer | eager | 224 | 256 | 3000 | 85.30 | 4.0 |" in table
    assert "OOM" in table
    lines = bench.ratios(results, "gspn2_tiny", ["swin_tiny_patch4_window7_224", "convnext_tiny"])
    assert lines == [
        "gspn2_tiny / swin_tiny_patch4_window7_224 [infer, eager, 224^2]: 0.50x throughput, 2.00x peak memory"
    ]



def test_environment_names_the_gspn2_backend(bench, monkeypatch):
    monkeypatch.setenv("GSPN2_KERNEL", "general")
    described = bench._gspn2_backend()
    assert "GSPN2_BACKEND=auto" in described and "GSPN2_KERNEL=general" in described
