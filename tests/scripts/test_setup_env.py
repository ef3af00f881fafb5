"""scripts/setup_env.sh builds the CUDA extension only for what the machine can run (scripts/cuda_arch.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _arch(**env) -> tuple[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"} | env
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "cuda_arch.sh"), sys.executable],
        env=environ, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    archs, why = out.rstrip("\n").split("\t")
    return archs, why


def test_arch_list_is_the_local_gpus_or_one_for_a_gpu_less_builder():
    archs, why = _arch()
    if torch.cuda.is_available():
        local = {"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        assert set(archs.split(";")) == local and "GPU" in why
    else:  # CI: nvcc but no GPU still compiles the kernels, for one architecture
        assert archs == "9.0" and "no GPU visible" in why


def test_arch_list_can_be_asked_for():
    assert _arch(TORCH_CUDA_ARCH_LIST="8.0;9.0") == ("8.0;9.0", "TORCH_CUDA_ARCH_LIST")


def test_setup_uses_it_and_says_what_it_builds():
    script = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "bash scripts/cuda_arch.sh" in script
    assert "compiling the CUDA extension" in script and "for compute capability" in script
