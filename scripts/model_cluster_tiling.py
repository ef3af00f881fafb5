"""A PyTorch model of the planned cluster kernel's "trapezoid" tiling for horizontal scans.

``docs/kernel.md`` ("Next steps", item 1): a horizontal line of L pixels is split over several CTAs of a
thread-block cluster, ``rows`` line positions each. The scan walks S steps in tiles of ``T``. At a tile
start each CTA holds the previous step's values of its own rows and reads the neighbours' values for
``halo`` extra rows on either side (distributed shared memory, after one cluster barrier); then it runs
the T steps of the tile on its own rows plus the halo rows, with no communication. The values next to
the extended region are unknown inside the tile: a row's value at step s depends on rows within
``s - s0 + 1`` positions at the tile start, so a halo of T rows keeps every own row exact. This model
computes exactly that, with the unknown values set to NaN, so a tiling that reads anything it should not
poisons the result instead of silently matching.

It runs the canonical-frame scan of ``gspn2.ops.reference`` (``_scan_canonical``: lines along dim -2,
scan steps along dim -1) and the backward's reverse scan of the adjoint (``tiled_adjoint``, checked
against ``gspn_propagate_backward_ref``), and is the index-level specification for the CUDA kernel: halo rows clamped at
the image edges (where the boundary-aware weights are exactly zero), chunk restarts inside tiles, a last
tile shorter than T, a last CTA with fewer rows.

    python scripts/model_cluster_tiling.py           # checks a grid of shapes against the reference
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch

from gspn2.ops.reference import _scan_canonical, gspn_propagate_backward_ref, normalize_gates


def _check_tiling(rows: int, T: int, halo: int) -> None:
    for name, v in (("rows", rows), ("T", T)):
        if v < 1:
            raise ValueError(f"`{name}` must be >= 1, got {v}")
    if halo < 0:
        raise ValueError(f"`halo` must be >= 0, got {halo}")


def tiled_scan(
    x: torch.Tensor, lam: torch.Tensor, w: torch.Tensor, chunk: int | None, rows: int, T: int, halo: int
) -> torch.Tensor:
    """The forward scan as the cluster kernel would compute it.

    Args:
        x, lam: ``(..., L, S)`` canonical frame.
        w: ``(3, ..., L, S)`` normalised weights of neighbour offsets -1, 0, +1.
        chunk: ``None`` or the restart period in steps (as the operator's ``chunk``).
        rows: line positions owned by one CTA (the last CTA may own fewer).
        T: scan steps per tile (between two exchanges).
        halo: extra rows each CTA computes on either side (the plan: ``halo = T``).
    Returns:
        ``h`` of shape ``(..., L, S)``; NaN where the tiling used a value it did not have.
    """
    _check_tiling(rows, T, halo)
    L, S = x.shape[-2], x.shape[-1]
    u = lam * x
    h = torch.full_like(u, float("nan"))
    for s0 in range(0, S, T):
        tile = {}
        for r0 in range(0, L, rows):
            r1 = min(r0 + rows, L)
            lo, hi = max(r0 - halo, 0), min(r1 + halo, L)  # the extended region, clamped at the edges
            # neighbours of the extended region: zero at an image edge, unknown (NaN) at a CTA boundary
            pad_lo = u.new_zeros(u.shape[:-2]) if lo == 0 else u.new_full(u.shape[:-2], float("nan"))
            pad_hi = u.new_zeros(u.shape[:-2]) if hi == L else u.new_full(u.shape[:-2], float("nan"))
            prev = h[..., lo:hi, s0 - 1] if s0 > 0 else None  # own rows of every CTA, exchanged
            out = []
            for s in range(s0, min(s0 + T, S)):
                if prev is None or (chunk is not None and s % chunk == 0):
                    cur = u[..., lo:hi, s]
                else:
                    up = torch.cat([pad_lo[..., None], prev[..., :-1]], dim=-1)
                    down = torch.cat([prev[..., 1:], pad_hi[..., None]], dim=-1)
                    cur = u[..., lo:hi, s] + w[0, ..., lo:hi, s] * up + w[1, ..., lo:hi, s] * prev
                    cur = cur + w[2, ..., lo:hi, s] * down
                out.append(cur[..., r0 - lo : r1 - lo])  # only own rows leave the CTA
                prev = cur
            tile[(r0, r1)] = torch.stack(out, dim=-1)
        for (r0, r1), values in tile.items():  # written after the whole tile: no CTA sees another's
            h[..., r0:r1, s0 : s0 + values.shape[-1]] = values  # results of this tile early
    return h


def tiled_adjoint(
    grad_h: torch.Tensor, w: torch.Tensor, chunk: int | None, rows: int, T: int, halo: int
) -> torch.Tensor:
    """The backward's reverse scan (the adjoint of every step) as the cluster kernel would compute it.

    ``a_s(q) = grad_h_s(q) + sum_o w_o[s+1](q - o) a_{s+1}(q - o)`` (nothing from step s + 1 when it starts a
    chunk), walked from the last step down in tiles of T steps. At a tile start each CTA reads the
    adjoint of the step after the tile for its extended rows and one row beyond (the neighbours' own rows,
    exchanged); inside the tile it computes alone, unknown values beyond the extended region being NaN.
    Because the tile start already covers one row beyond the extended region, ``halo = T - 1`` is exact
    here (the forward, which exchanges only the extended rows, needs ``halo = T``): either way T rows per
    side cross the cluster at each tile start.
    The gate gradients also need ``h_{s-1}`` at ``q - 1, q, q + 1``: the saved forward output, read from
    global memory for any row, so it needs no exchange and is not modelled.

    Args:
        grad_h: ``(..., L, S)`` canonical frame; ``w``: ``(3, ..., L, S)``; the rest as :func:`tiled_scan`.
    Returns:
        the adjoint ``(..., L, S)``; NaN where the tiling used a value it did not have.
    """
    _check_tiling(rows, T, halo)
    L, S = grad_h.shape[-2], grad_h.shape[-1]
    adj = torch.full_like(grad_h, float("nan"))

    def starts(s: int) -> bool:
        return s == 0 or (chunk is not None and s % chunk == 0)

    def scatter(t0, t1, t2, pad_lo, pad_hi):
        # prev(q') receives w_o[s](q) * a_s(q) from q = q' - o: t1(q') + t0(q' + 1) + t2(q' - 1)
        return t1 + torch.cat([t0[..., 1:], pad_hi[..., None]], -1) + torch.cat([pad_lo[..., None], t2[..., :-1]], -1)

    for s1 in range(S - 1, -1, -T):  # the tile is steps s1, s1 - 1, ..., s1 - T + 1
        tile = {}
        for r0 in range(0, L, rows):
            r1 = min(r0 + rows, L)
            lo, hi = max(r0 - halo, 0), min(r1 + halo, L)
            nan = grad_h.new_full(grad_h.shape[:-2], float("nan"))
            zero = grad_h.new_zeros(grad_h.shape[:-2])
            pad_lo, pad_hi = (zero if lo == 0 else nan), (zero if hi == L else nan)
            nxt = None
            if s1 + 1 < S and not starts(s1 + 1):
                # the exchange: a_{s1+1} on [lo - 1, hi + 1), zero beyond the image (all CTAs' own rows)
                elo, ehi = max(lo - 1, 0), min(hi + 1, L)
                a = adj[..., elo:ehi, s1 + 1]
                t = [w[k, ..., elo:ehi, s1 + 1] * a for k in range(3)]
                full = scatter(*t, zero, zero)  # rows elo..ehi-1; their outer neighbours are outside the image
                nxt = full[..., lo - elo : lo - elo + (hi - lo)]
            out = []
            for s in range(s1, max(s1 - T, -1), -1):
                cur = grad_h[..., lo:hi, s] if nxt is None else grad_h[..., lo:hi, s] + nxt
                out.append(cur[..., r0 - lo : r1 - lo])
                if starts(s):
                    nxt = None
                    continue
                nxt = scatter(*(w[k, ..., lo:hi, s] * cur for k in range(3)), pad_lo, pad_hi)
            tile[(r0, r1)] = torch.stack(out[::-1], dim=-1)
        for (r0, r1), values in tile.items():
            n = values.shape[-1]
            adj[..., r0:r1, s1 - n + 1 : s1 + 1] = values
    return adj


def reference_adjoint(grad_h, w_logits, chunk):
    """The adjoint from ``gspn_propagate_backward_ref``: direction 0 is the canonical frame itself and,
    with x = 1, ``grad_lam = x * adjoint`` is the adjoint exactly. ``w_logits``: ``(B, 3, L, S)``."""
    B, L, S = grad_h.shape
    gates = torch.zeros(B, 4, 3, 1, L, S, dtype=grad_h.dtype)
    gates[:, 0, :, 0] = w_logits
    x = torch.ones(B, 1, L, S, dtype=grad_h.dtype)
    lam = torch.ones(B, 4, 1, L, S, dtype=grad_h.dtype)
    gh = torch.zeros(B, 4, 1, L, S, dtype=grad_h.dtype)
    gh[:, 0, 0] = grad_h
    h = torch.zeros_like(gh)  # only the gate gradients read h
    _, grad_lam, _ = gspn_propagate_backward_ref(gh, x, lam, gates, h, chunk)
    return grad_lam[:, 0, 0]


def random_logits(B: int, L: int, S: int, seed: int = 0) -> torch.Tensor:
    """Raw gate logits ``(B, 3, L, S)`` in float64 (for :func:`weights` and :func:`reference_adjoint`)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(B, 3, L, S, generator=g, dtype=torch.float64)


def weights(logits: torch.Tensor) -> torch.Tensor:
    """Normalised weights ``(3, B, L, S)`` of raw logits ``(B, 3, L, S)``."""
    return normalize_gates(logits[:, :, None])[:, :, 0].transpose(0, 1)


def random_problem(B: int, L: int, S: int, seed: int = 0):
    """Canonical-frame inputs in float64: x, lam ``(B, L, S)`` and normalised w ``(3, B, L, S)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, S, generator=g, dtype=torch.float64)
    lam = torch.rand(B, L, S, generator=g, dtype=torch.float64)
    return x, lam, weights(torch.randn(B, 3, L, S, generator=g, dtype=torch.float64))


def reference(x, lam, w, chunk):
    # _scan_canonical wants (B, K, G, L, S) inputs and (B, 3, K, 1, L, S) weights
    h = _scan_canonical(x[:, None, None], lam[:, None, None], w.transpose(0, 1)[:, :, None, None], chunk)
    return h[:, 0, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    worst, cases = 0.0, 0
    for L, S, rows, T, chunk in itertools.product((1, 7, 16, 33), (1, 5, 16, 21), (4, 5, 16), (1, 3, 4, 8),
                                                  (None, 3, 7)):
        x, lam, w = random_problem(2, L, S, args.seed)
        logits = random_logits(2, L, S, args.seed)
        errors = (
            (tiled_scan(x, lam, w, chunk, rows, T, halo=T) - reference(x, lam, w, chunk)).abs().max().item(),
            (tiled_adjoint(x, weights(logits), chunk, rows, T, halo=T) - reference_adjoint(x, logits, chunk))
            .abs().max().item(),
        )
        err = max(errors) if not any(math.isnan(e) for e in errors) else float("nan")
        worst = max(worst, err) if not math.isnan(err) else err
        cases += 1
        if not err <= 1e-12:
            print(f"MISMATCH L={L} S={S} rows={rows} T={T} chunk={chunk}: max error {err}")
            return 1
    print(f"{cases} cases: forward and adjoint tiled with halo = T match the reference (max error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
