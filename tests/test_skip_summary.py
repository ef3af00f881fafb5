"""pytest's short summary: one line per skip reason, skips still reported as skips."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_skips_are_one_line_per_reason(tmp_path):
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = {addopts}\n")
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "gpu = pytest.mark.skipif(True, reason='needs an NVIDIA GPU')\n"
        + "".join(f"@gpu\ndef test_gpu_{i}(): pass\n" for i in range(3))
        + "def test_other(): pytest.skip('no network')\n"
        + "def test_ok(): assert True\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\n@pytest.mark.skipif(True, reason='needs an NVIDIA GPU')\ndef test_gpu(): pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    gpu = [line for line in lines if "needs an NVIDIA GPU" in line]
    assert gpu == ["SKIPPED 4 test(s) in 2 file(s): needs an NVIDIA GPU"], proc.stdout
    assert [line for line in lines if "no network" in line] == ["SKIPPED 1 test(s) in 1 file(s): no network"]
    assert "1 passed, 5 skipped" in lines[-1]
