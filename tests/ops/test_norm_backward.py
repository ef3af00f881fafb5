"""``gspn2.ops.norm_gate_backward``: its reference against autograd of ``layer_norm(x) * silu(gate)`` (float64),
argument errors, opcheck, the Triton kernel on the CPU through Triton's interpreter (float32, float16), and
on a GPU the kernel against the float64 reference (fp32, bf16, fp16), determinism, and the training mixer's
gated norm with the op against the separate ops, eagerly and under ``torch.compile``."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401
from gspn2.layers import norm_linear
from gspn2.ops import norm_gate_backward, norm_gate_backward_ref
from gspn2.ops import norm_backward as NB
from gspn2.ops import options
from tests.ops._interpreter import run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
NAMES = ("grad", "x", "gate", "mean", "rstd", "norm_weight", "norm_bias")


def _inputs(N=13, E=24, dtype=torch.float64, device="cpu", seed=0, eps=1e-6):
    """grad, x, gate, mean, rstd (of x), norm_weight, norm_bias."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(device=device, dtype=dtype)

    x = r(N, E, scale=2.0, shift=0.5)
    var, mean = torch.var_mean(x.double(), dim=-1, correction=0)
    stats = dict(dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
    return (r(N, E), x, r(N, E), mean.to(**stats), torch.rsqrt(var + eps).to(**stats), 1 + r(E, scale=0.2),
            r(E, scale=0.2))


def test_reference_is_the_gradient_of_the_module_chain():
    grad, x, z, mean, rstd, w, b = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, z, w, b)]
    out = F.layer_norm(leaves[0], (x.shape[-1],), leaves[2], leaves[3], 1e-6) * F.silu(leaves[1])
    expected = torch.autograd.grad(out, leaves, grad)
    gx, gz, gw, gb, normed = norm_gate_backward_ref(grad, x, z, mean, rstd, w, b)
    for name, a, e in zip(("x", "gate", "norm_weight", "norm_bias"), (gx, gz, gw, gb), expected):
        torch.testing.assert_close(a, e, msg=name)
    torch.testing.assert_close(normed, out.detach())


def test_public_entry_on_the_cpu_is_the_reference():
    t = _inputs(dtype=torch.float32)
    for a, r in zip(norm_gate_backward(*t), norm_gate_backward_ref(*t)):
        assert torch.equal(a, r)


def test_opcheck():
    torch.library.opcheck(torch.ops.gspn2.norm_gate_backward.default, _inputs(N=5, E=6))


@pytest.mark.parametrize(
    "index,bad,match",
    [
        (1, torch.zeros(3), r"`x` must be \(N, E\)"),
        (0, torch.zeros(13, 25, dtype=torch.float64), r"`grad` must be \(N, E\)"),
        (2, torch.zeros(12, 24, dtype=torch.float64), r"`gate` must be \(N, E\)"),
        (3, torch.zeros(13, 1), r"`mean` must be \(N,\)"),
        (4, torch.zeros(13, dtype=torch.int64), r"`rstd` must be float16, bfloat16, float32 or float64"),
        (5, torch.zeros(25, dtype=torch.float64), r"`norm_weight` must be \(E,\)"),
        (6, torch.zeros(24, 1, dtype=torch.float64), r"`norm_bias` must be \(E,\)"),
        (2, "z", r"`gate`"),
    ],
)
def test_argument_errors_name_the_argument(index, bad, match):
    t = list(_inputs())
    t[index] = bad
    with pytest.raises((TypeError, ValueError), match=match):
        norm_gate_backward(*t)


def test_fake_tensors_give_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        t = [mode.from_tensor(u) for u in _inputs(dtype=torch.float32)]
        t[0] = t[0].to(torch.bfloat16)
        gx, gz, gw, gb, normed = norm_gate_backward(*t)
    assert gx.shape == gz.shape == normed.shape == (13, 24) and gw.shape == gb.shape == (24,)
    assert normed.dtype == torch.bfloat16 and gx.dtype == torch.float32


# ---- the Triton kernel on the CPU, through Triton's interpreter ----

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from gspn2.ops import _norm_triton as K
    from gspn2.ops.norm_backward import norm_gate_backward_ref, triton_backward
    from tests.ops.test_norm_backward import _inputs

    # (rows, E, dtype, programs, rows per block): E not a power of two, rows not a multiple of the blocks,
    # more programs asked for than there are row blocks, one program for all.
    cases = [(37, 24, torch.float32, 3, 4), (33, 40, torch.float16, 2, 8), (17, 200, torch.float32, 9, 2),
             (70, 120, torch.float32, 1, 16)]
    for N, E, dt, programs, block_m in cases:
        t = _inputs(N=N, E=E, dtype=dt, seed=N)
        cfg = dict(K.config(E), block_m=block_m)
        mine = triton_backward(*t, cfg, programs)
        ref = norm_gate_backward_ref(*t)
        tol = dict(rtol=2e-3, atol=2e-3) if dt == torch.float16 else dict(rtol=1e-5, atol=1e-5)
        for name, a, r in zip("x gate norm_weight norm_bias normed".split(), mine, ref):
            assert a.dtype == r.dtype, (name, a.dtype, r.dtype)
            torch.testing.assert_close(a, r, msg=f"{name} {N}x{E} {dt}", **tol)
    print("ok")
    """
)


@pytest.mark.skipif(not NB.triton_available(), reason="needs Triton (installed with CUDA builds of torch)")
def test_triton_kernel_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


# ---- the kernel on a GPU ----


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,E", [(25088, 480), (6272, 960), (4001, 120), (77, 40), (3, 1000)])
def test_cuda_kernel_matches_the_float64_reference(N, E, dtype):
    t = _inputs(N=N, E=E, dtype=dtype, device="cuda", seed=E)
    mine = norm_gate_backward(*t)
    t64 = [u.double() for u in t]
    ref = norm_gate_backward_ref(*t64)
    # normed in the reference is rounded to float64; the kernel rounds the norm to the rows' dtype first
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    for name, a, r in zip(("x", "gate", "norm_weight", "norm_bias", "normed"), mine, ref):
        assert a.dtype == dtype, name  # every input has `dtype` here
        scale = r.abs().max().clamp_min(1.0)
        assert (a.double() - r).abs().max() <= tol * scale, name
    again = norm_gate_backward(*t)
    for a, b in zip(mine, again):
        assert torch.equal(a, b)  # deterministic


@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gated_norm_linear_with_the_op_matches_the_separate_ops(compiled):
    torch.manual_seed(0)
    N, E, O = 3000, 240, 160
    x = torch.randn(N, E, device="cuda") * 2
    z = torch.randn(N, E, device="cuda")
    nw = 1 + 0.1 * torch.randn(E, device="cuda")
    nb = 0.1 * torch.randn(E, device="cuda")
    w = torch.randn(O, E, device="cuda") * 0.05
    b = torch.randn(O, device="cuda") * 0.1
    g = torch.randn(N, O, device="cuda")

    def run(choice):
        leaves = [t.clone().requires_grad_() for t in (x, z, nw, nb, w, b)]

        def f(x_, z_, nw_, nb_, w_, b_):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return norm_linear(x_.bfloat16(), nw_, nb_, 1e-6, w_, b_, chunks=1, gate=z_.bfloat16())[0]

        with options.override(norm_backward=choice, eager_autograd="python"):
            fn = torch.compile(f, fullgraph=True) if compiled else f
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
        return out, grads

    out_s, grads_s = run("separate")
    out_f, grads_f = run("fused")
    assert torch.equal(out_s, out_f)
    for name, a, r in zip(("x", "gate", "norm_weight", "norm_bias", "weight", "bias"), grads_f, grads_s):
        torch.testing.assert_close(a, r, rtol=3e-2, atol=3e-2 * r.abs().max().item(), msg=name)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_gated_norm_linear_takes_the_op_in_backward(monkeypatch, backend):
    """The wiring on the CPU: with the op forced on, ``norm_linear``'s backward (eager, and traced through the
    op's fake implementation by ``aot_eager``) runs the op and gives the separate ops' gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gspn2.layers import pointwise

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    t = _inputs(N=11, E=12, dtype=torch.float32)
    z, x, nw, nb = t[2], t[1], t[5], t[6]
    w = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    b = torch.randn(5, generator=torch.Generator().manual_seed(2))
    g = torch.randn(11, 5, generator=torch.Generator().manual_seed(3))

    def grads(fused):
        monkeypatch.setattr(pointwise, "_fused_norm_backward", lambda _x: fused)
        leaves = [u.clone().requires_grad_() for u in (x, z, nw, nb, w, b)]

        def f(*a):
            return norm_linear(a[0], a[2], a[3], 1e-6, a[4], a[5], chunks=1, gate=a[1])[0]

        fn = torch.compile(f, backend=backend, fullgraph=True) if backend else f
        with options.override(eager_autograd="python"):
            torch._dynamo.reset()
            out = fn(*leaves)
        with Ops() as ops:
            result = torch.autograd.grad(out, leaves, g)
        return result, ops.seen

    separate, seen = grads(False)
    assert "gspn2.norm_gate_backward" not in seen
    fused, seen = grads(True)
    assert "gspn2.norm_gate_backward" in seen
    for name, a, r in zip(("x", "gate", "norm_weight", "norm_bias", "weight", "bias"), fused, separate):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)
