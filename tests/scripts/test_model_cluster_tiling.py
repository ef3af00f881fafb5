"""scripts/model_cluster_tiling.py: the planned cluster kernel's tiling, checked against the reference."""

from __future__ import annotations

import pytest
import torch

from tests.scripts._load import script_module


@pytest.fixture(scope="module")
def tiling():
    with script_module("model_cluster_tiling") as module:
        yield module


@pytest.mark.parametrize(
    "L,S,rows,T,chunk",
    [(33, 21, 5, 4, None), (33, 21, 5, 4, 7), (16, 16, 4, 8, 3), (7, 5, 16, 3, None), (1, 9, 4, 2, None),
     (20, 17, 6, 1, 5)],
)
def test_halo_of_t_rows_is_exact(tiling, L, S, rows, T, chunk):
    x, lam, w = tiling.random_problem(2, L, S, seed=L + S)
    got = tiling.tiled_scan(x, lam, w, chunk, rows, T, halo=T)
    torch.testing.assert_close(got, tiling.reference(x, lam, w, chunk), rtol=0, atol=1e-12)


def test_a_smaller_halo_is_caught(tiling):
    """One row short of T: the unknown neighbours (NaN) reach the CTAs' own rows, as they would read
    garbage in the kernel: the model can fail."""
    x, lam, w = tiling.random_problem(2, 33, 21, seed=3)
    got = tiling.tiled_scan(x, lam, w, None, 5, 4, halo=3)
    assert torch.isnan(got).any()
    # with restarts every step nothing couples across steps, so even no halo is exact
    got = tiling.tiled_scan(x, lam, w, 1, 5, 4, halo=0)
    torch.testing.assert_close(got, tiling.reference(x, lam, w, 1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs,match", [({"rows": 0}, "`rows`"), ({"T": 0}, "`T`"), ({"halo": -1}, "`halo`")])
def test_bad_arguments_are_named(tiling, kwargs, match):
    x, lam, w = tiling.random_problem(1, 4, 4)
    args = {"rows": 2, "T": 2, "halo": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        tiling.tiled_scan(x, lam, w, None, **args)


@pytest.mark.parametrize(
    "L,S,rows,T,chunk",
    [(33, 21, 5, 4, None), (33, 21, 5, 4, 7), (16, 16, 4, 8, 3), (7, 5, 16, 3, None), (1, 9, 4, 2, None),
     (20, 17, 6, 1, 5)],
)
def test_adjoint_with_halo_of_t_rows_is_exact(tiling, L, S, rows, T, chunk):
    grad_h, _, _ = tiling.random_problem(2, L, S, seed=L * S)
    logits = tiling.random_logits(2, L, S, seed=L * S)
    got = tiling.tiled_adjoint(grad_h, tiling.weights(logits), chunk, rows, T, halo=T)
    torch.testing.assert_close(got, tiling.reference_adjoint(grad_h, logits, chunk), rtol=0, atol=1e-12)


def test_adjoint_needs_one_row_less(tiling):
    """The backward's tile start already reads one row beyond the extended region (the adjoint that
    scatters into it), so T - 1 halo rows are exact and T - 2 are caught."""
    grad_h, _, _ = tiling.random_problem(2, 33, 21, seed=5)
    logits = tiling.random_logits(2, 33, 21, seed=5)
    w, ref = tiling.weights(logits), tiling.reference_adjoint(grad_h, logits, None)
    torch.testing.assert_close(tiling.tiled_adjoint(grad_h, w, None, 5, 4, halo=3), ref, rtol=0, atol=1e-12)
    assert torch.isnan(tiling.tiled_adjoint(grad_h, w, None, 5, 4, halo=2)).any()
