"""Fail fast, write nothing: every value is checked at start, before a run directory, config.yaml or a W&B
run exists; user errors are one line on stderr and a non-zero exit; Ctrl-C says how to resume."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from gspn2.ops._cuda import BUILD_HINT
from gspn2.train.config import ConfigError
from gspn2.train.distributed import DistInfo
from tests.train._helpers import REPO, TINY, compose_cfg, run_cli

BAD_VALUES = [
    ("trainer.precision=fp64", "trainer.precision"),
    ("trainer.epochs=0", "trainer.epochs"),
    ("trainer.epochs=-3", "trainer.epochs"),
    ("data.batch_size=0", "data.batch_size"),
    ("trainer.accum_steps=0", "trainer.accum_steps"),
    ("trainer.cpu_threads=0", "trainer.cpu_threads"),
    ("trainer.device=gpu", "trainer.device"),
    ("trainer.dist_backend=ncll", "trainer.dist_backend"),
    ("logger.mode=offlien", "logger.mode"),
    ("data.interpolation=cubic", "data.interpolation"),
    ("data.prepare=imagenet", "data.prepare"),
    ("aug.reprob=1.5", "aug.reprob"),
    ("aug.mixup_mode=rows", "aug.mixup_mode"),
    ("optim.lr=0", "optim.lr"),
    ("optim.clip_mode=l3", "optim.clip_mode"),
    ("ema.decay=1.5", "ema.decay"),
    ("sched.name=cosinus", "sched.name"),
    ("data.std=[0.5,0,0.5]", "data.std"),
    ("resume=/no/such/last.pt", "resume"),
    ("initial_checkpoint=/no/such/weights.pth", "initial_checkpoint"),
    ("trainer.compile_lean_memory=true", "trainer.compile_lean_memory"),
]


@pytest.mark.parametrize("override,key", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_is_refused_before_anything_is_written(train_script, digits_root, tmp_path, override, key):
    runs = tmp_path / "runs"
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"runs_root={runs}", "logger.mode=offline", override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        train_script.train(cfg)
    assert not runs.exists()


def test_gpu_run_without_the_extension_stops_with_the_build_hint(train_script, digits_root, tmp_path, monkeypatch):
    """A CUDA device without gspn2._C: the build hint, before any data, model or file."""
    import gspn2.train.runinfo as runinfo

    monkeypatch.setattr(runinfo, "extension_available", lambda: False)
    cuda = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0))
    monkeypatch.setattr(train_script, "init_distributed", lambda *a, **k: cuda)
    runs = tmp_path / "runs"
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"runs_root={runs}"])
    with pytest.raises(ConfigError, match="pip install --no-build-isolation"):
        train_script.train(cfg)
    assert not runs.exists()
    from gspn2.ops import options

    with options.override(backend="reference"):  # the pure-PyTorch reference needs no extension
        runinfo.require_extension(torch.device("cuda", 0))
    assert BUILD_HINT.startswith("gspn2's CUDA extension")


def test_cli_user_error_is_one_line_and_exit_2(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli(["train.py", "trainer.precision=fp64", f"runs_root={runs}", "logger.mode=offline"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: trainer.precision must be one of bf16 | fp16 | fp32; got 'fp64'"], lines
    assert not runs.exists()


def _default_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(digits_root, tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, f"data.root={digits_root}", f"run_dir={run_dir}", "trainer.epochs=200"]
    # -X faulthandler: SIGABRT makes the child print every thread's stack, if it ever fails to stop.
    # The child gets SIGINT as a shell gives it, default and unblocked: a process started from a pytest-xdist
    # worker that has run other tests can inherit it ignored or blocked, and then trains on through the signal.
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "train.py", *args], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"train.py still ran 120 s after SIGINT; its stacks and last output:\n{err[-6000:]}\n{out[-2000:]}")
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert f"interrupted: the last checkpoint is {run_dir / 'last.pt'}" in err
    resume = err.split("resume with: ")[1].strip()
    assert resume.startswith("python train.py ") and resume.endswith(f"run_dir={run_dir}")
    assert resume.count("run_dir=") == 1 and f"data.root={digits_root}" in resume
