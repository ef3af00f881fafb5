"""The CPU-testable parts of scripts/bench_models.py (the timing itself needs a GPU)."""

from __future__ import annotations

import torch

SCRIPT = "bench_models"  # the `bench` fixture (tests/scripts/conftest.py) imports it


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



def test_environment_names_the_gspn2_backend(bench):
    from gspn2.ops import options

    with options.override(kernel="general", dwconv="cudnn"):
        described = bench._gspn2_backend()
    assert "backend=auto" in described and "kernel=general" in described and "dwconv=cudnn" in described


def test_environment_names_inductor_settings(bench, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", "0")
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")
    monkeypatch.setenv("GSPN2_KERNEL", "auto")
    got = bench.inductor_env()
    assert got["TORCHINDUCTOR_MIX_ORDER_REDUCTION"] == "0" and got["TORCHINDUCTOR_ENABLE_PDL"] == "1"
    assert all(k.startswith("TORCHINDUCTOR_") for k in got)


def test_results_round_trip_through_json_and_render_without_a_gpu(bench, tmp_path, monkeypatch):
    R = bench.Result
    results = [
        R("gspn2_tiny", task, mode, res, 8, 24.1, img_per_s=100.0 + res, ms_per_iter=1.0, peak_mem_gb=1.0)
        for task, res in (("infer", 224), ("infer", 1024), ("train", 224)) for mode in ("eager", "compile-ro")
    ] + [R("convnext_tiny", "infer", "eager", 224, 8, 28.6, img_per_s=200.0, ms_per_iter=1.0, peak_mem_gb=2.0)]
    env = dict(gpu="GPU", torch="2", cuda="13", timm="1", gspn2_backend="cuda",
               inductor_env={"TORCHINDUCTOR_ENABLE_PDL": "1"})
    path = tmp_path / "run.json"
    monkeypatch.setattr("sys.argv", ["bench_models.py"])
    bench.save_json(str(path), env, bench.argparse.Namespace(models=["gspn2_tiny"]), results)
    env2, loaded = bench.load_json(str(path))
    assert env2 == env and loaded == results
    plot, md = tmp_path / "run.png", tmp_path / "run.md"
    monkeypatch.setattr("sys.argv", ["bench_models.py", "--from-json", str(path), "--plot", str(plot), "--md", str(md)])
    bench.main()  # no GPU needed
    assert plot.stat().st_size > 1000
    assert "gspn2_tiny / convnext_tiny [infer, eager, 224^2]: 1.62x throughput, 0.50x peak memory" in md.read_text()
    assert "Inductor: TORCHINDUCTOR_ENABLE_PDL=1." in md.read_text()
