"""gspn2.layers.pointwise: the 1x1 convolutions as GEMMs and the activation-recomputing autograd functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspn2.layers import ChunkedConv1x1, Conv1x1, gelu_linear, norm_linear, rows_linear

def test_gelu_linear_gradcheck():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gelu_linear, (h, w, b))
    assert torch.autograd.gradcheck(gelu_linear, (h, w, None))
    expected = F.linear(F.gelu(h), w, b)
    torch.testing.assert_close(gelu_linear(h, w, b), expected)


def test_norm_linear_gradcheck_and_values():
    """norm_linear = linear(layer_norm(x) [* silu(gate)]) in chunks: float64 gradients of every input
    (with and without gate and bias, one and two chunks), and, under bf16 autocast, bitwise the outputs
    and gradients of the unfused modules (norm in x's dtype, GEMMs in bf16)."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    x, gate, nw, nb, w, b = r(5, 6), r(5, 6), r(6), r(6), r(4, 6), r(4)
    for args in [(x, nw, nb, 1e-6, w, b, 2), (x, nw, nb, 1e-6, w, None, 1), (x, None, None, 1e-6, w, b, 1)]:
        assert torch.autograd.gradcheck(lambda *a: norm_linear(*a), args)
    for chunks in (1, 2):
        assert torch.autograd.gradcheck(
            lambda x, q, nw, nb, w, b: norm_linear(x, nw, nb, 1e-6, w, b, chunks, gate=q), (x, gate, nw, nb, w, b)
        )
    expected = F.linear(F.layer_norm(x, (6,), nw, nb, 1e-6) * F.silu(gate), w, b)
    torch.testing.assert_close(norm_linear(x, nw, nb, 1e-6, w, b, gate=gate)[0], expected)
    with pytest.raises(ValueError, match="`chunks`"):
        norm_linear(x, nw, nb, 1e-6, w, b, 3)

    # bf16 autocast: bitwise the unfused path, forward and gradients (same kernels, same summation).
    xs = torch.randn(64, 16, generator=g).requires_grad_()
    ws = torch.randn(32, 16, generator=g).requires_grad_()
    bs, nws, nbs = (torch.randn(n, generator=g).requires_grad_() for n in (32, 16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = norm_linear(xs, nws, nbs, 1e-6, ws, bs, 2)
        n = F.layer_norm(xs, (16,), nws, nbs, 1e-6)
        refs = tuple(F.linear(n, wc, bc) for wc, bc in zip(ws.chunk(2), bs.chunk(2)))
    for o, ref in zip(outs, refs):
        assert o.dtype == ref.dtype == torch.bfloat16 and torch.equal(o, ref)
    grads = torch.autograd.grad(sum(o.float().square().sum() for o in outs), (xs, ws, bs, nws, nbs))
    ref_grads = torch.autograd.grad(sum(o.float().square().sum() for o in refs), (xs, ws, bs, nws, nbs))
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("out_chunks,match", [(0, "`out_chunks`"), (5, "`out_chunks` \\(5\\) must divide")])
def test_conv1x1_bad_out_chunks(out_chunks, match):
    with pytest.raises(ValueError, match=match):
        ChunkedConv1x1(4, 8, out_chunks=out_chunks)


def test_conv1x1_is_the_convolution():
    torch.manual_seed(0)
    conv = ChunkedConv1x1(6, 8, out_chunks=2)
    x = torch.randn(2, 6, 3, 5)
    expected = F.conv2d(x, conv.weight, conv.bias).chunk(2, dim=1)
    got_all = conv(x)
    assert isinstance(got_all, list) and len(got_all) == 2
    for got, want in zip(got_all, expected):
        assert got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, want)
    single = Conv1x1(6, 8)
    torch.testing.assert_close(single(x), F.conv2d(x, single.weight, single.bias))


def test_rows_linear_gradcheck_and_values():
    """rows_linear = linear(x) [+ skip_input * skip_scale]: float64 gradients of every input, and under bf16
    autocast bitwise the outputs and gradients of F.linear followed by torch.addcmul."""
    g = torch.Generator().manual_seed(2)

    def r(*shape, dtype=torch.float64):
        return torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)

    x, w, b, v, s = r(5, 6), r(4, 6), r(4), r(5, 4), r(4)
    assert torch.autograd.gradcheck(rows_linear, (x, w, b))
    assert torch.autograd.gradcheck(rows_linear, (x, w, None, v, s))
    torch.testing.assert_close(rows_linear(x, w, b, v, s), torch.addcmul(F.linear(x, w, b), v, s))
    with pytest.raises(ValueError, match="`skip_input` and `skip_scale`"):
        rows_linear(x, w, b, v, None)

    xs, ws, bs, ss = r(64, 16, dtype=torch.float32), r(32, 16, dtype=torch.float32), r(32, dtype=torch.float32), r(32, dtype=torch.float32)
    vs = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rows_linear(xs, ws, bs, vs, ss)
        ref = torch.addcmul(F.linear(xs, ws, bs), vs, ss.to(vs.dtype))
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    inputs = (xs, ws, bs, vs, ss)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), inputs)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)
