"""A deliberately naive, per-pixel transcription of docs/spec.md, section 1 (independent of gspn2.ops.reference).

Pure Python loops in the image frame: only for tiny inputs in tests.
"""

from __future__ import annotations

import math

import torch

# (line length axis, previous-line step) per direction, in image coordinates.
_DIRS = {
    0: dict(line="H", step=(0, -1)),  # left -> right: previous column j - 1
    1: dict(line="H", step=(0, +1)),  # right -> left: previous column j + 1
    2: dict(line="W", step=(-1, 0)),  # top -> bottom: previous row i - 1
    3: dict(line="W", step=(+1, 0)),  # bottom -> top: previous row i + 1
}


def _scan_index(d: int, i: int, j: int, H: int, W: int) -> int:
    return (j, W - 1 - j, i, H - 1 - i)[d]


def _scan_order(d: int, H: int, W: int):
    if d == 0:
        return [(i, j) for j in range(W) for i in range(H)]
    if d == 1:
        return [(i, j) for j in reversed(range(W)) for i in range(H)]
    if d == 2:
        return [(i, j) for i in range(H) for j in range(W)]
    return [(i, j) for i in reversed(range(H)) for j in range(W)]


def oracle_propagate(x, lam, gates, chunk=None):
    """Same contract as ``gspn_propagate``; float64 math on CPU."""
    x, lam, gates = (t.detach().double().cpu() for t in (x, lam, gates))
    B, C, H, W = x.shape
    K = gates.shape[3]
    G = C // K
    h = torch.zeros(B, 4, C, H, W, dtype=torch.float64)
    for d in range(4):
        line_len = H if _DIRS[d]["line"] == "H" else W
        di, dj = _DIRS[d]["step"]
        for b in range(B):
            for c in range(C):
                k = c // G
                for i, j in _scan_order(d, H, W):
                    val = lam[b, d, c, i, j].item() * x[b, c, i, j].item()
                    s = _scan_index(d, i, j, H, W)
                    restart = s == 0 or (chunk is not None and s % chunk == 0)
                    if not restart:
                        q = i if _DIRS[d]["line"] == "H" else j
                        sig = [1 / (1 + math.exp(-gates[b, d, o + 1, k, i, j].item())) for o in (-1, 0, 1)]
                        valid = [0 <= q + o < line_len for o in (-1, 0, 1)]
                        total = max(sum(a for a, v in zip(sig, valid) if v), 1e-7)
                        for o, a, v in zip((-1, 0, 1), sig, valid):
                            if not v:
                                continue
                            pi, pj = (i + o, j + dj) if _DIRS[d]["line"] == "H" else (i + di, j + o)
                            val += a / total * h[b, d, c, pi, pj].item()
                    h[b, d, c, i, j] = val
    return h
