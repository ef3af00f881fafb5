"""timm's long-run switches: BCE loss, sqrt lr scaling, clip modes, repeated augmentation, predictions for
a folder of unlabelled images."""

from __future__ import annotations

import csv
import io
import math
import shutil

import pytest
import torch
from timm.loss import BinaryCrossEntropy

from gspn2.train.build import build_mixup_and_loss, clip_gradients, lr_scale
from gspn2.train.data import ShardedBatchSampler
from tests.train._helpers import CONFIGS, compose_cfg


@pytest.mark.parametrize("aug", ["imagenet", "digits"])
def test_bce_loss(aug):
    cfg = compose_cfg([f"aug={aug}", "aug.bce_loss=true", "aug.bce_target_thresh=0.2"])
    mixup, loss_fn = build_mixup_and_loss(cfg.aug, 10)
    assert isinstance(loss_fn, BinaryCrossEntropy) and loss_fn.target_threshold == 0.2
    assert (mixup is not None) == (aug == "imagenet")
    if mixup is None:  # no mixup: BCE smooths the hard labels itself
        assert loss_fn.smoothing == cfg.aug.smoothing
    logits, targets = torch.randn(4, 10), torch.randint(0, 10, (4,))
    if mixup is not None:
        _, targets = mixup(torch.randn(4, 3, 8, 8), targets)
    assert torch.isfinite(loss_fn(logits, targets))


def test_sqrt_lr_scaling():
    cfg = compose_cfg(["experiment=in1k_gspn2_tiny", "data.root=/x"])
    assert lr_scale(cfg.optim, 2048) == 4.0
    cfg.optim.lr_base_scale = "sqrt"
    assert lr_scale(cfg.optim, 2048) == pytest.approx(2.0) and lr_scale(cfg.optim, 128) == pytest.approx(0.5)
    assert math.isclose(lr_scale(cfg.optim, 512), 1.0)


@pytest.mark.parametrize("mode", ["norm", "value", "agc"])
def test_clip_modes(mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    (model(torch.randn(16, 8)) * 100).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradients(model, 0.5, mode)
    after = [p.grad for p in model.parameters()]
    if mode == "norm":
        assert norm > 0.5 and torch.linalg.vector_norm(torch.cat([g.flatten() for g in after])) <= 0.5 + 1e-6
    elif mode == "value":
        assert norm is None and all(g.abs().max() <= 0.5 for g in after)
    else:
        assert norm is None and any(not torch.equal(a, b) for a, b in zip(after, before))


def test_repeated_augmentation_repeats_each_drawn_image():
    plain = list(ShardedBatchSampler(64, 8, world_size=1, rank=0, seed=3))
    repeated = list(ShardedBatchSampler(64, 8, world_size=1, rank=0, seed=3, repeats=3))
    assert len(repeated) == len(plain) == 64
    assert repeated[:9] == [plain[0]] * 3 + [plain[1]] * 3 + [plain[2]] * 3
    assert len(set(repeated)) == math.ceil(64 / 3)
    assert compose_cfg(["aug.repeats=3"]).aug.repeats == 3


def test_predictions_for_a_folder_of_unlabelled_images(short_run, eval_script, digits_root, tmp_path):
    folder = tmp_path / "unlabelled"
    (folder / "nested").mkdir(parents=True)
    for i, src in enumerate(sorted((digits_root / "val" / "7").glob("*.png"))[:3]):
        shutil.copyfile(src, (folder / "nested" if i == 2 else folder) / f"img{i}.png")
    out = tmp_path / "pred.csv"
    cfg = compose_cfg(
        [f"checkpoint={short_run[1] / 'best.pt'}", f"predict={folder}", "topk=3", f"out={out}"],
        config_name="eval",
        config_dir=CONFIGS / "eval",
    )
    assert eval_script.run_eval(cfg) == out
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["file"] for r in rows] == ["img0.png", "img1.png", "nested/img2.png"]
    assert set(rows[0]) == {"file", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"}
    for r in rows:
        assert r["class_1"] in [str(d) for d in range(10)]  # the class folder names, from the checkpoint
        assert 1.0 >= float(r["prob_1"]) >= float(r["prob_2"]) >= float(r["prob_3"]) >= 0.0
