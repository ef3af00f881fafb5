"""Kill-and-resume reproduces the uninterrupted run exactly (same metrics, same weights)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gspn2.train.checkpoint import load_checkpoint
from gspn2.train.throughput import TIMING_KEYS
from tests.train._helpers import TINY, compose_cfg

EPOCHS = 2
STEPS_PER_EPOCH = 128 // 32


def _overrides(digits_root, run_dir, *extra):
    # random crops (aug=digits) in a DataLoader worker, drop-path and EMA in the main process: a resume
    # that lost any random stream or any state would not reproduce the uninterrupted run
    return [
        *TINY,
        f"data.root={digits_root}",
        f"run_dir={run_dir}",
        f"trainer.epochs={EPOCHS}",
        "data.num_workers=1",
        "model.drop_path_rate=0.1",
        *extra,
    ]


def _history(run_dir):
    history = json.loads((run_dir / "results.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


def _assert_same_weights(a, b):
    sa, sb = load_checkpoint(a), load_checkpoint(b)
    for key in ("model", "ema"):
        assert sa[key].keys() == sb[key].keys()
        for name in sa[key]:
            assert torch.equal(sa[key][name], sb[key][name]), f"{key}.{name}"
    assert sa["step"] == sb["step"] and sa["epoch"] == sb["epoch"]


@pytest.mark.slow
def test_crash_then_rerun_and_explicit_resume_reproduce_the_uninterrupted_run(
    digits_root, train_script, tmp_path
):
    full = tmp_path / "full"
    train_script.train(compose_cfg(_overrides(digits_root, full)))

    # crash two steps into epoch 2: only epoch 1's checkpoint survives
    crashed = tmp_path / "crashed"
    stop = f"trainer.stop_after_steps={STEPS_PER_EPOCH + 2}"
    train_script.train(compose_cfg(_overrides(digits_root, crashed, stop)))
    assert load_checkpoint(crashed / "last.pt")["epoch"] == 1
    assert len(_history(crashed)) == 1
    epoch1 = tmp_path / "epoch1.pt"
    shutil.copyfile(crashed / "last.pt", epoch1)

    # the same command again (minus the crash) continues from crashed/last.pt
    train_script.train(compose_cfg(_overrides(digits_root, crashed)))
    assert _history(crashed) == _history(full)
    _assert_same_weights(crashed / "last.pt", full / "last.pt")

    # resume=<checkpoint> into a new run directory
    resumed = tmp_path / "resumed"
    train_script.train(compose_cfg(_overrides(digits_root, resumed, f"resume={epoch1}")))
    assert _history(resumed) == _history(full)
    _assert_same_weights(resumed / "last.pt", full / "last.pt")

    # a rerun of a finished run trains nothing and rewrites nothing
    before = (full / "last.pt").read_bytes()
    train_script.train(compose_cfg(_overrides(digits_root, full)))
    assert (full / "last.pt").read_bytes() == before
