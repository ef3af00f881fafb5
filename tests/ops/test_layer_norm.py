"""``gspn2.ops.layer_norm``: the reference against ``F.layer_norm`` (and ``F.gelu``), the op's ATen formula and
its backward against autograd (float64 gradcheck), argument errors, opcheck, the option, the stem's fused
path against its modules; on a GPU the kernel against the float64 reference (fp32, bf16, fp16; every lane
and vector layout the planner picks), its gradients, determinism, odd layouts, and the training chains that
call it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401
from gspn2.layers import LayerNorm2d, norm_linear
from gspn2.ops import layer_norm, layer_norm_ref
from gspn2.ops import layernorm as LN
from gspn2.ops import options

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
OP = torch.ops.gspn2.layer_norm.default
BACKWARD = torch.ops.gspn2.layer_norm_backward.default


def _inputs(shape=(7, 5), dtype=torch.float64, device="cpu", seed=0, params=True):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(device=device, dtype=dtype)
    w = (1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64)).to(device) if params else None
    b = (0.3 * torch.randn(C, generator=g, dtype=torch.float64)).to(device) if params else None
    return x, w, b


@pytest.mark.parametrize("gelu", [False, True])
def test_reference_is_layer_norm_then_gelu(gelu):
    x, w, b = _inputs((3, 4, 6))
    want = F.layer_norm(x, (6,), w, b, 1e-6)
    want = F.gelu(want) if gelu else want
    torch.testing.assert_close(layer_norm_ref(x, w, b, 1e-6, gelu), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("params", [True, False])
def test_op_formula_matches_reference_and_gradcheck(gelu, params):
    x, w, b = _inputs((2, 3, 5), params=params)
    y, mean, rstd = OP(x, w, b, 1e-5, gelu)
    torch.testing.assert_close(y, layer_norm_ref(x, w, b, 1e-5, gelu), rtol=1e-12, atol=1e-12)
    assert mean.shape == rstd.shape == (2, 3) and mean.dtype == torch.float32
    tensors = [t.requires_grad_() for t in (x, w, b) if t is not None]

    def f(*ts):
        xx, ww, bb = (ts + (None, None))[:3] if params else (ts[0], None, None)
        return OP(xx, ww, bb, 1e-5, gelu)[0]

    # The op's backward (ATen formula, float32 statistics) against numerical derivatives: float32 statistics
    # limit the agreement to about 1e-6.
    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=2e-5, rtol=1e-4)


def test_backward_masks_and_empty_outputs():
    x, w, b = _inputs((4, 6))
    _, mean, rstd = OP(x, w, b, 1e-5, False)
    g = torch.randn_like(x)
    gx, gw, gb = BACKWARD(g, x, mean, rstd, w, b, False, [True, False, True])
    assert gx.shape == x.shape and gw.numel() == 0 and gb.shape == (6,)
    gx, gw, gb = BACKWARD(g, x, mean, rstd, None, None, False, [False, True, True])
    assert gx.numel() == 0 and gw.numel() == 0 and gb.numel() == 0


def test_public_entry_on_cpu_is_layer_norm_in_x_dtype():
    x, w, b = _inputs((5, 8), dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer_norm(x, w, b, 1e-6)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.layer_norm(x, (8,), w.to(x.dtype), b.to(x.dtype), 1e-6))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w, b: layer_norm(x, w[:-1], b), r"`weight` must be \(C,\) with C = 5"),
        (lambda x, w, b: layer_norm(x, w, b.view(1, -1)), r"`bias` must be \(C,\)"),
        (lambda x, w, b: layer_norm(x, w, b, eps=-1.0), r"`eps` must be a float >= 0"),
        (lambda x, w, b: layer_norm(x[:, :0], None, None), r"`x` must have a non-empty last dimension"),
        (lambda x, w, b: OP(x, w, b, 1e-5, False) and BACKWARD(x[:1], x, x[:, 0].float(), x[:, 0].float(), w, b,
                                                             False, [True, True, True]),
         r"`grad_y` must match `x`"),
        (lambda x, w, b: BACKWARD(x, x, x[:, 0], x[:, 0].float(), w, b, False, [True, True, True]),
         r"`mean` must be float32 with one value per row"),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    x, w, b = _inputs((7, 5))
    with pytest.raises(ValueError, match=match):
        call(x, w, b)


def test_bad_types():
    x, w, b = _inputs((3, 4))
    with pytest.raises(TypeError, match="`gelu` must be a bool"):
        layer_norm(x, w, b, gelu=1)
    with pytest.raises(TypeError, match="`x` must be a torch.Tensor"):
        layer_norm([1.0, 2.0])
    with pytest.raises(TypeError, match="`x` must be float16, bfloat16, float32 or float64"):
        layer_norm(torch.ones(2, 3, dtype=torch.int64))


def test_opcheck():
    x, w, b = _inputs((3, 6), dtype=torch.float32)
    for gelu in (False, True):
        torch.library.opcheck(OP, (x.requires_grad_(), w.float().requires_grad_(), b.float(), 1e-5, gelu))
    _, mean, rstd = OP(x.detach(), w, b, 1e-5, False)
    torch.library.opcheck(BACKWARD, (torch.randn_like(x), x.detach(), mean, rstd, w, b, True, [True, True, False]))


def test_option_parses_and_validates():
    assert options.from_env({"GSPN2_LAYER_NORM": "ATEN"}).layer_norm == "aten"
    with pytest.raises(ValueError, match="GSPN2_LAYER_NORM must be one of auto, cuda, aten"):
        options.from_env({"GSPN2_LAYER_NORM": "fast"})
    x, _, _ = _inputs((3, 8), dtype=torch.float32)
    with options.override(layer_norm="cuda"):
        assert not LN.use_kernel(x)  # a CPU tensor: the ATen formula, no error
    assert not LN.kernel_supported(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stem_forward_is_its_modules_in_order(dtype):
    model = gspn2.models.gspn2.GSPN2(num_classes=0, depths=(1, 1, 1, 1), dims=(16, 16, 16, 16)).eval()
    stem = model.stem
    x = torch.randn(2, 3, 20, 18).to(dtype)
    stem = stem.to(dtype)
    with torch.no_grad():
        want = stem[4](stem[3](stem[2](stem[1](stem[0](x)))))
        assert torch.equal(stem(x), want)
        assert torch.equal(stem[1].forward_gelu(stem[0](x)), F.gelu(stem[1](stem[0](x))))


# ---- CUDA --------------------------------------------------------------------------------------------------

# (C, dtype): 16-byte vectors on 1 .. 32 lanes with 1 .. 8 vectors per lane, 4-byte vectors (C not a
# multiple of 8 / 4), the models' widths (40 .. 960, small's 44 and 88), the longest rows.
CUDA_CASES = [
    (40, torch.bfloat16), (80, torch.bfloat16), (120, torch.bfloat16), (44, torch.bfloat16), (88, torch.float16),
    (960, torch.bfloat16), (640, torch.float16), (2048, torch.bfloat16), (2, torch.bfloat16), (6, torch.float16),
    (1, torch.float32), (3, torch.float32), (40, torch.float32), (120, torch.float32), (1000, torch.float32),
    (1024, torch.float32), (130, torch.bfloat16), (8, torch.bfloat16),
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


@cuda
@pytest.mark.parametrize("C, dtype", CUDA_CASES)
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_matches_float64_reference(C, dtype, gelu):
    x, w, b = _inputs((37, 5, C), device="cuda", seed=C)
    x = x.to(dtype)
    assert LN.kernel_supported(x)
    xr = x.double().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    want = layer_norm_ref(xr, wr, br, 1e-6, gelu)
    g = torch.randn_like(want).to(dtype)  # the kernel's grad_y, in float64 for the reference
    want.backward(g.double())
    xk = x.clone().requires_grad_()
    wk, bk = w.float().requires_grad_(), b.float().requires_grad_()
    y = layer_norm(xk, wk, bk, 1e-6, gelu)
    assert y.dtype == dtype and y.is_contiguous()
    y.backward(g)
    torch.testing.assert_close(y.double(), want.detach(), **TOL[dtype])
    # grad_x carries a factor rstd: rows of 1 to 3 channels can have a tiny variance (C = 1: rstd = eps**-0.5
    # and grad_x is rounding noise around 0), so its tolerance scales with the largest rstd
    rstd = torch.rsqrt(x.double().var(-1, correction=0) + 1e-6).max().item()
    torch.testing.assert_close(xk.grad.double(), xr.grad, rtol=TOL[dtype]["rtol"],
                               atol=TOL[dtype]["atol"] * max(1.0, rstd))
    # the parameters' gradients sum 185 rows
    scale = dict(rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * 20)
    torch.testing.assert_close(wk.grad.double(), wr.grad, **scale)
    torch.testing.assert_close(bk.grad.double(), br.grad, **scale)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_without_parameters_and_many_rows(dtype):
    x, _, _ = _inputs((3, 100_003, 40), device="cuda")
    x = x.to(dtype)
    y, mean, rstd = OP(x, None, None, 1e-5, True)
    torch.testing.assert_close(y.double(), layer_norm_ref(x.double(), None, None, 1e-5, True), **TOL[dtype])
    var, m = torch.var_mean(x.double(), -1, correction=0)
    torch.testing.assert_close(mean.double(), m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-4, atol=1e-4)


@cuda
@pytest.mark.parametrize("C, dtype", [(80, torch.bfloat16), (320, torch.bfloat16), (960, torch.bfloat16),
                                      (130, torch.bfloat16), (120, torch.float32)])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_parameter_gradients_over_many_rows(C, dtype, gelu):
    # Enough rows that every warp of the backward's one wave walks several row groups and every block sums
    # its warps' columns: the weight and bias gradients against the float64 reference.
    x, w, b = _inputs((50_003, C), device="cuda", seed=C + gelu)
    x = x.to(dtype)
    g = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    layer_norm_ref(x.double(), wr, br, 1e-6, gelu).backward(g.double())
    wk, bk = w.float().requires_grad_(), b.float().requires_grad_()
    xk = x.clone().requires_grad_()
    layer_norm(xk, wk, bk, 1e-6, gelu).backward(g)
    # float32 sums of 50 003 products: an absolute tolerance of a few thousandths of the sums' size (~220)
    torch.testing.assert_close(wk.grad.double(), wr.grad, rtol=1e-4, atol=5e-3)
    torch.testing.assert_close(bk.grad.double(), br.grad, rtol=1e-4, atol=5e-3)


@cuda
def test_kernel_is_deterministic():
    x, w, b = _inputs((64, 56, 56, 80), device="cuda")
    x, w, b = x.bfloat16(), w.float().requires_grad_(), b.float().requires_grad_()
    g = torch.randn_like(x)
    runs = []
    for _ in range(2):
        xx = x.clone().requires_grad_()
        layer_norm(xx, w, b, 1e-6, True).backward(g)
        runs.append((xx.grad.clone(), w.grad.clone(), b.grad.clone()))
        w.grad = b.grad = None
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@cuda
def test_kernel_on_channels_last_views_and_misaligned_rows():
    x = torch.randn(4, 40, 9, 7, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    norm = LayerNorm2d(40).cuda()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
        norm.bias.normal_(0, 0.2)
        want = layer_norm_ref(x.permute(0, 2, 3, 1).double(), norm.weight, norm.bias, norm.eps).permute(0, 3, 1, 2)
        y = norm(x)
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])
        flat = torch.randn(5 * 40 + 2, device="cuda")[2:].view(5, 40)  # 8-byte aligned rows: copied to aligned ones
        torch.testing.assert_close(layer_norm(flat, None, None).double(), layer_norm_ref(flat.double()), **TOL[torch.float32])
        strided = torch.randn(6, 80, device="cuda")[:, ::2]
        torch.testing.assert_close(layer_norm(strided).double(), layer_norm_ref(strided.double()), **TOL[torch.float32])


@cuda
@pytest.mark.parametrize("C, dtype", [(2048, torch.bfloat16), (2056, torch.bfloat16), (1002, torch.bfloat16),
                                      (510, torch.float16), (514, torch.float16), (1024, torch.float32),
                                      (256, torch.float32), (258, torch.float32), (5, torch.bfloat16)])
def test_kernel_supported_is_what_the_kernel_takes(C, dtype):
    x = torch.randn(3, C, device="cuda", dtype=dtype)
    if LN.kernel_supported(x):
        torch.testing.assert_close(OP(x, None, None, 1e-5, False)[0].double(), layer_norm_ref(x.double()),
                                   **TOL[dtype])
    else:
        with pytest.raises(ValueError, match="the CUDA kernel takes rows of C"):
            OP(x, None, None, 1e-5, False)
        torch.testing.assert_close(layer_norm(x).double(), layer_norm_ref(x.double()), **TOL[dtype])  # ATen


@cuda
def test_option_choices_on_cuda():
    x = torch.randn(4, 5, device="cuda", dtype=torch.bfloat16)  # 10-byte rows: not the kernel's
    assert not LN.kernel_supported(x) and not LN.use_kernel(x)
    with options.override(layer_norm="cuda"):
        with pytest.raises(ValueError, match="GSPN2_LAYER_NORM=cuda, but the LayerNorm kernel cannot take `x`"):
            layer_norm(x)
    y = torch.randn(4, 8, device="cuda")
    assert LN.use_kernel(y)
    with options.override(layer_norm="aten"):
        assert not LN.use_kernel(y)
    with pytest.raises(ValueError, match="the CUDA kernel takes rows of C"):
        OP(x, None, None, 1e-5, False)


@cuda
@pytest.mark.parametrize("with_gate", [False, True])
def test_training_chain_with_the_kernel_matches_aten_norm(with_gate):
    torch.manual_seed(0)
    x = torch.randn(300, 120, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn(300, 120, device="cuda", dtype=torch.bfloat16) if with_gate else None
    nw = torch.randn(120, device="cuda").mul(0.2).add(1).requires_grad_()
    nb = torch.randn(120, device="cuda").mul(0.2).requires_grad_()
    w = torch.randn(64, 120, device="cuda").mul(0.05).requires_grad_()
    results = {}
    for choice in ("auto", "aten"):
        with options.override(layer_norm=choice):
            for t in (x, nw, nb, w):
                t.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                (out,) = norm_linear(x, nw, nb, 1e-6, w, None, chunks=1, gate=gate)
            out.float().square().sum().backward()
            results[choice] = [out.detach().float()] + [t.grad.float().clone() for t in (x, nw, nb, w)]
    for a, b in zip(results["auto"], results["aten"]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))
