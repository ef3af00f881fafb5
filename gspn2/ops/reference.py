"""Pure-PyTorch reference of the GSPN-2 propagation operator: the specification in code.

Everything here is plain differentiable PyTorch, vectorised over batch, channels and the line; the only
Python loop runs over scan steps. It serves three purposes:

* it defines the semantics (``docs/spec.md``, "The propagation operator") that every other backend must match;
* it is the CPU implementation of the ``gspn2::propagate`` custom op;
* :func:`gspn_propagate_backward_ref` is the explicit reverse scan (the adjoint recurrence) that the
  custom op uses for its backward on CPU, and that the CUDA kernel's backward is checked against.

Directions, all in the image frame (``d`` indexes dim 1 of ``lam``, ``gates`` and the output):

====  ===============  ==============  ====================
d     scan             line            previous line of (i, j)
====  ===============  ==============  ====================
0     left -> right    a column (H)    column j - 1
1     right -> left    a column (H)    column j + 1
2     top -> bottom    a row (W)       row i - 1
3     bottom -> top    a row (W)       row i + 1
====  ===============  ==============  ====================

Internally each direction is mapped to a *canonical frame* ``(..., L, S)``: ``L`` is the line axis
(positions ``q``), ``S`` the scan axis walked from step 0 upwards. Direction 0 is the identity,
direction 1 flips W, direction 2 transposes H and W, direction 3 transposes and flips.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "NORM_EPS",
    "normalize_gates",
    "gspn_propagate_ref",
    "gspn_propagate_backward_ref",
]

#: Lower bound of the normaliser ``sum of valid sigmoid(gates)`` (docs/spec.md, "The propagation operator").
NORM_EPS = 1e-7


def _to_canonical(t: torch.Tensor, d: int) -> torch.Tensor:
    """Image frame ``(..., H, W)`` -> canonical frame ``(..., L, S)`` of direction ``d``."""
    if d == 0:
        return t
    if d == 1:
        return t.flip(-1)
    if d == 2:
        return t.transpose(-1, -2)
    return t.transpose(-1, -2).flip(-1)


def _from_canonical(t: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`_to_canonical`."""
    if d == 0:
        return t
    if d == 1:
        return t.flip(-1)
    if d == 2:
        return t.transpose(-1, -2)
    return t.flip(-1).transpose(-1, -2)


def _valid_mask(L: int, device: torch.device) -> torch.Tensor:
    """``(3, L, 1)`` bool mask: neighbour offset ``o = k - 1`` of line position ``q`` is inside the line.

    Used with ``torch.where``, not as a factor, so that a non-finite logit of a neighbour outside the line
    (which the normalisation ignores) cannot leak in as ``nan * 0``.
    """
    q = torch.arange(L, device=device)
    offsets = torch.arange(-1, 2, device=device)
    inside = (q[None, :] + offsets[:, None] >= 0) & (q[None, :] + offsets[:, None] < L)
    return inside[:, :, None]


def normalize_gates(gates: torch.Tensor, line_dim: int = -2) -> torch.Tensor:
    """Turn raw gate logits into row-stochastic tridiagonal weights.

    Args:
        gates: ``(..., 3, K, L, S)`` logits in a canonical frame; dim ``-4`` is the offset index
            ``k`` (neighbour ``o = k - 1``), ``line_dim`` the line axis.
    Returns:
        ``w`` of the same shape: ``w_k = m_k * sigmoid(g_k) / max(sum_k' m_k' * sigmoid(g_k'), eps)``
        with ``m_k`` the mask of neighbours inside the line.
    """
    assert line_dim == -2, "canonical frame puts the line axis at dim -2"
    a = torch.where(_valid_mask(gates.shape[-2], gates.device)[:, None], torch.sigmoid(gates), 0.0)
    return a / torch.clamp_min(a.sum(dim=-4, keepdim=True), NORM_EPS)


def _shift_prev(prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``prev`` of shape ``(..., L)`` return ``prev(q - 1)`` and ``prev(q + 1)`` (zero outside)."""
    return F.pad(prev[..., :-1], (1, 0)), F.pad(prev[..., 1:], (0, 1))


def _scan_canonical(
    x: torch.Tensor, lam: torch.Tensor, w: torch.Tensor, chunk: int | None
) -> torch.Tensor:
    """Forward scan in the canonical frame.

    Args:
        x:   ``(B, K, G, L, S)`` with ``G = C // K`` channels per affinity group.
        lam: ``(B, K, G, L, S)``.
        w:   ``(B, 3, K, 1, L, S)`` normalised weights (broadcast over the ``G`` channels of a group).
    Returns:
        ``h`` of shape ``(B, K, G, L, S)``.
    """
    S = x.shape[-1]
    u = lam * x
    outs = []
    prev = None
    for s in range(S):
        if prev is None or (chunk is not None and s % chunk == 0):
            cur = u[..., s]
        else:
            up, down = _shift_prev(prev)
            cur = u[..., s] + w[:, 0, ..., s] * up + w[:, 1, ..., s] * prev + w[:, 2, ..., s] * down
        outs.append(cur)
        prev = cur
    return torch.stack(outs, dim=-1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def gspn_propagate_ref(
    x: torch.Tensor,
    lam: torch.Tensor,
    gates: torch.Tensor,
    chunk: int | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference GSPN propagation over four directions (differentiable, no input checks).

    Args:
        x: ``(B, C, H, W)`` features to propagate.
        lam: ``(B, 4, C, H, W)`` input gate per direction, channel and pixel.
        gates: ``(B, 4, 3, K, H, W)`` raw gate logits; ``C % K == 0``, channel ``c`` uses group
            ``c // (C // K)``; index 0/1/2 of dim 2 weights neighbour offset -1/0/+1.
        chunk: ``None`` for one scan over the whole image, else the scan restarts (``prev = 0``)
            every ``chunk`` steps counted from each direction's starting edge.
        upcast: compute bf16/fp16 inputs in fp32 (the operator's contract). ``False`` computes in the
            input dtype, which is the "same computation at that precision" used as an error yardstick.
    Returns:
        ``h`` of shape ``(B, 4, C, H, W)`` in the dtype of ``x``, in the image frame.
    """
    B, C, H, W = x.shape
    K = gates.shape[3]
    out_dtype = x.dtype
    if upcast:
        ct = _compute_dtype(x.dtype)
        x, lam, gates = x.to(ct), lam.to(ct), gates.to(ct)
    xg = x.reshape(B, K, C // K, H, W)
    lamg = lam.reshape(B, 4, K, C // K, H, W)
    outs = []
    for d in range(4):
        w = normalize_gates(_to_canonical(gates[:, d], d)).unsqueeze(3)  # (B, 3, K, 1, L, S)
        h = _scan_canonical(_to_canonical(xg, d), _to_canonical(lamg[:, d], d), w, chunk)
        outs.append(_from_canonical(h, d).reshape(B, C, H, W))
    return torch.stack(outs, dim=1).to(out_dtype)


def gspn_propagate_backward_ref(
    grad_h: torch.Tensor,
    x: torch.Tensor,
    lam: torch.Tensor,
    gates: torch.Tensor,
    h: torch.Tensor,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit reverse scan: gradients of :func:`gspn_propagate_ref` without autograd.

    With ``a_s`` the adjoint of the hidden state at scan step ``s`` (canonical frame)::

        a_s(q)   = grad_h_s(q) + sum_o w_o[s+1](q - o) * a_{s+1}(q - o)   (0 if s+1 starts a chunk)
        grad_x   = sum_d lam_d * a_d          grad_lam_d = x * a_d
        grad_w_o[s](q) = sum_{c in group} a_s(q) * h_{s-1}(q + o)        (0 on a step with prev = 0)

    and the gate-logit gradient goes through the normalisation ``w = m * sigmoid(g) / max(sum, eps)``.

    Args:
        grad_h: ``(B, 4, C, H, W)`` gradient of the output.
        x, lam, gates, chunk: the forward inputs (see :func:`gspn_propagate_ref`).
        h: ``(B, 4, C, H, W)`` the forward output.
    Returns:
        ``(grad_x, grad_lam, grad_gates)`` shaped and typed like ``x``, ``lam`` and ``gates``.
    """
    B, C, H, W = x.shape
    K = gates.shape[3]
    G = C // K
    dtypes = (x.dtype, lam.dtype, gates.dtype)
    ct = _compute_dtype(x.dtype)
    grad_h, x, lam, gates, h = (t.to(ct) for t in (grad_h, x, lam, gates, h))
    xg = x.reshape(B, K, G, H, W)
    grad_x = torch.zeros(B, K, G, H, W, dtype=ct, device=x.device)
    grad_lam = torch.empty(B, 4, K, G, H, W, dtype=ct, device=x.device)
    grad_gates = torch.empty(gates.shape, dtype=ct, device=x.device)  # contiguous, as the fake says
    for d in range(4):
        gd = _to_canonical(gates[:, d], d)  # (B, 3, K, L, S)
        sig = torch.sigmoid(gd)
        mask = _valid_mask(gd.shape[-2], gd.device)[:, None]
        a = torch.where(mask, sig, 0.0)
        total = a.sum(dim=1, keepdim=True)
        denom = torch.clamp_min(total, NORM_EPS)
        w = (a / denom).unsqueeze(3)  # (B, 3, K, 1, L, S)
        gh = _to_canonical(grad_h[:, d].reshape(B, K, G, H, W), d)
        hd = _to_canonical(h[:, d].reshape(B, K, G, H, W), d)
        S = gh.shape[-1]
        adj = torch.empty_like(gh)
        gw = torch.zeros_like(w.squeeze(3))  # (B, 3, K, L, S)
        nxt = None  # adjoint of step s + 1, scattered back through the transition
        for s in range(S - 1, -1, -1):
            cur = gh[..., s] if nxt is None else gh[..., s] + nxt
            adj[..., s] = cur
            starts = s == 0 or (chunk is not None and s % chunk == 0)
            if starts:
                nxt = None
                continue
            prev = hd[..., s - 1]
            up, down = _shift_prev(prev)
            gw[:, 0, ..., s] = (cur * up).sum(dim=2)
            gw[:, 1, ..., s] = (cur * prev).sum(dim=2)
            gw[:, 2, ..., s] = (cur * down).sum(dim=2)
            # prev(q') receives w_o[s](q) * cur(q) from q = q' - o.
            t0, t1, t2 = (w[:, k, ..., s] * cur for k in range(3))
            nxt = t1 + F.pad(t0[..., 1:], (0, 1)) + F.pad(t2[..., :-1], (1, 0))
        xd = _to_canonical(xg, d)
        lamd = _to_canonical(lam[:, d].reshape(B, K, G, H, W), d)
        grad_x += _from_canonical(lamd * adj, d)
        grad_lam[:, d] = _from_canonical(xd * adj, d)
        # Through w_k = a_k / denom, denom = max(sum_k a_k, eps); a_k = m_k * sigmoid(g_k).
        dot = (gw * a).sum(dim=1, keepdim=True)
        through_sum = (total >= NORM_EPS).to(ct)
        grad_a = gw / denom - through_sum * dot / denom**2
        grad_gates[:, d] = _from_canonical(torch.where(mask, grad_a * sig * (1 - sig), 0.0), d)
    return (
        grad_x.reshape(B, C, H, W).to(dtypes[0]),
        grad_lam.reshape(B, 4, C, H, W).to(dtypes[1]),
        grad_gates.to(dtypes[2]),
    )
