"""Resume does what it says: more epochs follow the new schedule, another optimizer is refused (or started
fresh with trainer.no_resume_opt), and every config difference against the checkpoint is reported."""

from __future__ import annotations

import json

import pytest

from gspn2.train.checkpoint import CheckpointError, load_checkpoint
from tests.train._helpers import TINY, compose_cfg


def _cfg(digits_root, run_dir, *extra):
    return compose_cfg([*TINY, f"data.root={digits_root}", f"run_dir={run_dir}", "sched.warmup_epochs=0", *extra])


def _lrs(run_dir):
    return [h["lr"] for h in json.loads((run_dir / "results.json").read_text())["history"]]


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory, digits_root, train_script):
    run_dir = tmp_path_factory.mktemp("resume") / "one"
    train_script.train(_cfg(digits_root, run_dir, "trainer.epochs=1"))
    return run_dir


def test_more_epochs_follow_the_new_schedule_and_changes_are_reported(
    one_epoch, digits_root, train_script, tmp_path, capsys
):
    extended = tmp_path / "extended"
    extended.mkdir()
    for name in ("last.pt", "results.json"):
        (extended / name).write_bytes((one_epoch / name).read_bytes())
    capsys.readouterr()
    train_script.train(_cfg(digits_root, extended, "trainer.epochs=3", "optim.weight_decay=0.1"))
    out = capsys.readouterr().out
    assert "config changes against" in out
    assert "trainer.epochs: 1 -> 3" in out and "optim.weight_decay: 0.05 -> 0.1" in out

    direct = tmp_path / "direct"
    train_script.train(_cfg(digits_root, direct, "trainer.epochs=3"))
    lrs, expected = _lrs(extended), _lrs(direct)
    # epochs 2 and 3 run on the 3-epoch cosine, not at the 1-epoch schedule's final lr
    assert lrs[1:] == pytest.approx(expected[1:], rel=1e-12)
    assert lrs[1] > 10 * lrs[0]
    # the new weight decay applies from the resumed step on
    groups = load_checkpoint(extended / "last.pt")["optimizer"]["param_groups"]
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.1]


def test_another_optimizer_is_refused_unless_no_resume_opt(one_epoch, digits_root, train_script, tmp_path):
    ckpt = one_epoch / "last.pt"
    new = tmp_path / "sgd"
    with pytest.raises(CheckpointError, match=r"optim=adamw.*optim=sgd.*trainer.no_resume_opt=true"):
        train_script.train(_cfg(digits_root, new, f"resume={ckpt}", "optim=sgd", "trainer.epochs=2"))
    assert not new.exists()
    train_script.train(
        _cfg(digits_root, new, f"resume={ckpt}", "optim=sgd", "trainer.epochs=2", "trainer.no_resume_opt=true")
    )
    state = load_checkpoint(new / "last.pt")
    assert state["epoch"] == 2 and state["config"]["optim"]["name"] == "sgd"
    assert all("momentum" in g for g in state["optimizer"]["param_groups"])
