"""A short `python train.py` run: what it prints and writes, W&B offline files, and eval.py on its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import yaml

from gspn2.train.checkpoint import load_checkpoint
from tests.train._helpers import CONFIGS, TINY, compose_cfg, last_line, run_cli


def test_prints_counts_epochs_and_ends_with_the_run_dir(short_run):
    proc, run_dir, _ = short_run
    out = proc.stdout
    assert "params" in out and "MACs" in out
    assert "epoch   1/2" in out and "epoch   2/2" in out
    assert last_line(out) == str(run_dir)
    assert run_dir.is_dir()


def test_run_dir_contents(short_run):
    _, run_dir, results = short_run
    for key in ("val_top1", "val_top5", "val_loss", "epoch", "ema_val_top1", "best_top1", "params", "macs"):
        assert key in results, key
    assert results["epoch"] == 2 and len(results["history"]) == 2
    assert 0.0 <= results["val_top1"] <= results["val_top5"] <= 100.0
    assert results["val_top1"] > 30.0  # 10 classes: chance is 10%; two tiny epochs already learn something
    assert results["params"] > 0 and results["macs"] > 0
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["name"] == "gspn2_micro" and config["trainer"]["epochs"] == 2
    last = load_checkpoint(run_dir / "last.pt")
    best = load_checkpoint(run_dir / "best.pt")
    assert last["epoch"] == 2 and last["step"] == 2 * (256 // 32)
    assert best["epoch"] == results["best_epoch"]
    assert last["ema"] is not None and last["ema_updates"] == last["step"]
    for key in ("optimizer", "scheduler", "rng", "config", "wandb_id", "history"):
        assert last[key] is not None, key
    assert set(last["rng"][0]) == {"python", "numpy", "torch", "cuda"}
    assert last["config"]["data"]["train_subset"] == 256
    # atomic writes leave no temporary files behind
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_wandb_offline_files_under_the_run_dir(short_run):
    _, run_dir, _ = short_run
    run_id = load_checkpoint(run_dir / "last.pt")["wandb_id"]
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    data = list(offline[0].glob("*.wandb"))
    assert data and data[0].stat().st_size > 0


def test_eval_cli_reproduces_training_validation(short_run):
    _, run_dir, results = short_run
    proc = run_cli(["eval.py", f"checkpoint={run_dir / 'last.pt'}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out_path = Path(last_line(proc.stdout))
    assert out_path.parent == run_dir
    ev = json.loads(out_path.read_text())
    assert "top1" in proc.stdout and "img/s" in proc.stdout and "MACs" in proc.stdout
    assert ev["images"] == 96
    assert ev["top1"] == pytest.approx(results["val_top1"], abs=1e-9)
    assert ev["top5"] == pytest.approx(results["val_top5"], abs=1e-9)
    assert ev["loss"] == pytest.approx(results["val_loss"], rel=1e-5)
    assert ev["params"] == results["params"] and ev["macs"] == results["macs"]
    assert ev["img_per_s"] > 0


def test_eval_of_ema_weights_reproduces_training_ema_validation(short_run, eval_script, tmp_path):
    _, run_dir, results = short_run
    out = tmp_path / "ema.json"
    cfg = compose_cfg(
        [f"checkpoint={run_dir / 'last.pt'}", "ema=true", f"out={out}"],
        config_name="eval",
        config_dir=CONFIGS / "eval",
    )
    assert eval_script.run_eval(cfg) == out
    ev = json.loads(out.read_text())
    assert ev["top1"] == pytest.approx(results["ema_val_top1"], abs=1e-9)
    assert ev["loss"] == pytest.approx(results["ema_val_loss"], rel=1e-5)


def test_eval_any_timm_model_by_name(digits_root, eval_script, tmp_path):
    out = tmp_path / "resnet18.json"
    cfg = compose_cfg(
        [
            "model_name=resnet18",
            f"data.root={digits_root}",
            "data.val_subset=32",
            "img_size=32",
            f"out={out}",
        ],
        config_name="eval",
        config_dir=CONFIGS / "eval",
    )
    eval_script.run_eval(cfg)
    ev = json.loads(out.read_text())
    assert ev["images"] == 32 and 0.0 <= ev["top1"] <= 100.0
    reference = timm.create_model("resnet18")
    assert ev["params"] == sum(p.numel() for p in reference.parameters())
    assert ev["model"] == "resnet18" and ev["macs"] > 0


def test_compile_mode_reaches_torch_compile(train_script, digits_root, tmp_path, monkeypatch):
    """``trainer.compile=true trainer.compile_mode=...`` compiles the training model with that mode (the
    compiler itself is replaced by a recorder: compiling on a 2-core CPU would take minutes)."""
    calls = []

    def fake_compile(model, mode=None, **kwargs):
        calls.append((type(model).__name__, mode))
        return model

    monkeypatch.setattr(train_script.torch, "compile", fake_compile)
    cfg = compose_cfg([*TINY, f"data.root={digits_root}", f"runs_root={tmp_path / 'runs'}", "trainer.epochs=1",
                       "trainer.limit_train_steps=1", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"])
    train_script.train(cfg)
    assert calls == [("GSPN2", "reduce-overhead")]


def test_compile_lean_memory_sets_the_partitioner(train_script, digits_root, tmp_path, monkeypatch):
    """``trainer.compile_lean_memory=true`` lets AOTAutograd recompute instead of save (a process-wide
    setting, restored here by monkeypatch); the compiler is replaced by a recorder, as above."""
    import torch._functorch.config as aot

    monkeypatch.setattr(aot, "ban_recompute_materialized_backward", True)
    monkeypatch.setattr(train_script.torch, "compile", lambda model, mode=None, **kw: model)
    base = [*TINY, f"data.root={digits_root}", "trainer.epochs=1", "trainer.limit_train_steps=1", "trainer.compile=true"]
    train_script.train(compose_cfg([*base, f"runs_root={tmp_path / 'a'}"]))
    assert aot.ban_recompute_materialized_backward is True  # off by default
    train_script.train(compose_cfg([*base, f"runs_root={tmp_path / 'b'}", "trainer.compile_lean_memory=true"]))
    assert aot.ban_recompute_materialized_backward is False
