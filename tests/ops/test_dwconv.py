"""``gspn2.ops.depthwise_conv2d``: the op against ``F.conv2d`` (CPU, float64 gradcheck, opcheck), the fused
SiLU, argument errors, the backend switch and the MAC count; on a GPU the CUDA kernel against cuDNN (fp32,
bf16, fp16, both tiles, the scalar path, the tensor-core family), TMA and ``cp.async`` staging bitwise equal,
determinism and ``torch.compile(fullgraph=True)``. The models
against their module-by-module oracle (cuDNN depthwise convolutions): tests/models/test_gspn2_cuda.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401
from gspn2.benchmark import dwconv_variant_options
from gspn2.ops import depthwise_conv2d, options
from gspn2.ops import _cuda
from gspn2.ops import dwconv as D

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _set_variant(variant):
    """``t<kernel>v<cols>`` (gspn2.benchmark.DWCONV_VARIANTS): the input- and weight-gradient kernels
    (kernel 0) or the one-pass backward (1), with ``cols`` output columns per thread."""
    options.set_options(**dwconv_variant_options(variant))


def _reference(x, w, b, add, silu=False):
    y = F.conv2d(x, w, b, padding=w.shape[-1] // 2, groups=x.shape[1])
    y = y + x if add else y
    return F.silu(y) if silu else y


@pytest.mark.parametrize("K,add,bias", [(3, True, True), (7, False, True), (5, True, False), (9, False, True)])
def test_cpu_matches_conv2d_and_gradcheck(K, add, bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, K, K, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True) if bias else None
    torch.testing.assert_close(depthwise_conv2d(x, w, b, add), _reference(x, w, b, add))
    inputs = (x, w, b) if bias else (x, w)
    assert torch.autograd.gradcheck(lambda *t: depthwise_conv2d(t[0], t[1], t[2] if bias else None, add), inputs)


def test_silu_fused_in_inference_separate_under_autograd():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    w, b = torch.randn(4, 1, 3, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(depthwise_conv2d(x, w, b, silu=True), _reference(x, w, b, False, True))
    xr = x.clone().requires_grad_()
    y = depthwise_conv2d(xr, w, b, add_input=True, silu=True)
    torch.testing.assert_close(y, _reference(x, w, b, True, True))
    assert torch.autograd.gradcheck(lambda t: depthwise_conv2d(t, w, b, True, True), (xr,))


def test_fused_silu_op_refuses_backward():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    w = torch.randn(2, 1, 3, 3)
    y = torch.ops.gspn2.depthwise_conv2d(x, w, None, False, True, 0, 4)
    with pytest.raises(ValueError, match="`silu`=True has no backward"):
        y.sum().backward()


@pytest.mark.parametrize("channels_last", [True, False])
def test_opcheck(channels_last):
    x = torch.randn(2, 4, 5, 7)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = torch.randn(4, 1, 3, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    torch.library.opcheck(torch.ops.gspn2.depthwise_conv2d.default, (x.requires_grad_(), w, b, True, False, 0, 4))


def test_autocast_keeps_the_residual_dtype():
    # x + conv(x) under autocast promotes to x's dtype in the reference; so must the fused op.
    x = torch.randn(1, 4, 5, 5)
    w, b = torch.randn(4, 1, 3, 3), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = depthwise_conv2d(x, w, b, add_input=True)
        ref = x + F.conv2d(x, w, b, padding=1, groups=4)
        y_plain = depthwise_conv2d(x, w, b)
    assert y.dtype == ref.dtype == torch.float32 and y_plain.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.randn(4, 5, 5)), "`x` must be"),
        (dict(w=torch.randn(4, 1, 3, 2)), "`weight` must be"),
        (dict(w=torch.randn(3, 1, 3, 3)), "`weight` must be"),
        (dict(w=torch.randn(4, 1, 4, 4)), "odd kernel"),
        (dict(b=torch.randn(5)), "`bias` must be"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    args = dict(x=torch.randn(1, 4, 5, 5), w=torch.randn(4, 1, 3, 3), b=torch.randn(4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        depthwise_conv2d(args["x"], args["w"], args["b"])


@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_tma_switch_is_validated_and_restored():
    with pytest.raises(TypeError, match="`enabled` must be a bool"):
        _cuda.dwconv_tma(1)
    assert _cuda.dwconv_tma(False) is True
    assert _cuda.dwconv_tma(True) is False


def test_backend_switch_is_validated():
    with pytest.raises(ValueError, match="GSPN2_DWCONV"):
        options.from_env({"GSPN2_DWCONV": "fast"})
    assert options.from_env({"GSPN2_DWCONV_KERNEL": "MMA"}).dwconv_kernel == "mma"
    with pytest.raises(ValueError, match="GSPN2_DWCONV_KERNEL"):
        options.from_env({"GSPN2_DWCONV_KERNEL": "tensor"})
    for name, value in (("dwconv_tile_cols", 2), ("dwconv_kernel", "row"), ("dwconv", "fast")):
        with pytest.raises(ValueError, match=name):
            options.set_options(**{name: value})
    x, w = torch.randn(1, 4, 5, 5), torch.randn(4, 1, 3, 3)
    for kernel, cols in ((4, 8), (0, 2)):
        match = "`kernel` must be 0, 1 or 2" if kernel == 4 else "`cols` must be 4 or 8"
        with pytest.raises(ValueError, match=match):
            torch.ops.gspn2.depthwise_conv2d(x, w, None, False, False, kernel, cols)
    # kernel 2 (the tensor-core kernels) on the CPU: the op's reference, any dtype
    y = torch.ops.gspn2.depthwise_conv2d(x, w, None, False, False, 2, 4)
    torch.testing.assert_close(y, _reference(x, w, None, False))


def test_tensor_core_family_refuses_what_it_cannot_run_on_fake_cuda_tensors():
    """``kernel`` 2 takes 16-bit inputs with C a multiple of 8; the fake implementations (torch.compile's view
    of a CUDA call) refuse the rest as the CUDA implementation does, naming ``kernel``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda_fake = FakeTensorMode(allow_non_fake_inputs=True)
    with cuda_fake:
        for C, dtype, err, match in ((16, torch.float32, TypeError, "float16 or bfloat16 `{}`"),
                                     (20, torch.bfloat16, ValueError, "multiple of 8, got C = 20")):
            x = torch.empty(2, C, 9, 9, dtype=dtype, device="cuda")
            w = torch.empty(C, 1, 3, 3, device="cuda")
            with pytest.raises(err, match=match.format("x")):
                torch.ops.gspn2.depthwise_conv2d(x, w, None, False, False, 2, 4)
            with pytest.raises(err, match=match.format("grad_y")):
                torch.ops.gspn2.depthwise_conv2d_backward(x, x, w, False, False, 2, 4)
        x = torch.empty(2, 16, 9, 9, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(16, 1, 3, 3, device="cuda")
        assert torch.ops.gspn2.depthwise_conv2d(x, w, None, False, False, 2, 8).shape == x.shape


@cuda
@pytest.mark.cuda
def test_cuda_kernel_variant_is_validated():
    x, w, b = _cuda_case(1, 8, 5, 5, 3, torch.float32)
    for kernel, cols, match in ((3, 8, "`kernel` must be 0, 1 or 2"), (-1, 4, "`kernel` must be 0, 1 or 2"),
                                (0, 2, "`cols` must be 4 or 8")):
        with pytest.raises(ValueError, match=match):
            torch.ops.gspn2.depthwise_conv2d(x, w, b, False, False, kernel, cols)
    # the tensor-core kernels: 16-bit inputs with C a multiple of 8, refused before anything runs
    with pytest.raises(TypeError, match="float16 or bfloat16 `x`"):
        torch.ops.gspn2.depthwise_conv2d(x, w, b, False, False, 2, 4)
    with pytest.raises(TypeError, match="float16 or bfloat16 `grad_y`"):
        torch.ops.gspn2.depthwise_conv2d_backward(x, x, w, True, False, 2, 4)
    x, w, b = _cuda_case(1, 12, 5, 5, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8, got C = 12"):
        torch.ops.gspn2.depthwise_conv2d(x, w, b, False, False, 2, 4)


def test_forced_kernel_explains_why_it_cannot_run():
    options.set_options(dwconv="cuda")
    x = torch.randn(1, 4, 5, 5)  # NCHW memory, K = 9
    with pytest.raises(ValueError, match="channels_last.*|kernel size 9"):
        D._use_kernel(x, torch.randn(4, 1, 9, 9))


def test_auto_gives_the_kernel_the_3x3_and_7x7():
    options.set_options(dwconv="auto")
    x = torch.randn(1, 4, 5, 5).to(memory_format=torch.channels_last)
    assert D._use_kernel(x, torch.randn(4, 1, 3, 3)) == D.kernel_available()
    assert D._use_kernel(x, torch.randn(4, 1, 7, 7)) == D.kernel_available()
    assert not D._use_kernel(x, torch.randn(4, 1, 5, 5))  # cuDNN: not measured on a model's shapes
    assert not D._use_kernel(x.contiguous(), torch.randn(4, 1, 3, 3))  # NCHW memory
    options.set_options(dwconv="cuda")
    assert D._use_kernel(x, torch.randn(4, 1, 5, 5)) == D.kernel_available()


def test_kernel_family_options_give_the_op_variant():
    options.set_options(dwconv_kernel="auto", dwconv_tile_cols=8)
    # auto: its own backward and columns per kernel size, whatever dwconv_tile_cols says
    assert [D.variant(k) for k in (3, 5, 7)] == [(1, 8), (0, 4), (0, 4)]
    options.set_options(dwconv_tile_cols=4)
    assert D.variant(3) == (1, 8)
    options.set_options(dwconv_kernel="tile", dwconv_tile_cols=8)
    assert D.variant(7) == (0, 8)
    options.set_options(dwconv_kernel="fused", dwconv_tile_cols=4)
    assert D.variant(3) == (1, 4)
    options.set_options(dwconv_kernel="mma", dwconv_tile_cols=8)
    assert D.variant(7) == (2, 8)
    with pytest.raises(ValueError, match="dwconv_kernel"):
        options.set_options(dwconv_kernel="tiles")


@pytest.mark.parametrize(
    "K,add,silu,bias", [(3, True, False, True), (5, False, True, False), (7, False, True, True)]
)
def test_stencil_matches_conv2d_and_gradcheck(K, add, silu, bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(3, 1, K, K, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True) if bias else None
    torch.testing.assert_close(D.stencil_conv2d(x, w, b, add, silu), _reference(x, w, b, add, silu))
    inputs = (x, w, b) if bias else (x, w)
    def fn(*t):
        return D.stencil_conv2d(t[0], t[1], t[2] if bias else None, add, silu)

    assert torch.autograd.gradcheck(fn, inputs)


def test_stencil_accumulates_16bit_input_in_float32():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 9, 9).to(torch.bfloat16)
    w, b = torch.randn(8, 1, 7, 7), torch.randn(8)
    y = D.stencil_conv2d(x, w, b, add_input=True)
    assert y.dtype == torch.bfloat16
    exact = _reference(x.double(), w.double(), b.double(), True)
    # One rounding to bfloat16 at the end: within half an ulp (2^-8 relative) of the float64 result.
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()


def test_stencil_traces_under_compile():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 6, 7, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(4, 1, 3, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    fn = torch.compile(lambda t: D.stencil_conv2d(t, w, b, True, True).square().sum(), backend="aot_eager",
                       fullgraph=True)
    (g,) = torch.autograd.grad(fn(x), x)
    (ref,) = torch.autograd.grad(_reference(x, w, b, True, True).square().sum(), x)
    torch.testing.assert_close(g, ref)


def test_stencil_option_routes_cuda_calls_only(monkeypatch):
    options.set_options(dwconv="stencil")
    x, w = torch.randn(1, 4, 5, 5, dtype=torch.float64), torch.randn(4, 1, 3, 3, dtype=torch.float64)
    calls = []
    monkeypatch.setattr(D, "stencil_conv2d", lambda *a: calls.append(a))
    # CPU tensors: the op (F.conv2d), whatever the option
    torch.testing.assert_close(depthwise_conv2d(x, w), _reference(x, w, None, False))
    assert not calls
    assert options.from_env({"GSPN2_DWCONV": "Stencil"}).dwconv == "stencil"


# ----------------------------------------------------------------------------------------------- GPU


def _cuda_case(N, C, H, W, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, C, H, W, device="cuda", generator=g).to(dtype, memory_format=torch.channels_last)
    w = torch.randn(C, 1, K, K, device="cuda", generator=g) * 0.2
    b = torch.randn(C, device="cuda", generator=g)
    return x, w, b


def _grads(backend, x, w, b, add, gy):
    options.set_options(dwconv=backend)
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = depthwise_conv2d(xs, ws, bs, add)
    return (y, *torch.autograd.grad(y, (xs, ws, bs), gy))


@cuda
@pytest.mark.cuda
def test_cuda_extension_has_the_kernel():
    assert D.kernel_available()
    for op, key in (("depthwise_conv2d", "CUDA"), ("depthwise_conv2d_backward", "CUDA"), ("depthwise_conv2d", "AutogradCUDA")):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gspn2::{op}", key), (op, key)


def _assert_matches_cudnn_fp32(N, C, H, W, K, add):
    """Output and gradients of the current kernel variant against cuDNN (TF32 off), float32; returns ours."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        x, w, b = _cuda_case(N, C, H, W, K, torch.float32)
        gy = torch.randn_like(x)
        ref = _grads("cudnn", x, w, b, add, gy)
        out = _grads("cuda", x, w, b, add, gy)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    for name, o, r in zip(("y", "grad_x", "grad_w", "grad_b"), out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=name)
    return out


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["t0v4", "t0v8", "t1v4", "t1v8"])
@pytest.mark.parametrize("shape", [(2, 80, 56, 56, 3, True), (3, 120, 28, 20, 7, False), (1, 200, 7, 7, 7, True),
                                   (2, 17, 9, 33, 5, True), (1, 960, 7, 7, 3, False), (2, 6, 3, 1, 7, False)])
def test_cuda_kernel_matches_cudnn_fp32(shape, variant):
    _set_variant(variant)
    out = _assert_matches_cudnn_fp32(*shape)
    assert out[0].is_contiguous(memory_format=torch.channels_last)
    assert out[1].is_contiguous(memory_format=torch.channels_last)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["t0v4", "t0v8", "t1v4", "t1v8"])
@pytest.mark.parametrize("shape", [(41, 1024, 7, 7, 3, True), (41, 1024, 7, 7, 7, False)])
def test_cuda_weight_gradient_over_multi_tile_chunks(shape, variant):
    """The tile kernels' backward CTAs loop over several tiles, double-buffered, with a shorter last chunk."""
    N, C, H, W, K, add = shape
    q = _cuda.dwconv_plan(N, C, H, W, K, "float32", cols=int(variant[3]))
    assert q["tiles_per_chunk"] > 1 and q["tiles"] % q["tiles_per_chunk"] != 0, q  # the case this test is for
    _set_variant(variant)
    _assert_matches_cudnn_fp32(N, C, H, W, K, add)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["t0v4", "t0v8"])
@pytest.mark.parametrize("K", [3, 7])
def test_cuda_forward_over_many_tiles_per_cta(K, variant):
    """The tile forward (and the input gradient, the same kernel) runs as many CTAs as fit on the GPU at once,
    each looping over tiles, double-buffered. 128 images of 56^2 on one channel block are more than twice the
    CTA tiles that 8 CTAs per SM could hold, so every CTA computes several, some one more than others."""
    N, C, H, W = 128, 32, 56, 56
    q = _cuda.dwconv_plan(N, C, H, W, K, "float32", cols=int(variant[3]))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert q["channel_blocks"] == 1 and q["tiles"] > 2 * 8 * sms, q  # more than 8 resident CTAs per SM could take
    _set_variant(variant)
    _assert_matches_cudnn_fp32(N, C, H, W, K, K == 3)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("C,K", [(120, 7), (26, 7), (80, 3), (20, 5)])  # 8 or 4 channels, 1, 4 channels
@pytest.mark.parametrize("variant", ["t0v4", "t0v8", "t1v4", "t1v8"])
def test_cuda_16bit_error_no_larger_than_cudnn(dtype, C, K, variant):
    _set_variant(variant)
    x, w, b = _cuda_case(4, C, 28, 28, K, dtype)
    gy = torch.randn_like(x)
    exact = _grads("cudnn", x.double(), w.double(), b.double(), False, gy.double())
    errs = {}
    for backend in ("cudnn", "cuda"):
        errs[backend] = [((o.double() - e).abs().max() / e.abs().max()).item()
                         for o, e in zip(_grads(backend, x, w, b, False, gy), exact)]
    # float32 weights and accumulation: at most the cuDNN 16-bit error (x2 margin), every output
    assert all(t <= 2 * c + 1e-3 for t, c in zip(errs["cuda"], errs["cudnn"])), errs


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 80, 56, 56, 3, True), (3, 120, 28, 20, 7, False),
                                   (1, 200, 7, 7, 7, True), (2, 24, 9, 33, 5, True), (1, 960, 7, 7, 3, False),
                                   (2, 16, 3, 1, 7, False), (2, 40, 17, 12, 7, True), (1, 8, 14, 14, 3, False)])
def test_cuda_tensor_core_kernels_error_no_larger_than_cudnn(shape, dtype):
    """``kernel`` 2: the forward and input gradient as Toeplitz products on the tensor cores (tiles of 8, 16 and
    32 columns, partial channel blocks, maps narrower than a tile), with ``add_input`` folded into the centre
    tap; outputs and gradients against float64, no less accurate than cuDNN in the same dtype."""
    N, C, H, W, K, add = shape
    _set_variant("t2v4")
    x, w, b = _cuda_case(N, C, H, W, K, dtype)
    gy = torch.randn_like(x)
    exact = _grads("cudnn", x.double(), w.double(), b.double(), add, gy.double())
    errs = {}
    for backend in ("cudnn", "cuda"):
        got = _grads(backend, x, w, b, add, gy)
        assert all(t.is_contiguous(memory_format=torch.channels_last) for t in got[:2])
        errs[backend] = [((o.double() - e).abs().max() / e.abs().max()).item() for o, e in zip(got, exact)]
    assert all(t <= 2 * c + 1e-3 for t, c in zip(errs["cuda"], errs["cudnn"])), errs


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("K,add", [(3, True), (7, False)])
def test_cuda_tensor_core_weight_gradient_over_multi_tile_chunks(K, add):
    """Kernel 2's weight-gradient CTAs sum several tiles each, double-buffered, with a shorter last chunk; the
    partial sums of the chunks are added in order."""
    N, C, H, W = 41, 1024, 7, 7
    q = _cuda.dwconv_mma_plan(N, C, H, W)
    assert q["tiles_per_chunk"] > 1 and q["tiles"] % q["tiles_per_chunk"] != 0, q  # the case this test is for
    _set_variant("t2v4")
    x, w, b = _cuda_case(N, C, H, W, K, torch.bfloat16)
    gy = torch.randn_like(x)
    exact = _grads("cudnn", x.double(), w.double(), b.double(), add, gy.double())
    ours = _grads("cuda", x, w, b, add, gy)
    cudnn = _grads("cudnn", x, w, b, add, gy)
    for name, o, c, e in zip(("y", "grad_x", "grad_w", "grad_b"), ours, cudnn, exact):
        scale = e.abs().max().item()
        ours_err, cudnn_err = ((t.double() - e).abs().max().item() for t in (o, c))
        assert ours_err <= 2 * cudnn_err + 1e-3 * scale, name


@cuda
@pytest.mark.cuda
def test_cuda_tensor_core_kernels_silu_and_many_tiles_per_cta():
    """The persistent CTAs of kernel 2 over many tiles each (128 images of 56^2 on one channel block), with the
    fused SiLU, against the tile kernels' float32-tap result (same dtype)."""
    x, w, b = _cuda_case(128, 32, 56, 56, 7, torch.bfloat16)
    options.set_options(dwconv="cuda")
    with torch.no_grad():
        _set_variant("t2v4")
        ours = depthwise_conv2d(x, w, b, silu=True)
        _set_variant("t0v4")
        tile = depthwise_conv2d(x, w, b, silu=True)
    torch.testing.assert_close(ours.float(), tile.float(), rtol=2e-2, atol=2e-2)
    # taps to about 16 bits against float32: mostly the same rounding
    assert (ours != tile).float().mean() < 0.1


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["t0v4", "t1v8"])
@pytest.mark.parametrize("shape", [(2, 80, 56, 56, 3, True), (3, 120, 28, 20, 7, False),
                                   (2, 16, 9, 33, 5, True)])
def test_cuda_cp_async_staging_matches_tma(shape, variant, dtype):
    """On sm_90 the tiles arrive by TMA; builds without sm_90 code stage them by cp.async (the path
    ``_cuda.dwconv_tma(False)`` forces here). Both put the same bytes where the kernels read them, so the
    outputs and all three gradients are bitwise equal (the weight gradient's summation order is the
    plan's)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA staging needs sm_90; without it every call already stages by cp.async")
    N, C, H, W, K, add = shape
    _set_variant(variant)
    x, w, b = _cuda_case(N, C, H, W, K, dtype)
    gy = torch.randn_like(x)
    assert _cuda.dwconv_tma(True) is True  # the default
    with_tma = _grads("cuda", x, w, b, add, gy)
    try:
        assert _cuda.dwconv_tma(False) is True
        with_cp_async = _grads("cuda", x, w, b, add, gy)
    finally:
        _cuda.dwconv_tma(True)
    for name, t, c in zip(("y", "grad_x", "grad_w", "grad_b"), with_tma, with_cp_async):
        assert torch.equal(t, c), name


@cuda
@pytest.mark.cuda
def test_cuda_silu_fused_forward():
    options.set_options(dwconv="cuda")
    x, w, b = _cuda_case(2, 48, 20, 19, 7, torch.float32)
    with torch.no_grad():
        y = depthwise_conv2d(x, w, b, silu=True)
    torch.testing.assert_close(y, F.silu(depthwise_conv2d(x, w, b)), rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["t0v4", "t0v8", "t1v4", "t1v8", "t2v4"])
@pytest.mark.parametrize("K", [3, 7])
def test_cuda_deterministic(variant, K):
    options.set_options(dwconv="cuda")
    _set_variant(variant)
    x, w, b = _cuda_case(8, 160, 28, 28, K, torch.bfloat16)
    gy = torch.randn_like(x)
    a = _grads("cuda", x, w, b, True, gy)
    c = _grads("cuda", x, w, b, True, gy)
    assert all(torch.equal(p, q) for p, q in zip(a, c))


@cuda
@pytest.mark.cuda
def test_cuda_compile_fullgraph():
    options.set_options(dwconv="cuda")
    x, w, b = _cuda_case(2, 32, 14, 14, 3, torch.bfloat16)
    x.requires_grad_()
    fn = torch.compile(lambda x: depthwise_conv2d(x, w, b, True).float().square().sum(), fullgraph=True)
    (g,) = torch.autograd.grad(fn(x), x)
    (ref,) = torch.autograd.grad(depthwise_conv2d(x, w, b, True).float().square().sum(), x)
    torch.testing.assert_close(g, ref)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("K,add,silu", [(3, True, False), (7, False, True)])
def test_cuda_stencil_under_inductor_error_no_larger_than_cudnn(K, add, silu):
    x, w, b = _cuda_case(4, 48, 13, 14, K, torch.bfloat16)
    gy = torch.randn_like(x)

    def grads(fn, x, w, b):
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        return (y, *torch.autograd.grad(y, (xs, ws, bs), gy.to(y.dtype)))

    options.set_options(dwconv="stencil")
    compiled = torch.compile(lambda *t: depthwise_conv2d(*t, add_input=add, silu=silu), fullgraph=True)
    ours = grads(compiled, x, w, b)
    options.set_options(dwconv="cudnn")
    cudnn = grads(lambda *t: depthwise_conv2d(*t, add_input=add, silu=silu), x, w, b)
    exact = grads(lambda *t: _reference(*t, add, silu), x.double(), w.double(), b.double())
    for o, c, e in zip(ours, cudnn, exact):
        scale = e.abs().max()
        assert (o.double() - e).abs().max() / scale <= 2 * (c.double() - e).abs().max() / scale + 1e-3
