"""Helpers of the trainer tests: config composition, script loading and running."""

from __future__ import annotations

import multiprocessing
import os
import signal
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


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), to show that nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def flip_tensor_byte(path: Path) -> None:
    """Flip one byte inside the largest tensor record of a ``torch.save`` file, in place: the file
    still unpickles, only a tensor value changes (what a bad disk sector or a stray write does)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))


def _train_killed_at(target: Path, overrides: list[str]) -> None:
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace  # a forked child: the test process's os module is not touched
    load_script("train").train(compose_cfg(overrides))


def run_killed_at(target: Path, overrides: list[str], timeout: float = 300) -> int:
    """Train in a child process that kills itself with SIGKILL right before os.replace would move a file
    onto ``target``: a crash at a chosen point of the epoch's writes, with no cleanup code running.

    The child comes from the fork server (:func:`start_forked`). Returns its exit code, ``-SIGKILL`` when
    it reached ``target``.
    """
    return run_forked(_train_killed_at, target, overrides, timeout=timeout)


def run_forked(fn, *args, timeout: float = 300) -> int:
    """``fn(*args)`` in a forked child of the test process; waits for it and returns its exit code."""
    child = start_forked(fn, *args)
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        raise AssertionError(f"the child process did not end within {timeout} s")
    return child.exitcode


# Modules the fork server imports once, so that its children start with them loaded.
_FORKSERVER_PRELOAD = ["torch", "timm", "hydra", "gspn2", "gspn2.train", "tests.train._helpers"]


def start_forked(fn, *args) -> multiprocessing.Process:
    """``fn(*args)`` (a module-level function) started in a child forked from this test process's fork
    server: torch, timm and the trainer are already imported there, so the child skips an interpreter's
    start-up, and the server is a clean process. A fork of the test process itself is not: after
    ``torch.compile`` and a backward have run in a process (other tests in the same pytest worker do
    both), autograd refuses to run in its forked children. The child's output goes to the server's
    standard streams, not to the test's captured output."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # read when the server starts, ignored after
    child = ctx.Process(target=fn, args=args)
    child.start()
    return child
