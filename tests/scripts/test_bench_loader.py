"""scripts/bench_loader.py on a tiny folder of scripts/make_image_folder.py: CPU, no worker processes."""

from __future__ import annotations

import json
import os

import pytest

from gspn2.train.data import DataError
from tests.scripts._load import jpeg_folder

SCRIPT = "bench_loader"  # the `bench` fixture (tests/scripts/conftest.py) imports it

# batch 2 of the 6 training images: an epoch is 3 batches; no worker processes, so no prefetch thread
CPU = ["data.batch_size=2", "data.pin_memory=false", "trainer.device=cpu", "data.gpu_prefetch=0"]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return jpeg_folder(tmp_path_factory, "bench_loader", classes=3, train_per_class=2)


def test_measures_the_experiments_loader(bench, tiny_root, tmp_path):
    out = tmp_path / "loader.json"
    report = bench.main([str(tiny_root), *CPU, "--workers", "0", "--batches", "3", "--warmup", "1",
                         "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["experiment"] == "in1k_gspn2_tiny" and report["train_images"] == 6
    assert report["cpus"] == len(os.sched_getaffinity(0)) and report["device"] == "cpu"
    # the experiment's own recipe came through Hydra's composition
    assert report["data"]["num_classes"] == 1000 and report["data"]["img_size"] == 224
    assert report["aug"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and report["aug"]["reprob"] == 0.25
    (r,) = report["results"]
    # the ImageNet data config's pipeline: workers decode, the device augments
    assert r["pipeline"] == "gpu" and r["num_workers"] == 0 and r["batches"] == 3 and r["warmup_batches"] == 1
    assert r["variant"] == "gpu" and r["gpu_decode"] is False and r["breakdown"] is None
    assert r["batch_shape"] == [2, 3, 224, 224]
    assert r["img_per_s"] == pytest.approx(3 * 2 / r["seconds"]) and r["img_per_s"] > 0
    assert r["epochs_started_while_timed"] == 1  # 1 + 3 batches run past the 3-batch epoch


def test_workers_default_to_the_config(bench, tiny_root, capsys):
    report = bench.main([str(tiny_root), *CPU, "data.num_workers=0", "--batches", "1", "--warmup", "1"])
    assert [r["num_workers"] for r in report["results"]] == [0]
    assert report["results"][0]["warmup_batches"] == 1
    assert "pipeline gpu workers   0:" in capsys.readouterr().out


def test_measures_the_three_input_paths_with_their_breakdown(bench, tiny_root, capsys):
    # gpu_prefetch=0: its thread needs worker processes, and this run measures 0 workers
    report = bench.main([str(tiny_root), *CPU, "data.gpu_prefetch=0", "--pipeline", "cpu", "gpu",
                         "gpu-nvjpeg", "--workers", "0", "--batches", "2", "--warmup", "1", "--breakdown"])
    runs = [(r["variant"], r["pipeline"], r["gpu_decode"]) for r in report["results"]]
    assert runs == [("cpu", "cpu", None), ("gpu", "gpu", False), ("gpu-nvjpeg", "gpu", True)]
    for r in report["results"]:
        # the GPU paths yield the same batches, augmented on the device (here the CPU)
        assert r["batch_shape"] == [2, 3, 224, 224] and r["img_per_s"] > 0
    cpu, gpu, nvjpeg = report["results"]
    assert cpu["breakdown"] is None  # timm's transforms run in the workers: nothing to split
    assert list(gpu["breakdown"]["ms_per_batch"]) == ["wait", "upload", "augment"]
    assert list(nvjpeg["breakdown"]["ms_per_batch"]) == ["wait", "decode", "crop", "upload", "augment"]
    for r in (gpu, nvjpeg):
        b = r["breakdown"]
        assert b["batches"] == 2 and b["warmup_batches"] == 1 and b["img_per_s"] > 0
        assert all(ms >= 0 for ms in b["ms_per_batch"].values()) and b["ms_per_batch"]["augment"] > 0
        # the stages cover the pass: its rate is the batch size over their sum
        assert b["img_per_s"] == pytest.approx(2 / (sum(b["ms_per_batch"].values()) / 1000), rel=1e-6)
    out = capsys.readouterr().out
    assert "pipeline gpu-nvjpeg workers   0:" in out and "pipeline cpu workers   0:" in out
    assert out.count("breakdown, ms per batch") == 2 and "decode" in out.splitlines()[-1]


def test_breakdown_after_the_prefetch_thread_with_a_worker(bench, tiny_root, capsys):
    # the throughput pass runs the data.gpu_prefetch thread, the breakdown pass the worker's batches inline
    report = bench.main([str(tiny_root), *CPU, "data.gpu_prefetch=2", "--pipeline", "gpu", "--workers", "1",
                         "--batches", "2", "--warmup", "1", "--breakdown"])
    (r,) = report["results"]
    assert (r["variant"], r["num_workers"], report["data"]["gpu_prefetch"]) == ("gpu", 1, 2)
    assert r["breakdown"]["batches"] == 2 and r["img_per_s"] > 0
    assert r["epochs_started_while_timed"] == 0 and r["batch_shape"] == [2, 3, 224, 224]  # 1 + 2 of 3
    assert "pipeline gpu workers   1:" in capsys.readouterr().out


def test_workers_default_to_the_cpus_when_null(bench, tiny_root):
    report = bench.main([str(tiny_root), *CPU, "data.num_workers=null", "--batches", "1", "--warmup", "1"])
    cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    assert [r["num_workers"] for r in report["results"]] == [max(1, cpus)]


@pytest.mark.parametrize(
    "argv,message",
    [(["--batches", "0"], "--batches must be >= 1"), (["--warmup", "0"], "--warmup must be >= 1"),
     (["--workers", "2", "-1"], "--workers must be >= 0, got -1"),
     (["--experiment", "nope"], "--experiment: no configs/experiment/nope.yaml"),
     (["--json", "/nonexistent/dir/x.json"], "--json")],
)
def test_bad_arguments_name_the_flag(bench, tiny_root, argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.main([str(tiny_root), *argv])


def test_missing_root_is_a_data_error(bench, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        bench.main([str(tmp_path / "nowhere"), *CPU, "--workers", "0", "--batches", "1"])


def test_unknown_pipeline_is_refused(bench, tiny_root, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tiny_root), "--pipeline", "dali"])
    assert "--pipeline: invalid choice: 'dali'" in capsys.readouterr().err
