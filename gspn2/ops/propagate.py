"""The ``gspn2::propagate`` custom op: registration, fake implementations and autograd.

Two ops live in the ``gspn2`` namespace:

* ``gspn2::propagate(x, lam, gates, chunk) -> h``
* ``gspn2::propagate_backward(grad_h, x, lam, gates, h, chunk) -> (grad_x, grad_lam, grad_gates)``

Their default implementation (every device) is the pure-PyTorch reference in
:mod:`gspn2.ops.reference`; a device backend plugs in with ``torch.library.register_kernel`` on the
same op names, so the fake and autograd registrations below stay one op for every device.
"""

from __future__ import annotations

from typing import Optional

import torch

from gspn2.ops._checks import check_propagate_inputs
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref

__all__ = ["gspn_propagate"]


@torch.library.custom_op("gspn2::propagate", mutates_args=())
def _propagate(
    x: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor, chunk: Optional[int]
) -> torch.Tensor:
    return gspn_propagate_ref(x, lam, gates, chunk)


@_propagate.register_fake
def _propagate_fake(x, lam, gates, chunk):
    B, C, H, W = x.shape
    return x.new_empty((B, 4, C, H, W))


@torch.library.custom_op("gspn2::propagate_backward", mutates_args=())
def _propagate_backward(
    grad_h: torch.Tensor,
    x: torch.Tensor,
    lam: torch.Tensor,
    gates: torch.Tensor,
    h: torch.Tensor,
    chunk: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gspn_propagate_backward_ref(grad_h, x, lam, gates, h, chunk)


@_propagate_backward.register_fake
def _propagate_backward_fake(grad_h, x, lam, gates, h, chunk):
    # Every backend returns contiguous gradients, whatever the strides of the inputs.
    return x.new_empty(x.shape), lam.new_empty(lam.shape), gates.new_empty(gates.shape)


def _setup_context(ctx, inputs, output):
    x, lam, gates, chunk = inputs
    ctx.save_for_backward(x, lam, gates, output)
    ctx.chunk = chunk


def _backward(ctx, grad_h):
    x, lam, gates, h = ctx.saved_tensors
    grad_x, grad_lam, grad_gates = torch.ops.gspn2.propagate_backward(
        grad_h.contiguous(), x, lam, gates, h, ctx.chunk
    )
    return grad_x, grad_lam, grad_gates, None


_propagate.register_autograd(_backward, setup_context=_setup_context)


def gspn_propagate(
    x: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor, chunk: Optional[int] = None
) -> torch.Tensor:
    """Four-direction GSPN line-scan propagation (SPEC section 1.1).

    For direction ``d`` and pixel ``p`` at line position ``q``::

        h_d[p] = lam_d[p] * x[p] + sum_{o in -1,0,+1} w_{d,o}[p] * prev(q + o)

    with ``w = sigmoid(gates)`` normalised over the neighbours inside the line, ``prev`` the hidden
    state of the previous line of the scan (zero on the first line and on the first line of each chunk).

    Args:
        x: ``(B, C, H, W)`` features.
        lam: ``(B, 4, C, H, W)`` input gates, one per direction (0: left->right, 1: right->left,
            2: top->bottom, 3: bottom->top).
        gates: ``(B, 4, 3, K, H, W)`` raw gate logits for neighbour offsets -1, 0, +1; ``K`` groups
            with ``C % K == 0`` (``K = 1``: one affinity shared by all channels).
        chunk: ``None`` scans the whole image; an int restarts the scan every ``chunk`` steps, counted
            from each direction's starting edge.
    Returns:
        ``(B, 4, C, H, W)`` hidden states of all four directions in the image frame, dtype of ``x``.
    Raises:
        TypeError / ValueError naming the argument on bad input.
    """
    check_propagate_inputs(x, lam, gates, chunk)
    return torch.ops.gspn2.propagate(x, lam, gates, chunk)
