"""Helpers of the trainer tests: config composition, script loading and running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from gspn2.train.config import register_configs
from tests._helpers import REPO, load_module

CONFIGS = REPO / "configs"

# A run of a few seconds: 128 training images in 4 steps of 32, 64 validation images, no W&B.
TINY = [
    "data.train_subset=128",
    "data.val_subset=64",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.num_workers=0",
    "trainer.progress=false",
    "logger.mode=disabled",
]

register_configs()


def compose_cfg(overrides: list[str], config_name: str = "train", config_dir: Path = CONFIGS):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name, overrides=overrides)


def load_script(name: str):
    """Import train.py / eval.py from the repository root as a module (they are scripts, not package)."""
    return load_module(REPO / f"{name}.py", f"gspn2_script_{name}")


def run_cli(args: list[str], timeout: float = 300, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run ``python <args>`` (or ``torchrun <args>``) from the repository root; one thread per process so
    the tests stay fast when other jobs share the two cores."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", *args] if torchrun else [sys.executable, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1].strip()
