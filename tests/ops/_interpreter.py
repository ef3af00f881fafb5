"""Run a script in a fresh Python process with Triton's interpreter (``TRITON_INTERPRET=1``): Triton kernels on
the CPU. The variable must be set before Triton is imported, hence the subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def run_in_triton_interpreter(script: str, timeout: float = 600) -> None:
    """Run ``script``; assert that it exits 0 and that its output ends with ``ok``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
