"""Per-run records beyond last.pt/best.pt: the k best checkpoints, summary.csv, and the sweep summary.

Every file goes through :func:`gspn2.train.checkpoint.atomic_write_bytes` / ``save_checkpoint`` (a
temporary file renamed into place), like the run's other artefacts.
"""

from __future__ import annotations

import csv
import fcntl
import io
from pathlib import Path

from gspn2.train.checkpoint import atomic_write_bytes, save_checkpoint

__all__ = ["keep_top_k", "summary_csv", "write_summary", "append_sweep_row"]


def _ckpt_name(epoch: int) -> str:
    return f"checkpoint-{epoch}.pt"


def keep_top_k(run_dir: Path, history: list[dict], state: dict, k: int, metric: str = "val_top1") -> list[int]:
    """Keep ``checkpoint-<epoch>.pt`` for the ``k`` epochs of ``history`` with the highest ``metric``.

    Called after each epoch with that epoch's ``state`` (the last entry of ``history``): writes it if it
    ranks in the top ``k`` (ties go to the earlier epoch) and deletes the checkpoints that dropped out.
    Returns the kept epochs, best first. ``k=0`` keeps none and touches nothing.
    """
    if k <= 0:
        return []
    ranked = sorted(history, key=lambda h: (-h[metric], h["epoch"]))
    keep = [h["epoch"] for h in ranked[:k]]
    epoch = history[-1]["epoch"]
    if epoch in keep:
        save_checkpoint(state, run_dir / _ckpt_name(epoch))
    for path in run_dir.glob("checkpoint-*.pt"):
        stem = path.stem[len("checkpoint-") :]
        if stem.isdigit() and int(stem) not in keep:
            path.unlink()
    return keep


def summary_csv(history: list[dict]) -> bytes:
    """One row per epoch, timm's summary.csv layout: epoch first, then every metric of the history."""
    columns: list[str] = []
    for record in history:
        columns += [c for c in record if c not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    return buf.getvalue().encode()


def write_summary(run_dir: Path, history: list[dict]) -> None:
    atomic_write_bytes(run_dir / "summary.csv", summary_csv(history))


SWEEP_COLUMNS = ("job", "run_dir", "overrides", "best_top1", "best_epoch", "val_top1", "epoch", "status")


def append_sweep_row(sweep_dir: Path, row: dict) -> None:
    """Add (or replace) job ``row['job']``'s line of ``<sweep_dir>/summary.csv``.

    The jobs of a sweep may run at once (submitit): the read-modify-write is serialised by an exclusive
    lock on ``summary.csv.lock`` and the file itself is replaced atomically.
    """
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / "summary.csv"
    with open(sweep_dir / "summary.csv.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = list(csv.DictReader(io.StringIO(path.read_text()))) if path.exists() else []
        rows = [r for r in rows if r["job"] != str(row["job"])] + [{c: row.get(c, "") for c in SWEEP_COLUMNS}]
        rows.sort(key=lambda r: int(r["job"]))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=SWEEP_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(path, buf.getvalue().encode())
