"""``gspn2.ops.gelu_linear``: the op against ``F.linear(F.gelu(h))`` (CPU, float64 gradcheck, opcheck), its
written-out backward against autograd of the reference, argument errors, the FLOP count, autocast, the Triton
kernels on the CPU through Triton's interpreter (float32, float16: the interpreter's bfloat16 products are
wrong), and on a GPU the kernels against float64 (bf16, fp16: at most twice the error of the separate ops at
that precision), determinism and ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gspn2  # noqa: F401
from gspn2.ops import gelu_linear, gelu_linear_ref
from gspn2.ops.gelu_gemm import gelu_linear_backward_ref, triton_available
from tests.ops._interpreter import run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _inputs(M=13, K=24, N=10, dtype=torch.float64, device="cpu", seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    return r(M, K), r(N, K, scale=K**-0.5), (r(N) if bias else None)


def test_reference_is_gelu_then_linear():
    h, w, b = _inputs()
    torch.testing.assert_close(gelu_linear_ref(h, w, b), F.linear(F.gelu(h), w, b))
    torch.testing.assert_close(gelu_linear(h, w, None), F.linear(F.gelu(h), w))


@pytest.mark.parametrize("bias", [True, False])
def test_cpu_op_gradcheck_and_backward_formulas(bias):
    h, w, b = (t.requires_grad_() if t is not None else None for t in _inputs(M=5, K=6, N=4, bias=bias))
    args = (h, w) + ((b,) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: gelu_linear(a[0], a[1], a[2] if bias else None), args)
    out = gelu_linear(h, w, b)
    go = torch.randn_like(out)
    expected = torch.autograd.grad(F.linear(F.gelu(h), w, b), args, go)
    grad_h, grad_w, grad_b = gelu_linear_backward_ref(go, h.detach(), w.detach(), bias)
    torch.testing.assert_close(grad_h, expected[0])
    torch.testing.assert_close(grad_w, expected[1])
    if bias:
        torch.testing.assert_close(grad_b, expected[2])
    else:
        assert grad_b.numel() == 0


def test_opcheck():
    h, w, b = (t.requires_grad_() for t in _inputs(M=7, K=8, N=3, dtype=torch.float32))
    torch.library.opcheck(torch.ops.gspn2.gelu_linear.default, (h, w, b))
    torch.library.opcheck(torch.ops.gspn2.gelu_linear.default, (h, w, None))
    go = torch.randn(7, 3)
    torch.library.opcheck(torch.ops.gspn2.gelu_linear_backward.default, (go, h.detach(), w.detach(), True))


def test_autocast_casts_all_three():
    h, w, b = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gelu_linear(h, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, gelu_linear_ref(h.bfloat16(), w.bfloat16(), b.bfloat16()))


@pytest.mark.parametrize(
    "name,args,error,match",
    [
        ("h rank", (torch.zeros(2, 3, 4), torch.zeros(5, 4), None), ValueError, "`h` must be"),
        ("weight K", (torch.zeros(2, 4), torch.zeros(5, 3), None), ValueError, "`weight` must be"),
        ("bias shape", (torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(4)), ValueError, "`bias` must be"),
        ("weight dtype", (torch.zeros(2, 4), torch.zeros(5, 4, dtype=torch.float64), None), TypeError, "`weight`"),
        ("int h", (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(5, 4), None), TypeError, "`h`"),
        ("not a tensor", ([[1.0]], torch.zeros(5, 1), None), TypeError, "`h` must be a torch.Tensor"),
        ("bias not a tensor", (torch.zeros(2, 4), torch.zeros(5, 4), 1.0), TypeError, "`bias` must be"),
    ],
)
def test_errors_name_the_argument(name, args, error, match):
    with pytest.raises(error, match=match):
        gelu_linear(*args)


def test_backward_errors_name_the_argument():
    h, w, _ = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="`grad_out` must be"):
        torch.ops.gspn2.gelu_linear_backward(torch.zeros(3, 3), h, w, True)


def test_flop_count():
    h, w, b = (t.requires_grad_() for t in _inputs(M=10, K=6, N=4, dtype=torch.float32))
    with FlopCounterMode(display=False) as counter:
        gelu_linear(h, w, b).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.gspn2.gelu_linear] == 2 * 10 * 6 * 4
    assert counts[torch.ops.gspn2.gelu_linear_backward] == 4 * 10 * 6 * 4


# ---- the Triton kernels on the CPU, through Triton's interpreter ----

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from gspn2.ops import _gelu_gemm_triton as K
    from gspn2.ops.gelu_gemm import gelu_linear_backward_ref, gelu_linear_ref, triton_backward, triton_forward

    # (M, K, N, dtype, bias): rows not a multiple of the row block, several inner steps, output columns that
    # do not fill their block, more than one column tile, a group of row tiles cut short.
    cases = [(37, 48, 24, torch.float16, True), (130, 64, 80, torch.float32, False),
             (70, 40, 20, torch.float32, True), (45, 96, 40, torch.float16, True)]
    for M, Kd, N, dt, bias in cases:
        g = torch.Generator().manual_seed(M)
        h = torch.randn(M, Kd, generator=g).to(dt)
        w = (torch.randn(N, Kd, generator=g) / Kd**0.5).to(dt)
        b = torch.randn(N, generator=g).to(dt) if bias else None
        go = torch.randn(M, N, generator=g).to(dt)
        fc = dict(K.forward_config(N, Kd), block_m=32, block_n=16, group_m=2)
        bc = dict(K.backward_config(N, Kd), block_m=32, block_k=16, group_m=2)
        out = triton_forward(h, w, b, fc)
        ref = gelu_linear_ref(h.double(), w.double(), None if b is None else b.double())
        tol = dict(rtol=2e-3, atol=2e-3) if dt == torch.float16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), ref, **tol)
        mine = triton_backward(go, h, w, bias, bc)
        exp = gelu_linear_backward_ref(go.double(), h.double(), w.double(), bias)
        for name, a, r in zip(("h", "weight", "bias"), mine, exp):
            scale = max(r.abs().max().item(), 1.0) if r.numel() else 1.0
            torch.testing.assert_close(a.double() / scale, r / scale, msg=f"{name} {M}x{Kd}x{N} {dt}", **tol)
    print("ok")
    """
)


@pytest.mark.skipif(not triton_available(), reason="needs Triton (installed with CUDA builds of torch)")
def test_triton_kernels_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


# ---- the kernels on a GPU ----


def _rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(6272, 320, 80), (1000, 640, 160), (77, 96, 40), (3, 1280, 320), (300, 48, 24)])
def test_cuda_kernels_match_float64(dtype, M, K, N):
    h, w, b = (t.requires_grad_() for t in _inputs(M=M, K=K, N=N, dtype=dtype, device="cuda", seed=M))
    out = gelu_linear(h, w, b)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    ref = gelu_linear_ref(h64, w64, b64)
    sep = F.linear(F.gelu(h), w, b)  # the separate ops at this precision
    assert _rel_err(out, ref) <= 2 * _rel_err(sep, ref) + 1e-6
    go = torch.randn(M, N, device="cuda", dtype=torch.float64)
    mine = torch.autograd.grad(out, (h, w, b), go.to(dtype))
    exp = torch.autograd.grad(ref, (h64, w64, b64), go)
    theirs = torch.autograd.grad(sep, (h, w, b), go.to(dtype))
    for name, a, r, s in zip(("h", "weight", "bias"), mine, exp, theirs):
        assert a.dtype == dtype, name
        assert _rel_err(a, r) <= 2 * _rel_err(s, r) + 1e-6, f"{name}: {_rel_err(a, r):.2e} vs {_rel_err(s, r):.2e}"


@cuda
def test_cuda_deterministic():
    h, w, b = (t.requires_grad_() for t in _inputs(M=5000, K=640, N=160, dtype=torch.bfloat16, device="cuda"))
    runs = []
    for _ in range(2):
        out = gelu_linear(h, w, b)
        runs.append((out, *torch.autograd.grad(out, (h, w, b), torch.ones_like(out))))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@cuda
def test_cuda_compile_fullgraph():
    h, w, b = (t.requires_grad_() for t in _inputs(M=512, K=384, N=96, dtype=torch.bfloat16, device="cuda"))
    fn = torch.compile(gelu_linear, fullgraph=True)
    out = fn(h, w, b)
    grads = torch.autograd.grad(out, (h, w, b), torch.ones_like(out))
    eager = gelu_linear(h, w, b)
    assert torch.equal(out, eager)
    for a, c in zip(grads, torch.autograd.grad(eager, (h, w, b), torch.ones_like(eager))):
        assert torch.equal(a, c)
