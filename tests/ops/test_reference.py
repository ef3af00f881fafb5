"""The pure-PyTorch reference against docs/spec.md, section 1: hand-computed cases, a naive oracle, symmetries, backward."""

from __future__ import annotations

import math

import pytest
import torch

from gspn2.ops import gspn_propagate_backward_ref, gspn_propagate_ref
from tests.ops._oracle import oracle_propagate
from tests.ops._inputs import make_inputs


def _sig(v):
    return 1 / (1 + math.exp(-v))


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_one_pixel_lines_accumulate():
    """H = 1: direction 0 has 1-pixel lines, so only offset 0 is valid and its weight is exactly 1."""
    x = torch.tensor([[[[1.0, 2.0, 3.0]]]], dtype=torch.float64)
    lam = torch.full((1, 4, 1, 1, 3), 0.5, dtype=torch.float64)
    gates = torch.randn(1, 4, 3, 1, 1, 3, dtype=torch.float64)
    h = gspn_propagate_ref(x, lam, gates)
    # left -> right: 0.5, 0.5 + 1.0, 1.5 + 1.5 ; right -> left: mirror image of that.
    torch.testing.assert_close(h[0, 0, 0, 0], torch.tensor([0.5, 1.5, 3.0], dtype=torch.float64))
    torch.testing.assert_close(h[0, 1, 0, 0], torch.tensor([3.0, 2.5, 1.5], dtype=torch.float64))
    # Vertical scans have a single step: h = lam * x everywhere.
    torch.testing.assert_close(h[0, 2], 0.5 * x[0])
    torch.testing.assert_close(h[0, 3], 0.5 * x[0])


def test_single_pixel_image():
    x = torch.tensor([[[[2.0]]]], dtype=torch.float64)
    lam = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).reshape(1, 4, 1, 1, 1)
    h = gspn_propagate_ref(x, lam, torch.zeros(1, 4, 3, 1, 1, 1, dtype=torch.float64))
    torch.testing.assert_close(h.flatten(), torch.tensor([2.0, 4.0, 6.0, 8.0], dtype=torch.float64))


def test_boundary_normalisation_by_hand():
    """A 3-pixel line, two steps: edge pixels renormalise over their two valid neighbours."""
    H, W = 3, 2
    x = torch.zeros(1, 1, H, W, dtype=torch.float64)
    x[0, 0, :, 0] = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)  # the first column only
    lam = torch.ones(1, 4, 1, H, W, dtype=torch.float64)
    gates = torch.zeros(1, 4, 3, 1, H, W, dtype=torch.float64)
    gates[0, 0, 0, 0, :, 1] = 1.0  # offset -1 (row above)
    gates[0, 0, 1, 0, :, 1] = 0.0  # offset 0
    gates[0, 0, 2, 0, :, 1] = -1.0  # offset +1 (row below)
    h = gspn_propagate_ref(x, lam, gates)
    a_m, a_0, a_p = _sig(1.0), _sig(0.0), _sig(-1.0)
    prev = [1.0, 2.0, 4.0]
    expect = [
        (a_0 * prev[0] + a_p * prev[1]) / (a_0 + a_p),  # top row: no row above
        (a_m * prev[0] + a_0 * prev[1] + a_p * prev[2]) / (a_m + a_0 + a_p),
        (a_m * prev[1] + a_0 * prev[2]) / (a_m + a_0),  # bottom row: no row below
    ]
    torch.testing.assert_close(h[0, 0, 0, :, 0], torch.tensor(prev, dtype=torch.float64))
    torch.testing.assert_close(h[0, 0, 0, :, 1], torch.tensor(expect, dtype=torch.float64))


def test_rows_of_weights_sum_to_one():
    """Constant x with lam = 0 except the first line: the scan preserves the constant (row-stochastic)."""
    B, C, H, W = 2, 3, 5, 6
    x = torch.full((B, C, H, W), 3.0, dtype=torch.float64)
    lam = torch.zeros(B, 4, C, H, W, dtype=torch.float64)
    lam[:, 0, :, :, 0] = 1.0
    gates = 3 * torch.randn(B, 4, 3, 1, H, W, dtype=torch.float64)
    h = gspn_propagate_ref(x, lam, gates)
    torch.testing.assert_close(h[:, 0], x)


def test_chunk_restarts_by_hand():
    """1-pixel lines, W = 5, chunk 2: left->right restarts at columns 0, 2, 4; right->left at 4, 2, 0."""
    x = torch.ones(1, 1, 1, 5, dtype=torch.float64)
    lam = torch.ones(1, 4, 1, 1, 5, dtype=torch.float64)
    gates = torch.zeros(1, 4, 3, 1, 1, 5, dtype=torch.float64)
    h = gspn_propagate_ref(x, lam, gates, chunk=2)
    torch.testing.assert_close(h[0, 0, 0, 0], torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(h[0, 1, 0, 0], torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0], dtype=torch.float64))
    h3 = gspn_propagate_ref(torch.ones(1, 1, 1, 7, dtype=torch.float64), torch.ones(1, 4, 1, 1, 7,
                            dtype=torch.float64), torch.zeros(1, 4, 3, 1, 1, 7, dtype=torch.float64), chunk=3)
    # Counted from each direction's starting edge: W % chunk != 0 gives different boundaries per direction.
    torch.testing.assert_close(h3[0, 0, 0, 0], torch.tensor([1, 2, 3, 1, 2, 3, 1], dtype=torch.float64))
    torch.testing.assert_close(h3[0, 1, 0, 0], torch.tensor([1, 3, 2, 1, 3, 2, 1], dtype=torch.float64))


def test_chunk_ge_length_equals_global():
    x, lam, gates = make_inputs(1, 2, 4, 5, 1)
    torch.testing.assert_close(gspn_propagate_ref(x, lam, gates, chunk=5), gspn_propagate_ref(x, lam, gates))
    torch.testing.assert_close(gspn_propagate_ref(x, lam, gates, chunk=99), gspn_propagate_ref(x, lam, gates))


# ---------------------------------------------------------------------------------------------
# Against a naive per-pixel transcription of the spec
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,C,H,W,K,chunk",
    [
        (1, 1, 3, 4, 1, None),
        (2, 4, 5, 3, 2, None),
        (1, 3, 4, 7, 3, 3),
        (1, 2, 6, 5, 1, 2),
        (1, 2, 1, 5, 2, None),
        (1, 2, 5, 1, 1, 2),
        (1, 2, 3, 3, 1, 1),
    ],
)
def test_reference_matches_naive_oracle(B, C, H, W, K, chunk):
    x, lam, gates = make_inputs(B, C, H, W, K, seed=B * 100 + H * 10 + W)
    torch.testing.assert_close(gspn_propagate_ref(x, lam, gates, chunk), oracle_propagate(x, lam, gates, chunk))


# ---------------------------------------------------------------------------------------------
# Relations between directions, channel groups
# ---------------------------------------------------------------------------------------------


def _swap_dirs(t, perm):
    return t[:, list(perm)]


@pytest.mark.parametrize("chunk", [None, 3])
def test_direction_symmetries(chunk):
    B, C, H, W, K = 2, 3, 5, 7, 1
    x, lam, gates = make_inputs(B, C, H, W, K, seed=3)
    h = gspn_propagate_ref(x, lam, gates, chunk)
    # Direction 1 on a W-flipped input equals the flipped direction 0.
    hf = gspn_propagate_ref(x.flip(-1), _swap_dirs(lam, (1, 0, 2, 3)).flip(-1),
                            _swap_dirs(gates, (1, 0, 2, 3)).flip(-1), chunk)
    torch.testing.assert_close(hf[:, 1], h[:, 0].flip(-1))
    torch.testing.assert_close(hf[:, 0], h[:, 1].flip(-1))
    # Direction 2 equals direction 0 on transposed inputs (and 3 equals 1).
    ht = gspn_propagate_ref(x.transpose(-1, -2), _swap_dirs(lam, (2, 3, 0, 1)).transpose(-1, -2),
                            _swap_dirs(gates, (2, 3, 0, 1)).transpose(-1, -2), chunk)
    torch.testing.assert_close(ht[:, 0].transpose(-1, -2), h[:, 2])
    torch.testing.assert_close(ht[:, 1].transpose(-1, -2), h[:, 3])
    # Direction 3 on an H-flipped input equals the flipped direction 2.
    hv = gspn_propagate_ref(x.flip(-2), _swap_dirs(lam, (0, 1, 3, 2)).flip(-2),
                            _swap_dirs(gates, (0, 1, 3, 2)).flip(-2), chunk)
    torch.testing.assert_close(hv[:, 3], h[:, 2].flip(-2))


def test_shared_affinity_equals_repeated_per_channel():
    B, C, H, W = 2, 6, 4, 5
    x, lam, g1 = make_inputs(B, C, H, W, 1, seed=4)
    torch.testing.assert_close(
        gspn_propagate_ref(x, lam, g1), gspn_propagate_ref(x, lam, g1.expand(B, 4, 3, C, H, W))
    )
    _, _, g2 = make_inputs(B, C, H, W, 2, seed=5)
    torch.testing.assert_close(
        gspn_propagate_ref(x, lam, g2), gspn_propagate_ref(x, lam, g2.repeat_interleave(C // 2, dim=3))
    )


def test_channels_and_batch_are_independent():
    x, lam, gates = make_inputs(3, 4, 5, 6, 4, seed=6)
    h = gspn_propagate_ref(x, lam, gates)
    h1 = gspn_propagate_ref(x[1:2, 2:3], lam[1:2, :, 2:3], gates[1:2, :, :, 2:3])
    torch.testing.assert_close(h[1:2, :, 2:3], h1)


def test_half_precision_upcasts():
    x, lam, gates = make_inputs(1, 2, 6, 7, 1, dtype=torch.float32, seed=7)
    ref = gspn_propagate_ref(x.double(), lam.double(), gates.double())
    out = gspn_propagate_ref(x.bfloat16(), lam.bfloat16(), gates.bfloat16())
    assert out.dtype == torch.bfloat16
    low = gspn_propagate_ref(x.bfloat16(), lam.bfloat16(), gates.bfloat16(), upcast=False)
    err_up = (out.double() - ref).norm() / ref.norm()
    err_low = (low.double() - ref).norm() / ref.norm()
    assert err_up <= err_low * 1.01 + 1e-4
    assert err_up < 1e-2


# ---------------------------------------------------------------------------------------------
# The explicit reverse scan against autograd through the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,C,H,W,K,chunk",
    [(2, 4, 5, 6, 1, None), (1, 4, 6, 5, 4, 2), (1, 6, 7, 4, 3, 3), (1, 2, 1, 6, 1, None), (1, 2, 6, 1, 2, 4)],
)
def test_backward_ref_matches_autograd(B, C, H, W, K, chunk):
    x, lam, gates = make_inputs(B, C, H, W, K, seed=8, requires_grad=True)
    h = gspn_propagate_ref(x, lam, gates, chunk)
    grad_h = torch.randn_like(h)
    expected = torch.autograd.grad(h, (x, lam, gates), grad_h)
    got = gspn_propagate_backward_ref(grad_h, x.detach(), lam.detach(), gates.detach(), h.detach(), chunk)
    for name, e, g in zip(("x", "lam", "gates"), expected, got):
        torch.testing.assert_close(g, e, msg=lambda m, n=name: f"grad_{n}: {m}")


def test_backward_through_clamped_normaliser():
    """Logits so negative that the normaliser hits its 1e-7 floor: gradients still match autograd."""
    x, lam, gates = make_inputs(1, 2, 4, 4, 1, seed=9)
    gates = torch.full_like(gates, -30.0).requires_grad_(True)
    x.requires_grad_(True)
    lam.requires_grad_(True)
    h = gspn_propagate_ref(x, lam, gates)
    grad_h = torch.randn_like(h)
    expected = torch.autograd.grad(h, (x, lam, gates), grad_h)
    got = gspn_propagate_backward_ref(grad_h, x.detach(), lam.detach(), gates.detach(), h.detach())
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
