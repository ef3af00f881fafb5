"""The extension's direct eager entries of ``gspn2::propagate`` and ``gspn2::depthwise_conv2d``
(``gspn2/csrc/calls.h``): the same dispatcher op as ``torch.ops``, so on the CPU they reach the reference and
its autograd formula; where they may replace ``torch.ops`` (not under Dynamo, ``torch.jit.trace`` or
``__torch_function__``); the CUDA autograd kernels that record no node where no gradient is wanted; and the
build-hint kernel that CUDA calls reach without the extension. On a GPU: direct and ``torch.ops`` calls
bitwise equal, and the depthwise kernel's weight and bias in any float dtype and layout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401
from gspn2.ops import _cuda, depthwise_conv2d, gspn_propagate, options
from tests.ops._inputs import make_inputs
from tests.ops.test_build import _nvcc_present

built = pytest.mark.skipif(
    not _nvcc_present() or os.environ.get("GSPN2_BUILD_CUDA") == "0",
    reason="no nvcc or GSPN2_BUILD_CUDA=0: the package has no extension (test_build.py checks which)",
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_direct_call_names_are_validated():
    with pytest.raises(ValueError, match="`name` must be one of"):
        _cuda.direct_call("plan")


@built
def test_direct_entries_exist():
    for name in _cuda.DIRECT_CALLS:
        assert callable(_cuda.direct_call(name)), name


@built
def test_direct_dwconv_is_the_op_on_cpu():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    direct = _cuda.direct_call("depthwise_conv2d")
    y = direct(x, w, b, True, False, 0, 4)
    ref = F.conv2d(x, w, b, padding=1, groups=3) + x
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(y, torch.ops.gspn2.depthwise_conv2d(x, w, b, True, False, 0, 4), rtol=0, atol=0)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), gy)
    want = torch.autograd.grad(ref, (x, w, b), gy)
    for name, g, r in zip(("x", "weight", "bias"), got, want):
        torch.testing.assert_close(g, r, msg=name)
    y0 = direct(x, w, None, False, False, 0, 4)
    torch.testing.assert_close(y0, F.conv2d(x, w, None, padding=1, groups=3))
    with pytest.raises(ValueError, match="`weight` must be"):
        direct(x, w[:2], b, False, False, 0, 4)
    with pytest.raises(ValueError, match="`cols` must be 4 or 8"):
        direct(x, w, b, False, False, 0, 5)


@built
def test_direct_propagate_is_the_op_on_cpu():
    x, lam, gates = make_inputs(1, 2, 5, 4, 1, requires_grad=True)
    direct = _cuda.direct_call("propagate")
    h = direct(x, lam, gates, None, "auto", 0)
    torch.testing.assert_close(h, torch.ops.gspn2.propagate(x, lam, gates, None, "auto", 0), rtol=0, atol=0)
    torch.testing.assert_close(direct(x, lam, gates, 2, "auto", 0), gspn2.ops.gspn_propagate_ref(x, lam, gates, 2))
    gh = torch.randn_like(h)
    got = torch.autograd.grad(h, (x, lam, gates), gh)
    want = torch.autograd.grad(gspn2.ops.gspn_propagate_ref(x, lam, gates), (x, lam, gates), gh)
    for name, g, r in zip(("x", "lam", "gates"), got, want):
        torch.testing.assert_close(g, r, msg=name)
    with pytest.raises(ValueError, match="`kernel`"):
        direct(x, lam, gates, None, "fastest", 0)


@built
def test_direct_rows_ops_are_the_ops_on_cpu():
    g = torch.Generator().manual_seed(0)
    x, gate, skip = (torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    nw, nb, bias, scale = (torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4))
    weight = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cases = {
        "rows_norm_linear": (x, gate, nw, nb, weight, bias, 1e-6, 2, torch.float64),
        "rows_linear": (x, weight, bias, skip, scale, torch.float64),
        "rows_gelu_linear": (x, weight, None),
    }
    for name, args in cases.items():
        direct, op = _cuda.direct_call(name), getattr(torch.ops.gspn2, name).default
        outs = []
        for call in (direct, op):
            y = call(*args)
            ys = list(y) if isinstance(y, (list, tuple)) else [y]
            leaves = [a for a in args if isinstance(a, torch.Tensor)]
            outs.append(ys + list(torch.autograd.grad(sum(t.sum() for t in ys), leaves)))
        assert len(outs[0]) == len(outs[1])
        for a, r in zip(*outs):
            assert torch.equal(a, r), name


def test_direct_calls_are_allowed_in_plain_eager_only():
    t = torch.ones(2)
    assert _cuda.direct_call_allowed((t, None))
    # torch.jit.trace records torch.ops calls only
    seen = []
    torch.jit.trace(lambda a: seen.append(_cuda.direct_call_allowed((a,))) or a * 2, (t,), check_trace=False)
    assert seen == [False]

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not _cuda.direct_call_allowed((t,))
    compiled = torch.compile(lambda a: a + 1 if _cuda.direct_call_allowed((a,)) else a - 1, backend="eager",
                             fullgraph=True)
    assert compiled(t).tolist() == [0.0, 0.0]


def test_public_entries_stay_traceable():
    """torch.jit.trace and fullgraph torch.compile still see the registered ops through the public entries."""
    x = torch.randn(1, 4, 6, 6)
    w, b = torch.randn(4, 1, 3, 3), torch.randn(4)
    traced = torch.jit.trace(lambda t: depthwise_conv2d(t, w, b, True), (x,), check_trace=False)
    assert "gspn2::depthwise_conv2d" in str(traced.graph)
    xp, lam, gates = make_inputs(1, 2, 5, 4, 1, dtype=torch.float32)
    traced = torch.jit.trace(lambda a, l, g: gspn_propagate(a, l, g), (xp, lam, gates), check_trace=False)
    assert "gspn2::propagate" in str(traced.graph)
    compiled = torch.compile(lambda t: depthwise_conv2d(t, w, b, True), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), depthwise_conv2d(x, w, b, True))


def test_without_the_extension_cuda_calls_raise_the_build_hint():
    code = (
        "import sys; sys.modules['gspn2._C'] = None\n"
        "import torch, gspn2\n"
        "from gspn2.ops import _cuda\n"
        "assert not _cuda.extension_available()\n"
        "assert _cuda.direct_call('propagate') is None and _cuda.direct_call('depthwise_conv2d') is None\n"
        "for op in ('propagate', 'propagate_backward'):\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key('gspn2::' + op, 'CUDA'), op\n"
        "try:\n"
        "    _cuda.raise_build_hint()\n"
        "except RuntimeError as e:\n"
        "    assert str(e) == _cuda.BUILD_HINT\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "x = torch.randn(1, 2, 3, 3); lam = torch.rand(1, 4, 2, 3, 3); g = torch.randn(1, 4, 3, 1, 3, 3)\n"
        "torch.testing.assert_close(gspn2.ops.gspn_propagate(x, lam, g), gspn2.ops.gspn_propagate_ref(x, lam, g))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("name", ["x", "weight", "lam"])
def test_forward_mode_ad_is_refused_by_name(name):
    """The ops have reverse-mode formulas only: a forward-mode tangent raises instead of vanishing."""
    import torch.autograd.forward_ad as fwAD

    x, w, b = torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3), torch.randn(4)
    xp, lam, gates = make_inputs(1, 2, 5, 4, 1, dtype=torch.float32)
    with fwAD.dual_level():
        if name == "lam":
            lam = fwAD.make_dual(lam, torch.randn_like(lam))
            with pytest.raises(NotImplementedError, match="`lam` carries a forward-mode AD tangent"):
                gspn_propagate(xp, lam, gates)
        else:
            args = {"x": x, "weight": w}
            args[name] = fwAD.make_dual(args[name], torch.randn_like(args[name]))
            with pytest.raises(NotImplementedError, match=f"`{name}` carries a forward-mode AD tangent"):
                depthwise_conv2d(args["x"], args["weight"], b, True)
    # outside a dual level the same call runs
    assert depthwise_conv2d(x, w, b, True).shape == x.shape


# ---- GPU ----


def _dw_case(dtype=torch.bfloat16, C=32, K=3):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, C, 12, 10, device="cuda", generator=g).to(dtype, memory_format=torch.channels_last)
    w = torch.randn(C, 1, K, K, device="cuda", generator=g) * 0.2
    b = torch.randn(C, device="cuda", generator=g)
    return x, w, b


@cuda
@pytest.mark.cuda
def test_cuda_direct_calls_equal_torch_ops_bitwise():
    x, w, b = _dw_case()
    outs = []
    for call in (_cuda.direct_call("depthwise_conv2d"), torch.ops.gspn2.depthwise_conv2d.default):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = call(*leaves, True, False, 1, 8)
        outs.append((y, *torch.autograd.grad(y, leaves, torch.ones_like(y))))
    for a, r in zip(*outs):
        assert torch.equal(a, r)
    xp, lam, gates = (t.cuda().to(torch.bfloat16).requires_grad_() for t in make_inputs(2, 2, 9, 8, 1))
    outs = []
    for call in (_cuda.direct_call("propagate"), torch.ops.gspn2.propagate.default):
        h = call(xp, lam, gates, None, "auto", 0)
        outs.append((h, *torch.autograd.grad(h, (xp, lam, gates), torch.ones_like(h))))
    for a, r in zip(*outs):
        assert torch.equal(a, r)


@cuda
@pytest.mark.cuda
def test_cuda_calls_without_grad_record_no_node():
    x, w, b = _dw_case()
    xp, lam, gates = (t.cuda().to(torch.bfloat16) for t in make_inputs(2, 2, 9, 8, 1))
    wg = w.clone().requires_grad_()
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            assert depthwise_conv2d(x, wg, b, True).grad_fn is None
            assert gspn_propagate(xp, lam, gates).grad_fn is None
    assert depthwise_conv2d(x, w, b, True).grad_fn is None  # nothing requires grad
    assert depthwise_conv2d(x, wg, b, True).grad_fn is not None
    assert gspn_propagate(xp, lam, gates.requires_grad_()).grad_fn is not None


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("K", [3, 7])
def test_cuda_weight_and_bias_in_any_dtype_and_layout(K):
    """The kernel reads float32 contiguous weights and biases in place and converts any other: the results
    equal those of the float32 contiguous parameters holding the same values."""
    options.set_options(dwconv="cuda")
    x, w, b = _dw_case(C=48, K=K)
    w16, b16 = w.to(torch.bfloat16), b.to(torch.bfloat16)
    want = depthwise_conv2d(x, w16.float(), b16.float(), True)
    wide = torch.zeros(48, 1, K, 2 * K, device="cuda")
    wide[..., ::2] = w16.float()
    strided = wide[..., ::2]  # float32, not contiguous
    assert not strided.is_contiguous()
    for weight, bias in ((w16, b16), (strided, b16.float()), (w16.half(), b16.double())):
        assert torch.equal(depthwise_conv2d(x, weight, bias, True), want), (weight.dtype, bias.dtype)
    gy = torch.randn_like(x)
    ref = torch.ops.gspn2.depthwise_conv2d_backward(gy, x, w16.float(), True, True, 1, 8)
    got = torch.ops.gspn2.depthwise_conv2d_backward(gy, x, w16, True, True, 1, 8)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1].to(torch.bfloat16)) and got[1].dtype == torch.bfloat16
