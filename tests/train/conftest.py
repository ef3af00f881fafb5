"""Shared fixtures of the trainer tests: the digits image folder, the scripts, one short training run.

Everything runs on the CPU with tiny settings (subsets of the digits, 1-2 epochs of a few steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspn2.train.data import write_digits
from tests.train._helpers import last_line, load_script, run_cli


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    return write_digits(tmp_path_factory.mktemp("data") / "digits")


@pytest.fixture(scope="session")
def train_script():
    return load_script("train")


@pytest.fixture(scope="session")
def eval_script():
    return load_script("eval")


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, digits_root):
    """`python train.py` as a user runs it (default experiment, W&B offline), shortened by overrides.

    Returns ``(completed_process, run_dir, results)``.
    """
    runs_root = tmp_path_factory.mktemp("runs")
    proc = run_cli(
        [
            "train.py",
            f"data.root={digits_root}",
            f"runs_root={runs_root}",
            "trainer.epochs=2",
            "data.train_subset=256",
            "data.val_subset=96",
            "data.batch_size=32",
            "data.pin_memory=true",  # a no-op on a CPU, and no warning about it
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = Path(last_line(proc.stdout))
    results = json.loads((run_dir / "results.json").read_text())
    return proc, run_dir, results


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """train.py sets the CPU thread count from trainer.cpu_threads; keep that out of other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
