"""Checkpoint I/O: atomic writes, loads that fail loudly, RNG state capture.

A checkpoint is one ``torch.save`` dict of plain containers and tensors (loadable with
``weights_only=True``)::

    format       CHECKPOINT_FORMAT
    model        model state dict (unwrapped: no DDP/compile prefixes)
    model_name   timm name the model was built from
    ema          EMA model state dict or None;  ema_updates: optimizer steps the EMA has seen
    state_dict_ema   the same EMA dict (stored once), present when ``ema`` is: the key timm's loaders read
                 (``timm.models.load_checkpoint(..., use_ema=True)``, ``validate.py --use-ema``)
    optimizer, scheduler, scaler     their state dicts (scaler None without fp16)
    epoch        epochs completed;  step: optimizer steps completed
    best_top1, best_epoch, history   per-epoch metrics so far
    rng          one entry per rank: python, numpy, torch, cuda generator states
    config       the resolved training config (dict)
    wandb_id     the W&B run id, so a resumed run appends to the same W&B run
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_FORMAT",
    "TIMM_EMA_KEY",
    "CheckpointError",
    "atomic_write_bytes",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "rng_state",
    "set_rng_state",
    "with_timm_keys",
]

CHECKPOINT_FORMAT = "gspn2-train-v1"
#: Where timm's loaders look for EMA weights (``timm.models.load_state_dict``); ``model`` is where they find
#: the plain weights, so no alias is needed for those.
TIMM_EMA_KEY = "state_dict_ema"
_REQUIRED = ("format", "model", "model_name", "epoch", "step", "config")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model."""


def _atomic_replace(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it over ``path``.

    A crash at any point leaves either the old file or the new one, never a truncated mix.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_replace(Path(path), lambda f: f.write(data))


def with_timm_keys(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` plus ``state_dict_ema`` = ``state["ema"]`` when there is an EMA (the same dict object, so
    ``torch.save`` stores its tensors once); unchanged otherwise."""
    if state.get("ema") is None:
        return state
    return {**state, TIMM_EMA_KEY: state["ema"]}


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    state = with_timm_keys(state)
    _atomic_replace(Path(path), lambda f: torch.save(state, f))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a train.py checkpoint on the CPU; :class:`CheckpointError` names the path on any problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or corrupt and cannot be read "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a gspn2 training checkpoint (expected format {CHECKPOINT_FORMAT!r})"
        )
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks the entries {missing}")
    return state


def _describe(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return f"{len(keys)} ({shown}{', ...' if len(keys) > limit else ''})"


def load_model_state(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], path: str | os.PathLike, what: str = "model"
) -> None:
    """Strictly load ``state_dict`` into ``model``; a mismatch raises naming the checkpoint and the keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    wrong_shape = [
        f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing keys: {_describe(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_describe(unexpected)}")
        if wrong_shape:
            parts.append(f"shape mismatches (checkpoint vs model): {_describe(wrong_shape)}")
        raise CheckpointError(
            f"the {what} weights in {str(path)!r} do not fit {type(model).__name__}: " + "; ".join(parts)
        )
    model.load_state_dict(state_dict, strict=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generator states, as containers that ``weights_only`` loading accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
