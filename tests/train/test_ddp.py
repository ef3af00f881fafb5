"""Two DDP processes (gloo, CPU) take the same optimizer steps as one process on the whole batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspn2.train.build import build_model
from gspn2.train.checkpoint import load_checkpoint
from tests.train._helpers import TINY, compose_cfg, last_line, run_cli

# Deterministic everywhere: no random augmentation, mixup, drop-path or dropout; SGD (unlike Adam's first
# steps, its update is proportional to the gradient, so a wrongly scaled gradient average would show);
# no warm-up, so the first steps move the weights. The data order does not depend on the process count.
COMMON = [
    *TINY,
    "aug=none",
    "ema=none",
    "optim=sgd",
    "optim.lr=2.0",
    "sched.warmup_epochs=0",
    "model.drop_path_rate=0.0",
    "model.drop_rate=0.0",
    "trainer.epochs=1",
    "trainer.limit_train_steps=2",
    "data.val_subset=51",
]  # odd: the two ranks evaluate 26 and 25 images


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_on_the_global_batch(digits_root, train_script, tmp_path):
    single_root, ddp_root = tmp_path / "single", tmp_path / "ddp"
    # the one-process run in this process (a third interpreter start-up would be most of its time)
    single_dir = train_script.train(
        compose_cfg([*COMMON, f"data.root={digits_root}", f"runs_root={single_root}", "data.batch_size=16"])
    )
    ddp = run_cli(
        [
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *COMMON,
            f"data.root={digits_root}",
            f"runs_root={ddp_root}",
            "data.batch_size=8",
            "trainer.dist_backend=gloo",
        ],
        torchrun=True,
    )
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-3000:]

    # rank 0 chose the run directory and every rank used it: exactly one was created
    ddp_dir = Path(last_line(ddp.stdout))
    assert [p for p in (ddp_root / "digits").iterdir()] == [ddp_dir]

    a, b = load_checkpoint(single_dir / "last.pt"), load_checkpoint(ddp_dir / "last.pt")
    assert a["step"] == b["step"] == 2
    assert len(b["rng"]) == 2  # both ranks' random streams are saved
    cfg = compose_cfg([*COMMON, f"data.root={digits_root}"])
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model, cfg.data.num_classes).state_dict()
    moved = 0
    for name, init in initial.items():
        pa, pb = a["model"][name], b["model"][name]
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved += int(not torch.allclose(pa, init, rtol=0, atol=1e-4))
    assert a["model"].keys() == initial.keys()
    assert moved > len(initial) // 2, "the two steps must change most tensors, or the comparison is empty"

    # validation is sharded over the ranks and summed exactly
    ra = json.loads((single_dir / "results.json").read_text())
    rb = json.loads((ddp_dir / "results.json").read_text())
    assert rb["world_size"] == 2 and rb["global_batch"] == ra["global_batch"] == 16
    assert rb["val_top1"] == pytest.approx(ra["val_top1"], abs=1e-9)
    assert rb["val_loss"] == pytest.approx(ra["val_loss"], rel=1e-5)
    assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5)
