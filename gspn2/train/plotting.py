"""Training curves as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
import os

from gspn2.train.checkpoint import atomic_write_bytes

__all__ = ["curves_figure", "plot_curves"]


def curves_figure(
    history: list[dict[str, float]],
    title: str = "",
    train_label: str = "train",
    lr_steps: list[float] | None = None,
):
    """The figure of :func:`plot_curves` (a matplotlib ``Figure``; the caller closes it).

    Panels: per-epoch train and val loss (``train_label`` says what the train loss was computed
    against, e.g. label-smoothed targets, so it is not read as comparable to the val loss), val top-1 of
    the model and EMA, and the lr of every optimizer step (``lr_steps``, step 1 first; without it the lr
    at each epoch's end).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.82, wspace=0.2)
    if title:
        fig.suptitle(title)
    ax = axes[0]
    ax.plot(epochs, [h["train_loss"] for h in history], marker="o", label=train_label)
    ax.plot(epochs, [h["val_loss"] for h in history], marker="o", label="val")
    ax.set_title("loss")
    ax.set_xlabel("epoch")
    ax.legend()
    ax = axes[1]
    ax.plot(epochs, [h["val_top1"] for h in history], marker="o", label="model")
    if all("ema_val_top1" in h for h in history):
        ax.plot(epochs, [h["ema_val_top1"] for h in history], marker="o", label="EMA")
    ax.set_title("val top-1 (%)")
    ax.set_xlabel("epoch")
    ax.legend()
    ax = axes[2]
    if lr_steps:
        ax.plot(range(1, len(lr_steps) + 1), lr_steps)
        ax.set_title("lr")
        ax.set_xlabel("optimizer step")
    else:
        ax.plot(epochs, [h["lr"] for h in history], marker="o")
        ax.set_title("lr (end of epoch)")
        ax.set_xlabel("epoch")
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def plot_curves(
    history: list[dict[str, float]],
    path: str | os.PathLike,
    title: str = "",
    train_label: str = "train",
    lr_steps: list[float] | None = None,
) -> None:
    """Write :func:`curves_figure` to ``path`` as a PNG."""
    fig = curves_figure(history, title, train_label, lr_steps)
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
