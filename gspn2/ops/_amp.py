"""Autocast queries that ``torch.compile`` can trace, and the dtype helper the ops and layers share.

``torch.amp.is_autocast_available`` ends in a C function Dynamo does not trace (torch 2.11: a graph break in
every LayerNorm, then a recompile per channel count until the recompile limit sends the rest of the
model to eager). The device types that have autocast are looked up once at import instead, so the check
inside a compiled region is a constant set lookup.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["autocast_enabled", "autocast_off", "cast_optional"]


def _autocast_device_types() -> frozenset:
    found = set()
    for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone"):
        try:
            if torch.amp.is_autocast_available(device_type):
                found.add(device_type)
        except (RuntimeError, ValueError):  # a device type this build does not know
            pass
    return frozenset(found)


_AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False where autocast does not exist, e.g. meta)."""
    return device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """Autocast disabled for ``device_type`` (a no-op context where autocast does not exist)."""
    if device_type in _AUTOCAST_DEVICE_TYPES:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def cast_optional(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t.to(dtype)``, or None for None (an optional bias)."""
    return t.to(dtype) if t is not None else None
