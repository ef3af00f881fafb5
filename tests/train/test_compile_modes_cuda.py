"""Training under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) is the training of the default mode:
the same weights after the same steps with EMA, gradient clipping and drop path, and a crash plus resume
reproduces the uninterrupted run bitwise. The ImageNet experiments train in that mode (docs/training.md)."""

from __future__ import annotations

import json

import pytest
import torch

from gspn2.train.checkpoint import load_checkpoint
from tests.train._helpers import TINY, compose_cfg

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

EPOCHS = 2
STEPS_PER_EPOCH = 128 // 32


def _overrides(digits_root, run_dir, mode, *extra):
    return [
        *TINY,
        f"data.root={digits_root}",
        f"run_dir={run_dir}",
        f"trainer.epochs={EPOCHS}",
        "trainer.device=cuda",
        "trainer.precision=bf16",
        "trainer.channels_last=true",
        "trainer.compile=true",
        f"trainer.compile_mode={mode}",
        "optim.clip_grad=0.05",  # small enough that clipping acts on these steps
        "model.drop_path_rate=0.1",
        *extra,
    ]


def _weights(path):
    ckpt = load_checkpoint(path)
    return {f"{k}.{n}": t for k in ("model", "ema") for n, t in ckpt[k].items()}


def _history(run_dir):
    history = json.loads((run_dir / "results.json").read_text())["history"]
    # losses and accuracies; timings and throughput differ between runs
    return [{k: v for k, v in h.items() if "loss" in k or "top" in k} for h in history]


def test_reduce_overhead_trains_as_the_default_mode_and_resumes_bitwise(digits_root, train_script, tmp_path):
    default, graphs = tmp_path / "default", tmp_path / "graphs"
    train_script.train(compose_cfg(_overrides(digits_root, default, "default")))
    train_script.train(compose_cfg(_overrides(digits_root, graphs, "reduce-overhead")))
    wd, wg = _weights(default / "last.pt"), _weights(graphs / "last.pt")
    assert wd.keys() == wg.keys()
    # The same Inductor kernels in the same order: equal up to rounding of reordered reductions, if any.
    worst = max(((wd[k].float() - wg[k].float()).abs().max().item(), k) for k in wd)
    assert worst[0] <= 1e-5, f"reduce-overhead differs from default by {worst[0]:.3g} in {worst[1]}"

    # Crash two steps into epoch 2, then the same command again: bitwise the uninterrupted run.
    crashed = tmp_path / "crashed"
    stop = f"trainer.stop_after_steps={STEPS_PER_EPOCH + 2}"
    train_script.train(compose_cfg(_overrides(digits_root, crashed, "reduce-overhead", stop)))
    assert load_checkpoint(crashed / "last.pt")["epoch"] == 1
    train_script.train(compose_cfg(_overrides(digits_root, crashed, "reduce-overhead")))
    wc = _weights(crashed / "last.pt")
    for k in wg:
        assert torch.equal(wg[k], wc[k]), k
    assert _history(crashed) == _history(graphs)
