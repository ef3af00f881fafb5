"""Bad input fails with an error that names the culprit, and overwrites nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gspn2.train.checkpoint import CheckpointError, load_checkpoint
from gspn2.train.config import ConfigError
from gspn2.train.data import DataError
from tests.train._helpers import CONFIGS, TINY, compose_cfg, run_cli


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(short_run, tmp_path) -> Path:
    """A private copy of a finished run directory, to aim failing runs at."""
    run_dir = tmp_path / "run"
    shutil.copytree(short_run[1], run_dir)
    return run_dir


@pytest.fixture
def truncated_ckpt(short_run, tmp_path) -> Path:
    data = (short_run[1] / "last.pt").read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[: len(data) // 2])
    return path


def test_missing_data_root(train_script, finished_run, tmp_path):
    before = _snapshot(finished_run)
    missing = tmp_path / "no" / "such" / "imagenet"
    cfg = compose_cfg(
        [*TINY, f"data.root={missing}", "data.prepare=null", f"run_dir={finished_run}", "trainer.epochs=3"]
    )
    with pytest.raises(ConfigError, match=rf"data.root={missing}: no such directory"):
        train_script.train(cfg)
    assert _snapshot(finished_run) == before


def test_root_without_train_and_val(train_script, tmp_path):
    root = tmp_path / "flat"
    (root / "images" / "cat").mkdir(parents=True)
    cfg = compose_cfg([*TINY, f"data.root={root}", "data.prepare=null", f"runs_root={tmp_path / 'runs'}"])
    with pytest.raises(DataError, match=r"no 'train' folder"):
        train_script.train(cfg)
    assert not (tmp_path / "runs").exists()  # a failed start leaves no run directory behind


def test_checkpoint_of_another_model(train_script, short_run, digits_root, tmp_path):
    ckpt = short_run[1] / "last.pt"
    before = ckpt.read_bytes()
    cfg = compose_cfg(
        [
            *TINY,
            f"data.root={digits_root}",
            "model=timm",
            "model.name=resnet10t",
            f"resume={ckpt}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(CheckpointError, match=rf"{ckpt}.*do not fit.*(missing|unexpected) keys"):
        train_script.train(cfg)
    assert ckpt.read_bytes() == before
    assert not (tmp_path / "run").exists()


def test_checkpoint_of_another_width(train_script, short_run, digits_root, tmp_path):
    ckpt = short_run[1] / "last.pt"
    cfg = compose_cfg(
        [
            *TINY,
            f"data.root={digits_root}",
            "+model.args.dims=[16,32,64,96]",
            f"resume={ckpt}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(CheckpointError, match="shape mismatches"):
        train_script.train(cfg)


@pytest.mark.parametrize("corruption", ["truncated", "garbage", "empty", "not_a_checkpoint"])
def test_corrupt_checkpoint_is_named(corruption, truncated_ckpt, tmp_path):
    path = {
        "truncated": truncated_ckpt,
        "garbage": tmp_path / "garbage.pt",
        "empty": tmp_path / "empty.pt",
        "not_a_checkpoint": tmp_path / "weights.pt",
    }[corruption]
    if corruption == "garbage":
        path.write_bytes(bytes(range(256)) * 50)
    elif corruption == "empty":
        path.write_bytes(b"")
    elif corruption == "not_a_checkpoint":
        torch.save({"weight": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_corrupt_last_checkpoint_in_run_dir_is_not_overwritten(
    train_script, finished_run, digits_root, truncated_ckpt
):
    shutil.copyfile(truncated_ckpt, finished_run / "last.pt")
    before = _snapshot(finished_run)
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"run_dir={finished_run}", "trainer.epochs=3"])
    with pytest.raises(CheckpointError, match=rf"{finished_run / 'last.pt'}.*truncated or corrupt"):
        train_script.train(cfg)
    assert _snapshot(finished_run) == before


def test_eval_of_truncated_or_missing_checkpoint(eval_script, truncated_ckpt, tmp_path):
    out = tmp_path / "eval.json"
    for ckpt, message in ((truncated_ckpt, "truncated or corrupt"), (tmp_path / "nope.pt", "does not exist")):
        cfg = compose_cfg(
            [f"checkpoint={ckpt}", f"out={out}"], config_name="eval", config_dir=CONFIGS / "eval"
        )
        with pytest.raises(CheckpointError, match=rf"{ckpt}.*{message}"):
            eval_script.run_eval(cfg)
    assert not out.exists()


def test_eval_needs_a_model(eval_script):
    cfg = compose_cfg([], config_name="eval", config_dir=CONFIGS / "eval")
    with pytest.raises(ValueError, match="checkpoint=.*model_name="):
        eval_script.run_eval(cfg)


@pytest.mark.slow
def test_cli_unknown_key_and_missing_data(finished_run, tmp_path):
    """What a user sees: a non-zero exit and the offending key or path on stderr; files untouched."""
    before = _snapshot(finished_run)
    typo = run_cli(["train.py", "trainer.epochz=3", f"run_dir={finished_run}"])
    assert typo.returncode != 0 and "epochz" in typo.stderr
    missing = tmp_path / "imagenet"
    nodata = run_cli(
        ["train.py", "experiment=in1k_gspn2_tiny", f"data.root={missing}", f"run_dir={finished_run}"]
    )
    assert nodata.returncode != 0 and str(missing) in nodata.stderr
    assert _snapshot(finished_run) == before


def test_unknown_compile_mode_names_the_key(train_script, digits_root, tmp_path):
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"runs_root={tmp_path / 'runs'}",
                       "trainer.compile=true", "trainer.compile_mode=fastest"])
    with pytest.raises(ConfigError, match=r"trainer.compile_mode must be one of .*reduce-overhead.*'fastest'"):
        train_script.train(cfg)
    assert not (tmp_path / "runs").exists()


def test_lean_memory_without_compile_is_an_error(train_script, digits_root, tmp_path):
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"runs_root={tmp_path / 'runs'}",
                       "trainer.compile_lean_memory=true"])
    with pytest.raises(ConfigError, match=r"trainer.compile_lean_memory=true needs trainer.compile=true"):
        train_script.train(cfg)
    assert not (tmp_path / "runs").exists()
