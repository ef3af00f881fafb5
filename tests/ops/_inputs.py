"""Random op inputs shared by the CPU op tests."""

from __future__ import annotations

import torch


def make_inputs(B, C, H, W, K, dtype=torch.float64, seed=0, requires_grad=False):
    """``(x, lam, gates)`` of the op's shapes from a seeded generator (gates scaled to reach saturation)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g, dtype=dtype)
    lam = torch.randn(B, 4, C, H, W, generator=g, dtype=dtype)
    gates = 2 * torch.randn(B, 4, 3, K, H, W, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (x, lam, gates))
