"""What a run records and prints: the backend, the overrides and the resolved run directory, summary.csv,
the k best checkpoints, the sweep summary, curves.png, and an output without floods (non-tty log)."""

from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gspn2.train.history import append_sweep_row, keep_top_k, summary_csv
from gspn2.train.plotting import curves_figure
from tests.train._helpers import TINY, run_cli


def test_results_and_config_say_what_ran(short_run):
    proc, run_dir, results = short_run
    assert results["backend"]["device"] == "cpu" and results["backend"]["op"] == "reference"
    assert {"op_backend", "kernel_family", "dwconv", "dwconv_backend", "extension_built"} <= set(results["backend"])
    assert "gspn2 op: pure-PyTorch reference" in proc.stdout
    assert "trainer.epochs=2" in results["overrides"]
    config = (run_dir / "config.yaml").read_text()
    assert config.startswith("# python train.py ") and "trainer.epochs=2" in config.splitlines()[0]
    assert f"run_dir: {run_dir}\n" in config
    # and in the W&B run's config (the offline run's record holds the key names)
    (record,) = run_dir.glob("wandb/offline-run-*/*.wandb")
    assert b"op_backend" in record.read_bytes() and b"kernel_family" in record.read_bytes()


def test_summary_csv_has_one_row_per_epoch(short_run):
    _, run_dir, results = short_run
    rows = list(csv.DictReader(io.StringIO((run_dir / "summary.csv").read_text())))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[-1]["val_top1"]) == results["val_top1"]


def test_output_is_quiet_in_a_log_file(short_run):
    """Captured (not a terminal): no progress-bar carriage returns, one W&B line, no repeated warnings."""
    proc = short_run[0]
    out = proc.stdout + proc.stderr
    assert "\r" not in out
    wandb_lines = [line for line in out.splitlines() if line.startswith("wandb:")]
    assert len(wandb_lines) == 1 and "wandb sync" in wandb_lines[0], wandb_lines
    assert "pin_memory" not in out


def test_keep_top_k(tmp_path):
    history = []
    kept = []
    for epoch, top1 in enumerate([50.0, 70.0, 60.0, 80.0, 60.0], start=1):
        history.append({"epoch": epoch, "val_top1": top1})
        kept = keep_top_k(tmp_path, history, {"epoch": torch.tensor(epoch)}, k=2)
    assert kept == [4, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2.pt", "checkpoint-4.pt"]
    assert keep_top_k(tmp_path, history, {}, k=0) == []


def test_summary_csv_takes_every_column():
    text = summary_csv([{"epoch": 1, "val_top1": 1.0}, {"epoch": 2, "val_top1": 2.0, "ema_val_top1": 3.0}])
    assert text.decode().splitlines() == ["epoch,val_top1,ema_val_top1", "1,1.0,", "2,2.0,3.0"]


def test_sweep_summary_links_jobs_to_run_dirs(tmp_path):
    append_sweep_row(tmp_path, {"job": 1, "run_dir": "runs/b", "status": "done", "best_top1": 2.0})
    append_sweep_row(tmp_path, {"job": 0, "run_dir": "runs/a", "status": "failed"})
    append_sweep_row(tmp_path, {"job": 0, "run_dir": "runs/a", "status": "done"})  # a requeued job
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert [(r["job"], r["run_dir"], r["status"]) for r in rows] == [("0", "runs/a", "done"), ("1", "runs/b", "done")]


def test_curves_are_titled_and_labelled():
    history = [
        {"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.0 / e, "val_top1": 10.0 * e, "lr": 0.1} for e in (1, 2)
    ]
    fig = curves_figure(history, "digits / 20261201: gspn2_micro", "train (label smoothing 0.1)", [0.1, 0.2, 0.3])
    assert fig._suptitle.get_text() == "digits / 20261201: gspn2_micro"
    loss_ax, _, lr_ax = fig.axes
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["train (label smoothing 0.1)", "val"]
    assert lr_ax.get_xlabel() == "optimizer step" and list(lr_ax.lines[0].get_xdata()) == [1, 2, 3]


def test_dataloader_worker_warning_once_per_process(train_script, monkeypatch):
    """DataLoader re-checks its worker count at every epoch's iterator, and its warning came back each
    epoch (filters touched in between reset the registry): now one note at start, no repeats."""
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        note = train_script.worker_count_note(2)
        loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2, num_workers=2)
        for _ in range(3):
            warnings.filterwarnings("ignore", message="unrelated")  # resets the per-module registries
            loader._get_iterator()._shutdown_workers()
    assert note == "note: data.num_workers=2 loader processes share 1 CPU core(s): expect contention"
    assert not [w for w in caught if "DataLoader will create" in str(w.message)]
    assert train_script.worker_count_note(1) is None


@pytest.mark.slow
def test_multirun_writes_one_summary_row_per_job(digits_root, tmp_path):
    sweep = tmp_path / "multirun"
    proc = run_cli(
        ["train.py", "-m", "seed=0,1", *TINY, f"data.root={digits_root}", f"runs_root={tmp_path / 'runs'}",
         f"hydra.sweep.dir={sweep}", "trainer.epochs=1", "trainer.limit_train_steps=1"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO((sweep / "summary.csv").read_text())))
    assert [(r["job"], r["status"], r["overrides"].split()[0]) for r in rows] == [
        ("0", "done", "seed=0"),
        ("1", "done", "seed=1"),
    ]
    for r in rows:
        assert (Path(r["run_dir"]) / "results.json").is_file() and r["epoch"] == "1"
