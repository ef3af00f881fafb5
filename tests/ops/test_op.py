"""The public op: registration (opcheck, compile, autograd), gradients, input validation."""

from __future__ import annotations

import pytest
import torch

import gspn2  # noqa: F401  (registers the ops)
from gspn2.ops import gspn_propagate, gspn_propagate_ref
from tests.ops._inputs import make_inputs


def test_op_is_registered_in_gspn2_namespace():
    assert hasattr(torch.ops.gspn2, "propagate")
    assert hasattr(torch.ops.gspn2, "propagate_backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [None, 2])
def test_op_matches_reference(dtype, chunk):
    x, lam, gates = make_inputs(2, 4, 5, 7, 2, dtype=dtype)
    h = gspn_propagate(x, lam, gates, chunk)
    assert h.shape == (2, 4, 4, 5, 7) and h.dtype == dtype
    torch.testing.assert_close(h, gspn_propagate_ref(x, lam, gates, chunk))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_half_inputs_return_input_dtype(dtype):
    x, lam, gates = make_inputs(1, 2, 4, 6, 1, dtype=torch.float32)
    h = gspn_propagate(x.to(dtype), lam.to(dtype), gates.to(dtype))
    assert h.dtype == dtype
    ref = gspn_propagate_ref(x.to(dtype).double(), lam.to(dtype).double(), gates.to(dtype).double())
    torch.testing.assert_close(h.double(), ref, atol=2e-2, rtol=2e-2)


def test_non_contiguous_inputs():
    x, lam, gates = make_inputs(2, 4, 6, 5, 2)
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    lamt = lam.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    gbig = torch.randn(2, 4, 3, 2, 6, 10, dtype=torch.float64)
    gbig[..., ::2] = gates
    gstrided = gbig[..., ::2]
    assert not (xt.is_contiguous() or lamt.is_contiguous() or gstrided.is_contiguous())
    torch.testing.assert_close(gspn_propagate(xt, lamt, gstrided), gspn_propagate(x, lam, gates))


@pytest.mark.parametrize(
    "B,C,H,W,K,chunk", [(1, 2, 3, 4, 1, None), (2, 4, 4, 3, 4, 2), (1, 3, 1, 4, 3, None), (1, 2, 4, 1, 2, 3)]
)
def test_gradcheck(B, C, H, W, K, chunk):
    x, lam, gates = make_inputs(B, C, H, W, K, requires_grad=True, seed=11)
    assert torch.autograd.gradcheck(lambda a, b, c: gspn_propagate(a, b, c, chunk), (x, lam, gates))


def test_op_gradients_match_reference_autograd():
    x, lam, gates = make_inputs(2, 4, 6, 5, 1, requires_grad=True, seed=12)
    h = gspn_propagate(x, lam, gates, 4)
    grad_h = torch.randn_like(h)
    got = torch.autograd.grad(h, (x, lam, gates), grad_h)
    expected = torch.autograd.grad(gspn_propagate_ref(x, lam, gates, 4), (x, lam, gates), grad_h)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("chunk", [None, 2])
def test_opcheck(chunk):
    x, lam, gates = make_inputs(1, 2, 3, 4, 1, requires_grad=True, seed=13)
    torch.library.opcheck(torch.ops.gspn2.propagate.default, (x, lam, gates, chunk, "auto", 0))
    x, lam, gates = make_inputs(1, 2, 3, 4, 1, seed=13)
    h = gspn_propagate(x, lam, gates, chunk)
    torch.library.opcheck(
        torch.ops.gspn2.propagate_backward.default, (torch.randn_like(h), x, lam, gates, h, chunk, "auto", 0)
    )


def test_torch_compile_fullgraph():
    x, lam, gates = make_inputs(1, 2, 4, 5, 1, dtype=torch.float32, requires_grad=True, seed=14)

    def f(x, lam, gates):
        return (gspn_propagate(x * 2, lam, gates, None) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(x, lam, gates)
    grads = torch.autograd.grad(loss, (x, lam, gates))
    loss_ref = f(x, lam, gates)
    grads_ref = torch.autograd.grad(loss_ref, (x, lam, gates))
    torch.testing.assert_close(loss, loss_ref)
    for g, e in zip(grads, grads_ref):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------
# Bad input: each error names the argument
# ---------------------------------------------------------------------------------------------


def _good():
    return make_inputs(2, 4, 3, 5, 2, dtype=torch.float32)


def _bad_cases():
    x, lam, gates = _good()
    return [
        ("x rank", (x[0], lam, gates, None), ValueError, r"`x`.*\(B, C, H, W\)"),
        ("x empty", (x[:, :0], lam[:, :, :0], gates, None), ValueError, r"`x`.*empty"),
        ("lam rank", (x, lam[:, 0], gates, None), ValueError, r"`lam`.*\(B, 4, C, H, W\)"),
        ("lam 3 directions", (x, lam[:, :3], gates, None), ValueError, r"`lam`.*\(2, 4, 4, 3, 5\)"),
        ("lam spatial", (x, lam[..., :4], gates, None), ValueError, r"`lam`"),
        ("gates rank", (x, lam, gates[:, :, :, 0], None), ValueError, r"`gates`.*\(B, 4, 3, K, H, W\)"),
        ("gates 2 offsets", (x, lam, gates[:, :, :2], None), ValueError, r"`gates`.*\(2, 4, 3, 2, 3, 5\)"),
        ("gates 3 directions", (x, lam, gates[:, :3], None), ValueError, r"`gates`"),
        ("gates batch", (x, lam, gates[:1], None), ValueError, r"`gates`"),
        ("C % K", (x, lam, torch.randn(2, 4, 3, 3, 3, 5), None), ValueError, r"K = 3.*divide C = 4"),
        ("chunk 0", (x, lam, gates, 0), ValueError, r"`chunk`.*>= 1"),
        ("chunk negative", (x, lam, gates, -2), ValueError, r"`chunk`"),
        ("chunk float", (x, lam, gates, 2.0), TypeError, r"`chunk`"),
        ("chunk bool", (x, lam, gates, True), TypeError, r"`chunk`"),
        ("x int", (x.long(), lam, gates, None), TypeError, r"`x`.*float"),
        ("gates bool", (x, lam, gates > 0, None), TypeError, r"`gates`.*float"),
        ("mixed dtype", (x, lam.double(), gates, None), TypeError, r"one dtype.*lam=torch.float64"),
        ("not a tensor", (x.tolist(), lam, gates, None), TypeError, r"`x`.*torch.Tensor"),
        ("mixed device", (x, lam.to("meta"), gates, None), ValueError, r"one device.*lam=meta"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_naming_the_argument(case):
    _, args, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        gspn_propagate(*args)


def test_backward_returns_contiguous_gradients_for_strided_inputs():
    """The fake promises contiguous gradients; the real implementation must keep that promise."""
    x, lam, gates = make_inputs(1, 2, 4, 5, 1)
    xs = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    gs = gates.transpose(-1, -2).contiguous().transpose(-1, -2)
    h = gspn_propagate(xs, lam, gs)
    grads = torch.ops.gspn2.propagate_backward(torch.randn_like(h), xs, lam, gs, h, None, "auto", 0)
    assert all(g.is_contiguous() for g in grads)


_SCHEMA_BOUND = ("chunk float", "chunk bool", "not a tensor")  # refused by the schema before any check runs


@pytest.mark.parametrize("case", [c for c in _bad_cases() if c[0] not in _SCHEMA_BOUND], ids=lambda c: c[0])
def test_direct_op_calls_run_the_same_checks(case):
    """torch.ops.gspn2.propagate called directly checks its inputs like the public function."""
    _, args, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        torch.ops.gspn2.propagate(*args, "auto", 0)


def test_more_bad_inputs_are_refused():
    x, lam, gates = _good()
    with pytest.raises(ValueError, match=r"`chunk` must be below 2\^63"):
        gspn_propagate(x, lam, gates, 2**64)
    with pytest.raises(TypeError, match=r"`x` must be a dense \(strided\) tensor"):
        gspn_propagate(x.to_sparse(), lam, gates)
    with pytest.raises(ValueError, match=r"`gates`"):
        gspn_propagate(x, lam, gates[:, :, :, :, :1])  # would broadcast over H; refused
    with pytest.raises(ValueError, match=r"`kernel` must be"):
        gspn_propagate(x, lam, gates, kernel="FAST")


def test_clear_error_under_torch_compile_fullgraph():
    x, lam, gates = _good()
    f = torch.compile(lambda a, b, c: gspn_propagate(a, b, c), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"`lam` must have shape \(B, 4, C, H, W\)"):
        f(x, lam[..., :4], gates)


def test_nan_logit_outside_the_line_does_not_leak():
    """The normalisation ignores neighbours outside the line, so their logits (even NaN / inf) never matter."""
    x, lam, gates = make_inputs(1, 2, 5, 6, 1, dtype=torch.float64, requires_grad=False, seed=21)
    bad = gates.clone()
    bad[:, 0:2, 0, :, 0, :] = float("nan")  # offset -1 at line position 0 (columns)
    bad[:, 0:2, 2, :, -1, :] = float("inf")  # offset +1 at the last position
    bad[:, 2:4, 0, :, :, 0] = float("nan")  # rows
    bad[:, 2:4, 2, :, :, -1] = -float("inf")
    bad.requires_grad_()
    h = gspn_propagate(x, lam, bad)
    torch.testing.assert_close(h, gspn_propagate(x, lam, gates))
    (g,) = torch.autograd.grad(h.sum(), bad)
    assert torch.isfinite(g).all()
