"""scripts/gpu_check.sh refuses bad arguments and a machine without a usable GPU before it writes anything.
CUDA is hidden with CUDA_VISIBLE_DEVICES, so the check also holds on GPU machines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=120)


def test_help_lists_every_stage_the_script_runs(tmp_path):
    result = _run("--help", tmp_path=tmp_path)
    assert result.returncode == 0
    stages = re.search(r"^ALL_STAGES=\((.*)\)$", SCRIPT.read_text(), re.M).group(1).split()
    assert "build" in stages and "sanitize" in stages
    for stage in stages:
        assert re.search(rf"^  {re.escape(stage)}\s", result.stdout, re.M), stage
    assert not (tmp_path / "out").exists()


def test_unknown_stage_and_bad_settings_are_refused_before_anything_is_written(tmp_path):
    result = _run("test", "bench", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "unknown stage 'bench'" in result.stderr
    result = _run("test", tmp_path=tmp_path, TIMEOUT="ten")
    assert result.returncode == 2 and "TIMEOUT must be a whole number" in result.stderr
    result = _run("test", tmp_path=tmp_path, QUICK="yes")
    assert result.returncode == 2 and "QUICK must be 0 or 1" in result.stderr
    assert not (tmp_path / "out").exists()


def test_refuses_without_a_gpu(tmp_path):
    result = _run("test", tmp_path=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2
    assert "needs an NVIDIA GPU" in result.stderr and "is_available() is False" in result.stderr
    assert not (tmp_path / "out").exists()
