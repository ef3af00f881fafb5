"""Input validation for :func:`gspn2.ops.gspn_propagate`: fail early, name the argument and the shape."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_propagate_inputs(
    x: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor, chunk: int | None
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending argument; return ``None`` if all is well."""
    for name, t in (("x", x), ("lam", lam), ("gates", gates)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gspn_propagate: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"gspn_propagate: `{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
    if x.dim() != 4:
        raise ValueError(f"gspn_propagate: `x` must have shape (B, C, H, W), got {tuple(x.shape)}")
    B, C, H, W = x.shape
    if B < 1 or C < 1 or H < 1 or W < 1:  # one size at a time: min() would compare B with C
        raise ValueError(f"gspn_propagate: `x` must have no empty dimension, got {tuple(x.shape)}")
    if lam.dim() != 5 or tuple(lam.shape) != (B, 4, C, H, W):
        raise ValueError(
            f"gspn_propagate: `lam` must have shape (B, 4, C, H, W) = {(B, 4, C, H, W)}, "
            f"got {tuple(lam.shape)}"
        )
    if gates.dim() != 6:
        raise ValueError(
            f"gspn_propagate: `gates` must have shape (B, 4, 3, K, H, W), got {tuple(gates.shape)}"
        )
    K = gates.shape[3]
    if K < 1 or C % K != 0:
        raise ValueError(
            f"gspn_propagate: `gates` has K = {K} affinity groups (dim 3), which must divide C = {C}"
        )
    if tuple(gates.shape) != (B, 4, 3, K, H, W):
        raise ValueError(
            f"gspn_propagate: `gates` must have shape (B, 4, 3, K, H, W) = {(B, 4, 3, K, H, W)}, "
            f"got {tuple(gates.shape)}"
        )
    if lam.dtype != x.dtype or gates.dtype != x.dtype:
        raise TypeError(
            "gspn_propagate: `x`, `lam` and `gates` must share one dtype, got "
            f"x={x.dtype}, lam={lam.dtype}, gates={gates.dtype}"
        )
    if lam.device != x.device or gates.device != x.device:
        raise ValueError(
            "gspn_propagate: `x`, `lam` and `gates` must be on one device, got "
            f"x={x.device}, lam={lam.device}, gates={gates.device}"
        )
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int):
            raise TypeError(f"gspn_propagate: `chunk` must be None or an int, got {type(chunk).__name__}")
        if chunk < 1:
            raise ValueError(f"gspn_propagate: `chunk` must be None or >= 1, got {chunk}")
