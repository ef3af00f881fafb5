"""Fine-tuning: start a model from another run's weights (timm's ``--initial-checkpoint``).

The file may be a train.py checkpoint (its model or EMA weights), or a timm/Hugging Face-style weight file:
a ``torch.save``\\ d state dict, possibly wrapped as ``{"state_dict": ...}``, ``{"model": ...}`` or
``{"state_dict_ema": ...}``, or a ``.safetensors`` file. Weights of the classifier whose shape differs
(another number of classes) are left at the new model's initialisation; any other shape mismatch is an
error, and missing and unexpected keys are reported.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch
import torch.nn as nn

from gspn2.train.checkpoint import CHECKPOINT_FORMAT, CheckpointError, load_checkpoint

__all__ = ["load_initial_weights", "read_weights"]

_WRAPPERS = ("state_dict", "model", "module")
_EMA_WRAPPERS = ("state_dict_ema", "model_ema", "ema")


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # DDP ("module.") and torch.compile ("_orig_mod.") wrappers prefix every key
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def read_weights(path: str | os.PathLike, use_ema: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict a weight file holds, and a description of where in the file it came from."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"initial checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        if use_ema:
            raise CheckpointError(f"{str(path)!r} is a safetensors weight file: it holds no EMA weights")
        return _strip_prefixes(load_file(str(path))), "safetensors weights"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"initial checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e
    if isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT:
        ckpt = load_checkpoint(path)  # the train.py format, with its own checks
        if use_ema:
            if ckpt.get("ema") is None:
                raise CheckpointError(f"initial_checkpoint_ema=true but {str(path)!r} holds no EMA weights")
            return ckpt["ema"], f"EMA weights of a {ckpt['model_name']} checkpoint (epoch {ckpt['epoch']})"
        return ckpt["model"], f"model weights of a {ckpt['model_name']} checkpoint (epoch {ckpt['epoch']})"
    if not isinstance(obj, dict):
        raise CheckpointError(f"initial checkpoint {str(path)!r} holds a {type(obj).__name__}, not a state dict")
    for key in _EMA_WRAPPERS if use_ema else _WRAPPERS:
        if isinstance(obj.get(key), dict):
            return _strip_prefixes(obj[key]), f"the {key!r} entry"
    if use_ema:
        raise CheckpointError(
            f"initial_checkpoint_ema=true but {str(path)!r} has none of the entries {list(_EMA_WRAPPERS)}"
        )
    if not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(
            f"initial checkpoint {str(path)!r} is neither a train.py checkpoint nor a state dict "
            f"(top-level keys: {sorted(obj)[:8]})"
        )
    return _strip_prefixes(obj), "state dict"


def _classifier_keys(model: nn.Module) -> set[str]:
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return set()
    ids = {id(t) for t in (*head.parameters(), *head.buffers())}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in ids}


def _short(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_initial_weights(model: nn.Module, path: str | os.PathLike, use_ema: bool = False) -> dict:
    """Load the weights of ``path`` into ``model`` for fine-tuning; returns a report.

    The classifier (``model.get_classifier()``) keeps its fresh initialisation where the file's shapes
    differ; every other weight of the model must be in the file with its shape, or the load is refused.

    Returns:
        ``{"source", "loaded", "reinitialised", "missing", "unexpected"}`` (lists of keys).
    """
    state, source = read_weights(path, use_ema)
    own = model.state_dict()
    head = _classifier_keys(model)
    reinit = sorted(k for k in head if k in state and tuple(state[k].shape) != tuple(own[k].shape))
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and k not in head and tuple(state[k].shape) != tuple(own[k].shape)
    )
    loaded = [k for k in own if k in state and k not in reinit and not any(w.startswith(k + " ") for w in wrong)]
    if wrong:
        raise CheckpointError(
            f"initial checkpoint {str(path)!r} does not fit {type(model).__name__} outside its classifier: "
            f"shape mismatches (file vs model): {_short(wrong)}"
        )
    missing_body = [k for k in missing if k not in head]
    if missing_body:
        raise CheckpointError(
            f"initial checkpoint {str(path)!r} lacks {len(missing_body)} weights of "
            f"{type(model).__name__} outside its classifier: {_short(missing_body)}"
        )
    model.load_state_dict({k: state[k] for k in loaded}, strict=False)
    return {
        "source": f"{path} ({source})",
        "loaded": loaded,
        "reinitialised": reinit,
        "missing": missing,
        "unexpected": unexpected,
    }
