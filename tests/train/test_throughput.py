"""The training log reports the run's speed: per log interval and per epoch, in the log, results.json and
the history, with device synchronisation only where a figure is read."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from gspn2.train import throughput
from gspn2.train.throughput import TIMING_KEYS, ThroughputMeter, run_figures
from tests.train._helpers import TINY, compose_cfg

NUMBER = r"(\d+(?:\.\d+)?(?:e[-+]\d+)?)"
INTERVAL_LINE = re.compile(
    rf"^epoch (\d+)/2 step (\d+)/4 \| loss {NUMBER} \| lr {NUMBER} \| {NUMBER} img/s \({NUMBER}/process\) \| "
    rf"step {NUMBER} s \| data (\d+)% \| mem n/a \| ETA epoch (\d+:\d\d:\d\d), run (\d+:\d\d:\d\d)$"
)
SPEED_KEYS = ("img_per_s", "img_per_s_per_device", "step_s", "data_wait", "peak_mem_gb")


def test_interval_lines_and_per_epoch_figures(digits_root, train_script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"run_dir={run_dir}", "trainer.epochs=2",
                       "trainer.log_interval=2"])  # fmt: skip
    train_script.train(cfg)
    out = capsys.readouterr().out.splitlines()
    lines = [m for m in map(INTERVAL_LINE.match, out) if m]
    assert [(int(m[1]), int(m[2])) for m in lines] == [(1, 2), (1, 4), (2, 2), (2, 4)], out
    for m in lines:
        img_per_s, per_process, step_s, data = float(m[5]), float(m[6]), float(m[7]), int(m[8])
        assert img_per_s > 0 and per_process == img_per_s  # one process
        assert step_s > 0 and 0 <= data <= 100
        assert img_per_s == pytest.approx(32 / step_s, rel=0.02)  # 32 images per step
    assert lines[-1][10] == "0:00:00"  # the last step of the run: nothing left

    results = json.loads((run_dir / "results.json").read_text())
    for record in results["history"]:
        assert set(TIMING_KEYS) <= set(record)
        assert record["peak_mem_gb"] is None  # CPU
        assert record["img_per_s"] == pytest.approx(4 * 32 / record["steps_s"])
        assert 0 <= record["data_wait"] <= 1 and record["eval_s"] > 0
        assert record["steps_s"] + record["eval_s"] <= record["epoch_s"]
    assert results["speed"] == pytest.approx({k: v for k, v in run_figures(results["history"]).items()})
    epoch_lines = [line for line in out if line.startswith("epoch   ")]
    assert len(epoch_lines) == 2 and all(re.search(rf"\| {NUMBER} img/s \(", line) for line in epoch_lines)
    assert any(line.startswith("speed over the run's epochs: ") for line in out)


def test_compile_notice_comes_before_the_first_step(digits_root, train_script, tmp_path, capsys, monkeypatch):
    compiled = []
    monkeypatch.setattr(train_script, "compile_model", lambda model, *args: compiled.append(args) or model)
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"run_dir={tmp_path / 'run'}", "trainer.epochs=1",
                       "trainer.limit_train_steps=1", "trainer.log_interval=1", "trainer.compile=true",
                       "trainer.compile_mode=max-autotune-no-cudagraphs"])  # fmt: skip
    train_script.train(cfg)
    out = capsys.readouterr().out.splitlines()
    assert compiled == [("max-autotune-no-cudagraphs", False)]
    notice = (
        "compiling the model with torch.compile(mode=max-autotune-no-cudagraphs): "
        "the first step can take minutes"
    )
    first_step = next(i for i, line in enumerate(out) if line.startswith("epoch 1/1 step 1/1 |"))
    assert out.index(notice) < first_step


def test_meter_synchronises_only_where_a_figure_is_read(monkeypatch):
    calls = {"sync": 0}
    def synchronize(device=None):
        calls["sync"] += 1

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    meter = ThroughputMeter(torch.device("cuda", 0), images_per_step=64, world_size=2)
    meter.start_epoch()
    assert calls["sync"] == 1
    figures = []
    for step in range(1, 13):
        meter.waited(0.001)
        time.sleep(0.002)
        meter.step()
        if step % 4 == 0:
            figures.append(meter.interval())
    assert calls["sync"] == 1 + 3  # one per interval, none per step
    epoch = meter.epoch()
    assert calls["sync"] == 5
    for f in figures:
        assert f["img_per_s_per_device"] == pytest.approx(f["img_per_s"] / 2)
        assert f["img_per_s"] == pytest.approx(64 / f["step_s"])
        assert f["step_s"] >= 0.002 and 0 < f["data_wait"] < 1 and f["peak_mem_gb"] == 3.0
    assert epoch["img_per_s"] == pytest.approx(12 * 64 / epoch["steps_s"])


def test_run_figures_weigh_epochs_by_their_time():
    history = [
        {"steps_s": 10.0, "img_per_s": 100.0, "img_per_s_per_device": 50.0, "step_s": 1.0, "data_wait": 0.5,
         "peak_mem_gb": 2.0},
        {"steps_s": 30.0, "img_per_s": 200.0, "img_per_s_per_device": 100.0, "step_s": 0.5, "data_wait": 0.1,
         "peak_mem_gb": 4.0},
    ]  # fmt: skip
    figures = run_figures(history)
    assert figures["img_per_s"] == pytest.approx((1000 + 6000) / 40)  # images over time
    assert figures["step_s"] == pytest.approx(40 / (10 + 60))  # time over steps
    assert figures["data_wait"] == pytest.approx((5 + 3) / 40)
    assert figures["peak_mem_gb"] == 4.0
    assert run_figures([{"epoch": 1}]) is None  # a history without timings (an older checkpoint)
    assert throughput.format_duration(3725.4) == "1:02:05"
