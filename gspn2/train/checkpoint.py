"""Checkpoint I/O: atomic writes, integrity-checked loads that fail loudly, RNG state capture.

A checkpoint is one ``torch.save`` dict of plain containers and tensors (loadable with
``weights_only=True``)::

    format       CHECKPOINT_FORMAT
    integrity    {"sha256": digest of every other entry, tensor bytes included} (see payload_digest)
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
    mid_epoch    None after a whole epoch; in a recovery state written inside epoch ``epoch + 1``:
                 {"step": its optimizer steps done, "loss_sums": per-rank float64 sums of their losses,
                 "elapsed_s": its wall time so far}

Entries beyond these are allowed and covered by the integrity digest like the rest.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import random
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_FORMAT",
    "TIMM_EMA_KEY",
    "CheckpointError",
    "atomic_write_bytes",
    "umask_mode",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "payload_digest",
    "rng_state",
    "set_rng_state",
    "with_timm_keys",
    "Progress",
    "training_state",
    "restore_training_state",
]

CHECKPOINT_FORMAT = "gspn2-train-v2"
INTEGRITY_KEY = "integrity"
#: Where timm's loaders look for EMA weights (``timm.models.load_state_dict``); ``model`` is where they find
#: the plain weights, so no alias is needed for those.
TIMM_EMA_KEY = "state_dict_ema"
_REQUIRED = ("format", "model", "model_name", "epoch", "step", "config")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model."""


def umask_mode(base: int = 0o666) -> int:
    """``base`` less the process's umask: the mode ``open()`` would give a new file (``0o777`` for a
    folder). mkstemp/mkdtemp create 0600/0700 whatever the umask; their results are set to this."""
    try:  # Linux: read it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return base & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def _atomic_replace(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it over ``path``.

    A crash at any point leaves either the old file or the new one, never a truncated mix.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, umask_mode())  # readable as the user's umask says, like any other tool's files
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


def _feed(h, obj: Any, where: str) -> None:
    """Feed one value into ``h`` in a self-delimiting encoding (type tag, length, content), so two
    different payloads can not produce the same byte stream."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise TypeError(f"checkpoint entry {where}: {obj.layout} tensors are not supported")
        t = obj.detach().resolve_conj().resolve_neg().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):  # dict and OrderedDict: pickling keeps the insertion order
        h.update(f"D{len(obj)}|".encode())
        for key, value in obj.items():
            _feed(h, key, f"{where}[{key!r}] (key)")
            _feed(h, value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):  # torch.Size too
        h.update(f"L{len(obj)}|".encode())
        for i, value in enumerate(obj):
            _feed(h, value, f"{where}[{i}]")
    elif obj is None or isinstance(obj, (bool, int, float)):
        h.update(f"{type(obj).__name__[0]}{obj!r}|".encode())  # repr round-trips floats exactly
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(f"s{len(data)}|".encode() + data)
    elif isinstance(obj, bytes):
        h.update(f"y{len(obj)}|".encode() + obj)
    else:
        raise TypeError(
            f"checkpoint entry {where} is a {type(obj).__name__}; checkpoints hold tensors, dicts, "
            f"lists, tuples, str, bytes, int, float, bool and None only"
        )


def payload_digest(state: dict[str, Any]) -> str:
    """SHA-256 over every entry of ``state`` except ``integrity``: keys, structure, scalars, and the
    dtype, shape and raw bytes of every tensor. Whatever entries a checkpoint has are covered."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != INTEGRITY_KEY}, "state")
    return h.hexdigest()


def with_timm_keys(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` plus ``state_dict_ema`` = ``state["ema"]`` when there is an EMA (the same dict object, so
    ``torch.save`` stores its tensors once); unchanged otherwise."""
    if state.get("ema") is None:
        return state
    return {**state, TIMM_EMA_KEY: state["ema"]}


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` atomically to ``path``, with timm's EMA key and the integrity digest of its payload."""
    state = with_timm_keys(state)
    sealed = {**state, INTEGRITY_KEY: {"sha256": payload_digest(state)}}
    _atomic_replace(Path(path), lambda f: torch.save(sealed, f))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a train.py checkpoint on the CPU and verify its integrity digest.

    :class:`CheckpointError` names the path on any problem: missing, unreadable, not a checkpoint, or
    contents that differ from what was saved (one altered tensor byte is enough).
    """
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
    if isinstance(state, dict) and state.get("format") == "gspn2-train-v1":
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format 'gspn2-train-v1', which carries no integrity digest, "
            f"so its contents can not be verified; this trainer reads {CHECKPOINT_FORMAT!r} checkpoints"
        )
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a gspn2 training checkpoint (expected format {CHECKPOINT_FORMAT!r})"
        )
    stored = state.get(INTEGRITY_KEY)
    if not isinstance(stored, dict) or not isinstance(stored.get("sha256"), str):
        raise CheckpointError(
            f"checkpoint {str(path)!r} lacks its integrity digest (entry {INTEGRITY_KEY!r})"
        )
    try:
        actual = payload_digest(state)
    except TypeError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} fails its integrity check: {e}") from e
    if actual != stored["sha256"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} fails its integrity check: its contents hash to sha256 "
            f"{actual[:16]}..., not to the {stored['sha256'][:16]}... recorded when it was saved, so the "
            f"file was altered or damaged after it was written; it was not used"
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


# ---------------------------------------------------------------------------------- training state
@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint and restored on resume."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps completed
    best_top1: float = -math.inf
    best_epoch: int = 0
    history: list = field(default_factory=list)  # one record per completed epoch
    lr_steps: list = field(default_factory=list)  # the lr of every optimizer step, for curves.png
    wandb_id: str | None = None


def training_state(
    parts,
    progress: Progress,
    *,
    model_name: str,
    classes: list[str],
    rng: list,
    config: dict,
    mid_epoch: dict | None = None,
) -> dict[str, Any]:
    """The resumable state of a run (the layout of this module's docstring).

    ``parts`` holds ``model``, ``ema`` (or None), ``optimizer``, ``scheduler`` and ``scaler``
    (:class:`gspn2.train.build.TrainParts`); ``rng`` has one :func:`rng_state` per rank; ``mid_epoch``
    is the position inside an unfinished epoch (None at an epoch's end).
    """
    ema = parts.ema
    return {
        "format": CHECKPOINT_FORMAT,
        "model": parts.model.state_dict(),
        "model_name": model_name,
        "classes": classes,  # class folder names, for eval.py predict=
        "ema": ema.module.state_dict() if ema is not None else None,
        "ema_updates": progress.step if ema is not None else 0,
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
        "epoch": progress.epoch,
        "step": progress.step,
        "best_top1": progress.best_top1,
        "best_epoch": progress.best_epoch,
        "history": progress.history,
        "rng": rng,
        "config": config,
        "wandb_id": progress.wandb_id,
        "lr_steps": torch.tensor(progress.lr_steps, dtype=torch.float64),
        "mid_epoch": mid_epoch,
    }


def restore_training_state(
    state: dict[str, Any],
    path: str | os.PathLike,
    parts,
    *,
    optim_name: str,
    fresh_optimizer: bool,
    step_on_epochs: bool,
) -> Progress:
    """Load a :func:`training_state` into ``parts`` and return its :class:`Progress`.

    The weights and the EMA always; the optimizer's moments and the scaler unless ``fresh_optimizer``
    (then this run's optimizer starts anew). The optimizer's hyperparameters (weight decay, betas, ...)
    and the schedule stay this run's: the schedule is evaluated where the checkpoint stopped. Raises
    :class:`CheckpointError` naming ``path`` when the state does not fit.
    """
    old_optim = state["config"].get("optim", {}).get("name")
    if old_optim != optim_name and not fresh_optimizer:
        raise CheckpointError(
            f"{path} was trained with optim={old_optim}, this run asks for optim={optim_name}: "
            f"add trainer.no_resume_opt=true to keep the weights and start a fresh {optim_name} state"
        )
    load_model_state(parts.model, state["model"], path)
    if parts.ema is not None:
        if state.get("ema") is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no EMA weights; resume with "
                f"ema.enabled=false or start a new run"
            )
        load_model_state(parts.ema.module, state["ema"], path, what="EMA")
    optimizer = parts.optimizer
    if not fresh_optimizer:
        own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"the optimizer state in {str(path)!r} does not fit optim={optim_name} "
                f"({e}); add trainer.no_resume_opt=true to start a fresh optimizer state"
            ) from e
        for group, hyper in zip(optimizer.param_groups, own):
            group.update(hyper)
        if state.get("scaler"):
            parts.scaler.load_state_dict(state["scaler"])
    progress = Progress(
        epoch=state["epoch"],
        step=state["step"],
        best_top1=state["best_top1"],
        best_epoch=state["best_epoch"],
        history=state["history"],
        lr_steps=state["lr_steps"].tolist() if "lr_steps" in state else [],
        wandb_id=state.get("wandb_id"),
    )
    if step_on_epochs:
        parts.scheduler.step(progress.epoch)
    else:
        parts.scheduler.step_update(num_updates=progress.step)
    return progress
