"""Run files and the digits folder get the modes the user's umask gives, like any other tool's."""

from __future__ import annotations

import os
import stat

import pytest

from gspn2.train.checkpoint import atomic_write_bytes, save_checkpoint
from gspn2.train.data import write_digits


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    atomic_write_bytes(tmp_path / "results.json", b"{}")
    save_checkpoint({"x": 1}, tmp_path / "last.pt")
    assert _mode(tmp_path / "results.json") == 0o666 & ~mask
    assert _mode(tmp_path / "last.pt") == 0o666 & ~mask


def test_digits_folder_follows_the_umask(tmp_path, umask):
    umask(0o022)
    root = write_digits(tmp_path / "digits")
    assert _mode(root) == 0o755


def test_a_run_directory_is_readable_by_others_under_umask_022(short_run):
    """The fixture's run ran under the test process's umask (022 unless set otherwise)."""
    mask = os.umask(0o022)
    os.umask(mask)
    run_dir = short_run[1]
    for name in ("last.pt", "best.pt", "results.json", "config.yaml", "summary.csv", "curves.png"):
        assert _mode(run_dir / name) == 0o666 & ~mask, name
