"""Fine-tuning (timm's --initial-checkpoint): weights from a train.py checkpoint or a timm/HF-style file,
another classifier size, reports of what was loaded; layer-wise lr decay as a documented key."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from gspn2.train.build import build_model, build_optimizer
from gspn2.train.checkpoint import CheckpointError, load_checkpoint
from gspn2.train.finetune import load_initial_weights
from tests.train._helpers import CONFIGS, TINY, compose_cfg

HEAD = ["head.fc.bias", "head.fc.weight"]


def _micro(num_classes: int, **kwargs) -> torch.nn.Module:
    torch.manual_seed(num_classes)
    return timm.create_model("gspn2_micro", num_classes=num_classes, **kwargs)


@pytest.mark.parametrize("layout", ["state_dict", "wrapped", "ddp_prefixed", "safetensors"])
def test_timm_style_file_with_another_head(tmp_path, layout):
    source = _micro(1000)
    state = source.state_dict()
    state["extra.buffer"] = torch.zeros(2)  # a key the model does not have: reported, not loaded
    path = tmp_path / ("w.safetensors" if layout == "safetensors" else "w.pth")
    if layout == "safetensors":
        save_file(state, str(path))
    else:
        obj = {
            "state_dict": state,
            "wrapped": {"state_dict": state, "epoch": 3},
            "ddp_prefixed": {f"module.{k}": v for k, v in state.items()},
        }[layout]
        torch.save(obj, path)
    model = _micro(10)
    fresh_head = {k: model.state_dict()[k].clone() for k in HEAD}
    report = load_initial_weights(model, path)
    assert report["reinitialised"] == HEAD and report["unexpected"] == ["extra.buffer"]
    assert report["missing"] == [] and len(report["loaded"]) == len(state) - 1 - len(HEAD)
    own = model.state_dict()
    for k in report["loaded"]:
        assert torch.equal(own[k], state[k]), k
    for k in HEAD:  # the 10-class head keeps its own initialisation
        assert torch.equal(own[k], fresh_head[k])


def test_other_architecture_is_refused(tmp_path):
    path = tmp_path / "w.pth"
    torch.save(_micro(10, dims=(16, 32, 64, 96)).state_dict(), path)
    with pytest.raises(CheckpointError, match=r"w.pth.*outside its classifier.*shape mismatches"):
        load_initial_weights(_micro(10), path)
    torch.save({"not": "weights"}, path)
    with pytest.raises(CheckpointError, match="neither a train.py checkpoint nor a state dict"):
        load_initial_weights(_micro(10), path)


def test_finetune_from_a_train_checkpoint_then_eval_uses_its_data_config(
    short_run, train_script, eval_script, digits_root, tmp_path, capsys
):
    """From a train.py checkpoint's EMA weights; eval.py of the result takes the digits' mean, std and
    crop from the checkpoint, not ImageNet's."""
    ckpt = short_run[1] / "last.pt"
    run_dir = tmp_path / "ft"
    cfg = compose_cfg(
        [*TINY, f"data.root={digits_root}", f"run_dir={run_dir}", "trainer.epochs=1",
         f"initial_checkpoint={ckpt}", "initial_checkpoint_ema=true"]
    )  # fmt: skip
    capsys.readouterr()
    train_script.train(cfg)
    out = capsys.readouterr().out
    assert f"initial weights: {ckpt} (EMA weights of a gspn2_micro checkpoint (epoch 2))" in out
    assert "re-initialised (classifier of another size): none" in out
    state = load_checkpoint(run_dir / "last.pt")
    assert state["config"]["initial_checkpoint"] == str(ckpt) and state["epoch"] == 1

    out_json = tmp_path / "eval.json"
    eval_cfg = compose_cfg(
        [f"checkpoint={run_dir / 'last.pt'}", f"out={out_json}", "data.val_subset=32"],
        config_name="eval",
        config_dir=CONFIGS / "eval",
    )
    eval_script.run_eval(eval_cfg)
    results = json.loads(out_json.read_text())
    assert (results["mean"], results["std"], results["crop_pct"]) == ([0.5] * 3, [0.5] * 3, 1.0)


def test_finetune_into_other_classes_reports_the_head(train_script, digits_root, tmp_path, capsys):
    path = tmp_path / "in1k.pth"
    torch.save({"state_dict": _micro(1000).state_dict()}, path)
    cfg = compose_cfg(
        [*TINY, f"data.root={digits_root}", f"runs_root={tmp_path / 'runs'}", "trainer.epochs=1",
         f"initial_checkpoint={path}", "trainer.limit_train_steps=1"]
    )  # fmt: skip
    capsys.readouterr()
    train_script.train(cfg)
    assert f"re-initialised (classifier of another size): {HEAD}" in capsys.readouterr().out


def test_layer_decay_is_a_documented_key():
    cfg = compose_cfg(["optim.layer_decay=0.75"])
    model = build_model(cfg.model, cfg.data.num_classes)
    optimizer = build_optimizer(cfg.optim, model, lr_scale=1.0)
    scales = sorted({g["lr_scale"] for g in optimizer.param_groups})
    assert len(scales) > 3 and scales[-1] == pytest.approx(1.0) and scales[0] < 0.75**3
    assert "optim.layer_decay" in (CONFIGS.parent / "docs" / "training.md").read_text()
