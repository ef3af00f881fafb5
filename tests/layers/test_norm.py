"""gspn2.layers.LayerNorm2d: timm's LayerNorm2d computed in the activation dtype; the plain-op norm of the
compiled path (float32 parameters applied to 16-bit activations without casts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d as TimmLayerNorm2d

from gspn2.layers import LayerNorm2d, layer_norm_last_dim, norm_linear
from gspn2.layers.norm import layer_norm_rows, layer_norm_rows_backward
from gspn2.ops import options


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_equals_timm_and_keeps_the_activation_dtype(channels_last):
    torch.manual_seed(0)
    norm = LayerNorm2d(6)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    timm_norm = TimmLayerNorm2d(6)
    timm_norm.load_state_dict(norm.state_dict(), strict=True)
    x = torch.randn(2, 6, 3, 5)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(norm(x), timm_norm(x))
    xb = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm(xb)
    want = timm_norm(xb.float())  # the same input, normalised in fp32
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_layer_norm_rows_is_layer_norm_and_its_backward_is_autograds():
    """The plain-op norm of the compiled path equals ``F.layer_norm`` with its gradients (float64), and
    ``layer_norm_rows_backward`` equals autograd through it, also for a bf16 input with float32 parameters
    (the compiled models' case), where ATen's norm wants one dtype for all three."""
    g = torch.Generator().manual_seed(0)
    shapes = ((7, 12), (12,), (12,), (7, 12))
    x, w, b, gy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y, mean, rstd = layer_norm_rows(*leaves, 1e-6)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y_ref = F.layer_norm(ref[0], (12,), ref[1], ref[2], 1e-6)
    torch.testing.assert_close(y, y_ref)
    assert mean.shape == rstd.shape == (7, 1)
    grads = torch.autograd.grad(y, leaves, gy)
    torch.testing.assert_close(grads, torch.autograd.grad(y_ref, ref, gy))
    mean, rstd = mean.detach(), rstd.detach()
    written = layer_norm_rows_backward(gy, x, mean, rstd, w, [True, True, True])
    torch.testing.assert_close(written, grads)
    assert layer_norm_rows_backward(gy, x, mean, rstd, w, [False, True, False])[::2] == (None, None)

    xb = x.to(torch.bfloat16).requires_grad_()
    wf, bf = w.float().requires_grad_(), b.float().requires_grad_()
    yb, mean, rstd = layer_norm_rows(xb, wf, bf, 1e-6)
    assert yb.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
    want = F.layer_norm(xb.detach().double(), (12,), w, b, 1e-6)  # float32 parameters, unrounded
    torch.testing.assert_close(yb.double(), want, rtol=1e-2, atol=1e-2)
    gyb = gy.to(torch.bfloat16)
    auto = torch.autograd.grad(yb, (xb, wf, bf), gyb)
    written = layer_norm_rows_backward(gyb, xb.detach(), mean.detach(), rstd.detach(), wf.detach(),
                                       [True] * 3)
    assert [t.dtype for t in written] == [torch.bfloat16, torch.float32, torch.float32]
    for got, want in zip(written, auto):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("where", ["norm_linear", "LayerNorm2d"])
def test_compiled_norms_apply_float32_parameters_without_casting_them(where):
    """Under torch.compile with autocast, the norms of a bf16 activation take their float32 parameters as
    they are (no cast in the graph, so none of their gradient either: Inductor would keep a copy kernel
    for each), with the eager path's values and gradients to bf16 accuracy."""
    g = torch.Generator().manual_seed(1)
    N, C, out = 24, 8, 6
    x = torch.randn(N, C, generator=g).to(torch.bfloat16)
    nw, nb = torch.randn(C, generator=g), torch.randn(C, generator=g)
    w, b = torch.randn(out, C, generator=g) * 0.3, torch.randn(out, generator=g)

    def fn(x, nw, nb, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if where == "norm_linear":
                return norm_linear(x, nw, nb, 1e-6, w, b)[0]
            return layer_norm_last_dim(x, nw, nb, 1e-6)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    results = []
    for compiled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, nw, nb, w, b)]
        with options.override(eager_autograd="python"):
            torch._dynamo.reset()
            run = torch.compile(fn, backend=capture, fullgraph=True) if compiled else fn
            y = run(*leaves)
        y.float().square().sum().backward()
        results.append([y.detach().float()] + [t.grad.float() for t in leaves if t.grad is not None])
    for got, want in zip(*results):  # eagerly the parameters are rounded to bf16 first
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())
    (gm,) = graphs
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.lower().endswith(("nw_", "nb_"))]
    assert len(params) == 2
    for node in params:
        users = [str(u.target) for u in node.users]
        assert users and not any("to" == t or "to_copy" in t or "convert" in t for t in users), users
