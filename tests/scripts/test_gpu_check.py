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
    result = _run("sanitize", tmp_path=tmp_path, SANITIZE_GROUPS="dwconv ops")
    assert result.returncode == 2 and "SANITIZE_GROUPS takes op, short, cluster and dwconv, got 'ops'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_refuses_without_a_gpu(tmp_path):
    result = _run("test", tmp_path=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2
    assert "needs an NVIDIA GPU" in result.stderr and "is_available() is False" in result.stderr
    assert not (tmp_path / "out").exists()


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the interpreter: answers the GPU probe, logs every call, fails the build on request.
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} $*" >> "$FAKE_LOG"
case "$*" in
  *is_available*) echo "9.0 2 Fake GPU" ;;
  *setup.py*) if [[ ${FAKE_BUILD_FAIL:-0} == 1 ]]; then echo "nvcc: error"; exit 1; fi; echo built ;;
  *"-m pytest"*) echo "3 passed" ;;
  *) echo ok ;;
esac
"""


def _fake(tmp_path: Path) -> dict:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {"PYTHON": str(fake), "FAKE_LOG": str(tmp_path / "calls.log")}


def test_stages_run_in_order_with_a_log_each_and_a_summary(tmp_path):
    result = _run("build", "test", "ddp", tmp_path=tmp_path, **_fake(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    calls = (tmp_path / "calls.log").read_text().splitlines()
    build = [c for c in calls if "setup.py build_ext --inplace" in c]
    assert len(build) == 1 and build[0].startswith("TORCH_CUDA_ARCH_LIST=9.0 ")  # the GPU's own architecture
    pytest_call = next(c for c in calls if "-m pytest" in c)
    assert "tests/ops/test_cuda.py" in pytest_call and "tests/ops/test_dwconv.py" in pytest_call
    ddp = [c for c in calls if "torch.distributed.run" in c]
    assert [c.split("--nproc_per_node=")[1].split()[0] for c in ddp] == ["1", "2"]
    for log in ("env.txt", "build.log", "build_import.log", "pytest_cuda.log", "ddp_1gpu.log", "ddp_2gpu.log"):
        assert (out / log).is_file(), log
    summary = (out / "summary.md").read_text()
    for row in ("| build | ok |", "| test | ok |", "| ddp 1 GPU | ok |", "| ddp 2 GPU | ok |"):
        assert row in summary, summary
    assert summary in result.stdout


def test_a_failed_build_skips_the_stages_that_need_it_and_fails_the_run(tmp_path):
    result = _run("build", "test", tmp_path=tmp_path, FAKE_BUILD_FAIL="1", **_fake(tmp_path))
    assert result.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| build | FAILED (rc=1) |" in summary and "| test | skipped: the build failed |" in summary
    assert "-m pytest" not in (tmp_path / "calls.log").read_text()


def test_sanitize_runs_the_groups_asked_for_under_both_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sanitizer = bin_dir / "compute-sanitizer"
    sanitizer.write_text('#!/usr/bin/env bash\necho "compute-sanitizer $*" >> "$FAKE_LOG"\n')
    sanitizer.chmod(0o755)
    env = {**_fake(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SANITIZE_GROUPS": "dwconv"}
    result = _run("sanitize", tmp_path=tmp_path, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith("compute-sanitizer")]
    assert [(c.split("--tool ")[1].split()[0], c.split()[-1]) for c in calls] == [
        ("memcheck", "dwconv"), ("racecheck", "dwconv")]
