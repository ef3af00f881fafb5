"""A recovery state written inside an epoch (trainer.checkpoint_every_steps) resumes bitwise: the loader's
position, the per-sample augmentations, mixup, drop-path, EMA, optimizer and schedule all continue."""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

from gspn2.train.checkpoint import load_checkpoint
from gspn2.train.data import SeededSamples
from gspn2.train.throughput import TIMING_KEYS
from tests.train._helpers import TINY, compose_cfg, flip_tensor_byte

STEP_LINE = re.compile(r"^epoch (\d)/2 step (\d)/4 \| loss (\S+) \| lr (\S+) \|")


def _overrides(digits_root, run_dir, workers, *extra):
    # 4 steps per epoch, 2 epochs; random crops and erasing (in a DataLoader worker, or in the main
    # process with 0 workers), mixup and drop-path, EMA: a resume that lost any of them would not
    # reproduce the uninterrupted run
    return [
        *TINY,
        f"data.root={digits_root}",
        f"run_dir={run_dir}",
        "trainer.epochs=2",
        f"data.num_workers={workers}",
        "model.drop_path_rate=0.1",
        "aug.mixup=0.5",
        "aug.reprob=0.5",
        "trainer.log_interval=1",
        "trainer.checkpoint_every_steps=3",
        *extra,
    ]


def _steps(out: str) -> dict[int, tuple[str, str]]:
    """Logged (loss, lr) by global step, from the log's speed lines."""
    steps = {}
    for line in out.splitlines():
        m = STEP_LINE.match(line)
        if m:
            steps[(int(m[1]) - 1) * 4 + int(m[2])] = (m[3], m[4])
    return steps


def _history(run_dir):
    history = json.loads((run_dir / "results.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_resume_from_a_recovery_state_is_bitwise_the_uninterrupted_run(
    workers, digits_root, train_script, tmp_path, capsys
):
    full = tmp_path / "full"
    train_script.train(compose_cfg(_overrides(digits_root, full, workers)))
    full_steps = _steps(capsys.readouterr().out)
    assert sorted(full_steps) == list(range(1, 9))
    assert not (full / "recovery.pt").exists()  # each epoch's publication removes the one inside it

    # recovery states at steps 3 (epoch 1) and 6 (epoch 2, its second step); the "crash" comes at step 7
    crashed = tmp_path / "crashed"
    train_script.train(compose_cfg(_overrides(digits_root, crashed, workers, "trainer.stop_after_steps=7")))
    capsys.readouterr()
    recovery = load_checkpoint(crashed / "recovery.pt")
    assert (recovery["epoch"], recovery["step"], recovery["mid_epoch"]["step"]) == (1, 6, 2)
    assert load_checkpoint(crashed / "last.pt")["epoch"] == 1

    damaged = tmp_path / "damaged"
    shutil.copytree(crashed, damaged)

    train_script.train(compose_cfg(_overrides(digits_root, crashed, workers)))  # the same command again
    out = capsys.readouterr().out
    assert f"resumed from {crashed / 'recovery.pt'}: epoch 1 + 2 steps, step 6" in out
    resumed_steps = _steps(out)
    assert sorted(resumed_steps) == [7, 8]  # steps 1-6 are not run again
    assert all(resumed_steps[s] == full_steps[s] for s in (7, 8))
    assert not (crashed / "recovery.pt").exists()

    assert _history(crashed) == _history(full)
    a, b = load_checkpoint(crashed / "last.pt"), load_checkpoint(full / "last.pt")
    assert a["step"] == b["step"] == 8 and a["mid_epoch"] is None
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a["lr_steps"], b["lr_steps"])
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])

    # a damaged recovery state: said, kept aside, and the run goes on from the last whole epoch
    flip_tensor_byte(damaged / "recovery.pt")
    train_script.train(compose_cfg(_overrides(digits_root, damaged, workers)))
    out = capsys.readouterr().out
    assert "fails its integrity check" in out and f"continuing from {damaged / 'last.pt'} instead" in out
    assert f"resumed from {damaged / 'last.pt'}: epoch 1, step 4" in out
    assert (damaged / "recovery.damaged.pt").is_file() and not (damaged / "recovery.pt").exists()
    assert _history(damaged) == _history(full)


def test_seeded_samples_draw_from_their_seed_and_leave_the_main_streams_alone(monkeypatch):
    class Draw(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return index, random.random(), float(np.random.rand()), torch.rand(()).item()

    def seed_all(seed):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    samples = SeededSamples(Draw())
    seed_all(5)
    first = samples[(2, 17)]
    after = (random.random(), float(np.random.rand()), torch.rand(()).item())
    seed_all(5)
    assert (random.random(), float(np.random.rand()), torch.rand(()).item()) == after  # main streams restored
    seed_all(6)
    assert samples[(2, 17)] == first  # the seed alone decides
    assert samples[(2, 18)][1:] != first[1:]

    monkeypatch.setattr("gspn2.train.data.get_worker_info", lambda: object())  # as in a worker
    seed_all(7)
    assert samples[(2, 17)] == first  # the same draws in a worker process


def test_checkpoint_every_steps_is_checked():
    from gspn2.train.config import ConfigError, check_train_config

    with pytest.raises(ConfigError, match="trainer.checkpoint_every_steps must be >= 0"):
        check_train_config(compose_cfg(["trainer.checkpoint_every_steps=-1"]), check_paths=False)
