"""Training curves as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
import os

from gspn2.train.checkpoint import atomic_write_bytes

__all__ = ["plot_curves"]


def plot_curves(history: list[dict[str, float]], path: str | os.PathLike) -> None:
    """Plot per-epoch ``train_loss``, ``val_loss``, ``val_top1`` (and ``ema_val_top1``) and ``lr``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.9, wspace=0.2)
    ax = axes[0]
    ax.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    ax.plot(epochs, [h["val_loss"] for h in history], marker="o", label="val")
    ax.set_title("loss")
    ax.legend()
    ax = axes[1]
    ax.plot(epochs, [h["val_top1"] for h in history], marker="o", label="model")
    if all("ema_val_top1" in h for h in history):
        ax.plot(epochs, [h["ema_val_top1"] for h in history], marker="o", label="EMA")
    ax.set_title("val top-1 (%)")
    ax.legend()
    ax = axes[2]
    ax.plot(epochs, [h["lr"] for h in history], marker="o")
    ax.set_title("lr (end of epoch)")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
