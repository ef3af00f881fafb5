"""The same command goes to a cluster through Hydra's submitit launcher; here its local flavour."""

from __future__ import annotations

import json

import pytest

from tests.train._helpers import TINY, run_cli


@pytest.mark.slow
def test_submitit_local_launcher_runs_two_tasks_as_one_ddp_job(digits_root, tmp_path):
    """Two submitit tasks find their ranks in the submitit environment and train as one DDP job."""
    proc = run_cli(
        [
            "train.py",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            f"hydra.sweep.dir={tmp_path / 'multirun'}",
            f"runs_root={tmp_path / 'runs'}",
            f"data.root={digits_root}",
            *TINY,
            "data.batch_size=16",
            "trainer.epochs=1",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dirs = list((tmp_path / "runs" / "digits").iterdir())
    assert len(run_dirs) == 1, run_dirs  # both tasks agreed on one run directory
    results = json.loads((run_dirs[0] / "results.json").read_text())
    assert results["world_size"] == 2 and results["global_batch"] == 32 and results["epoch"] == 1
