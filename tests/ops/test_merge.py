"""``gspn2.ops.merge_norm_gate``: the op against the module-by-module formulation (CPU, float64 gradcheck,
opcheck), its written-out backward against autograd of the reference, argument errors, the FLOP count, the
Triton kernels on the CPU through Triton's interpreter (float32, float16: the interpreter's bfloat16 products
are wrong), and on a GPU the kernels against the float64 reference (fp32, bf16, fp16), determinism and
``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gspn2  # noqa: F401
from gspn2.ops import merge_norm_gate, merge_norm_gate_ref
from gspn2.ops import merge as M
from tests.ops._interpreter import run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

NAMES = ("x", "weight", "bias", "skip_input", "skip", "norm_weight", "norm_bias", "gate")


def _inputs(N=13, R=8, E=24, dtype=torch.float64, param_dtype=None, device="cpu", seed=0):
    """x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate (eps is 1e-6)."""
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dt)

    return (r(N, R), r(E, R, scale=0.5, dt=pd), r(E, dt=pd), r(N, E), r(E, dt=pd), 1 + r(E, scale=0.2, dt=pd),
            r(E, scale=0.2, dt=pd), r(N, E))


def _call(fn, t, eps=1e-6):
    x, w, b, v, s, nw, nb, z = t
    return fn(x, w, b, v, s, nw, nb, eps, z)


def _modules(x, w, b, v, s, nw, nb, eps, z):
    """The mixer's chain as separate ops: linear, addcmul, LayerNorm, SiLU gate."""
    y = torch.addcmul(F.linear(x, w, b), v, s)
    return F.layer_norm(y, (y.shape[-1],), nw, nb, eps) * F.silu(z)


def test_reference_is_the_module_chain():
    t = _inputs()
    torch.testing.assert_close(_call(merge_norm_gate_ref, t), _call(_modules, t))


def test_cpu_op_gradcheck_and_backward_formulas():
    t = [u.requires_grad_() for u in _inputs(N=5, R=4, E=6)]
    assert torch.autograd.gradcheck(lambda *a: merge_norm_gate(*a[:7], 1e-6, a[7]), tuple(t))
    out = _call(merge_norm_gate, t)
    torch.testing.assert_close(out, _call(_modules, t))
    g = torch.randn_like(out)
    mine = torch.autograd.grad(out, t, g)
    ref = torch.autograd.grad(_call(_modules, t), t, g)
    for name, a, b in zip(NAMES, mine, ref):
        torch.testing.assert_close(a, b, msg=name)


def test_autocast_casts_activations_keeps_parameter_dtypes():
    x, w, b, v, s, nw, nb, z = _inputs(dtype=torch.float32)
    params = [p.requires_grad_() for p in (w, b, s, nw, nb)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = merge_norm_gate(x, w, b, v, s, nw, nb, 1e-6, z)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), params)
    assert all(gr.dtype == torch.float32 for gr in grads)
    # Inside autocast the reference still computes in float32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = merge_norm_gate_ref(x.bfloat16(), w, b, v.bfloat16(), s, nw, nb, 1e-6, z.bfloat16())
    torch.testing.assert_close(out, ref)


def test_opcheck():
    for t in (_inputs(), _inputs(N=3, R=8, E=5, dtype=torch.float32)):
        torch.library.opcheck(torch.ops.gspn2.merge_norm_gate.default, (*t[:7], 1e-6, t[7]))
        t = [u.requires_grad_() for u in t]
        torch.library.opcheck(torch.ops.gspn2.merge_norm_gate.default, (*t[:7], 1e-6, t[7]))


def _replace(t, name, value):
    t = list(t)
    t[NAMES.index(name)] = value
    return t


@pytest.mark.parametrize(
    "name,value,error,match",
    [
        ("x", torch.zeros(13, 8, 1), ValueError, "`x` must be"),
        ("x", torch.zeros(12, 8), ValueError, "`x` must be"),
        ("weight", torch.zeros(24, 7), ValueError, "`weight` must be"),
        ("bias", torch.zeros(23), ValueError, "`bias` must be"),
        ("skip", torch.zeros(24, 1), ValueError, "`skip` must be"),
        ("norm_weight", torch.zeros(25), ValueError, "`norm_weight` must be"),
        ("norm_bias", torch.zeros(2), ValueError, "`norm_bias` must be"),
        ("gate", torch.zeros(13, 23), ValueError, "`gate` must be"),
        ("skip_input", torch.zeros(13), ValueError, "`skip_input` must be"),
        ("gate", torch.zeros(13, 24, dtype=torch.float64), TypeError, "share one dtype"),
        ("x", torch.zeros(13, 8, dtype=torch.int64), TypeError, "`x` must be float"),
        ("weight", [[0.0]], TypeError, "`weight` must be a torch.Tensor"),
    ],
)
def test_errors_name_the_argument(name, value, error, match):
    t = _replace(_inputs(dtype=torch.float32), name, value)
    with pytest.raises(error, match=match):
        _call(merge_norm_gate, t)


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), True])
def test_eps_error(eps):
    with pytest.raises(ValueError, match="`eps`"):
        _call(merge_norm_gate, _inputs(dtype=torch.float32), eps=eps)


def test_flop_count():
    t = _inputs(N=10, R=8, E=6, dtype=torch.float32)
    t = [u.requires_grad_() for u in t]
    with FlopCounterMode(display=False) as counter:
        _call(merge_norm_gate, t).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.gspn2.merge_norm_gate] == 2 * 10 * 8 * 6
    assert counts[torch.ops.gspn2.merge_norm_gate_backward] == 4 * 10 * 8 * 6


# ---- the Triton kernels on the CPU, through Triton's interpreter ----

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from gspn2.ops import _merge_triton as K
    from gspn2.ops.merge import _forward_ref, merge_norm_gate_backward_ref, triton_backward, triton_forward

    # (rows, R, E, dtype, backward programs, channels per chunk): rows not a multiple of the blocks, E not a
    # power of two, several channel chunks with a partial last one, a run of row blocks left empty (17 rows
    # are two blocks of 16, for three programs).
    cases = [(37, 8, 24, torch.float32, 3, 16), (33, 4, 40, torch.float16, 2, 64),
             (17, 8, 200, torch.float32, 3, 64), (70, 8, 120, torch.float32, 1, 64)]
    for N, R, E, dt, programs, chunk_e in cases:
        g = torch.Generator().manual_seed(N)
        x, v, z, go = (torch.randn(*s, generator=g).to(dt) for s in ((N, R), (N, E), (N, E), (N, E)))
        w, b, s, nw, nb = (torch.randn(*s, generator=g) for s in ((E, R), (E,), (E,), (E,), (E,)))
        cfg = dict(K.config(E), chunk_e=chunk_e)
        out, mean, rstd = triton_forward(x, w, b, v, s, nw, nb, 1e-6, z, cfg)
        ref_out, ref_mean, ref_rstd = _forward_ref(x, w, b, v, s, nw, nb, 1e-6, z)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(mean, ref_mean)
        torch.testing.assert_close(rstd, ref_rstd)
        mine = triton_backward(go, x, w, b, v, s, nw, nb, z, mean, rstd, cfg, programs)
        ref = merge_norm_gate_backward_ref(go, x, w, b, v, s, nw, nb, z, mean, rstd)
        tol = dict(rtol=2e-3, atol=2e-3) if dt == torch.float16 else dict(rtol=1e-5, atol=1e-5)
        for name, a, r in zip("x weight bias skip_input skip norm_weight norm_bias gate".split(), mine, ref):
            torch.testing.assert_close(a, r, msg=f"{name} {N}x{E} {dt}", **tol)
    print("ok")
    """
)


@pytest.mark.skipif(not M.triton_available(), reason="needs Triton (installed with CUDA builds of torch)")
def test_triton_kernels_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


# ---- the kernels on a GPU ----


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,R,E", [(6272, 8, 120), (1000, 8, 960), (77, 4, 40), (3, 8, 1000), (300, 16, 48)])
def test_cuda_kernels_match_float64(dtype, N, R, E):
    t = _inputs(N=N, R=R, E=E, dtype=dtype, param_dtype=torch.float32, device="cuda", seed=N)
    t = [u.requires_grad_() for u in t]
    out = _call(merge_norm_gate, t)
    t64 = [u.detach().double().requires_grad_() for u in t]
    ref = _call(merge_norm_gate_ref, t64)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    g = torch.randn(N, E, device="cuda", dtype=torch.float64) / N**0.5
    mine = torch.autograd.grad(out, t, g.to(dtype))
    exp = torch.autograd.grad(ref, t64, g)
    for name, a, b in zip(NAMES, mine, exp):
        assert a.dtype == t[NAMES.index(name)].dtype, name
        scale = b.abs().max().clamp_min(1e-3)
        err = (a.double() - b).abs().max() / scale
        assert err < tol * 4, f"{name}: {err:.2e} relative to {scale:.2e}"


@cuda
def test_cuda_deterministic():
    t = [u.requires_grad_() for u in _inputs(N=5000, E=240, dtype=torch.bfloat16, param_dtype=torch.float32,
                                             device="cuda")]
    runs = []
    for _ in range(2):
        out = _call(merge_norm_gate, t)
        grads = torch.autograd.grad(out, t, torch.ones_like(out))
        runs.append((out, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@cuda
def test_cuda_compile_fullgraph():
    t = [u.requires_grad_() for u in _inputs(N=512, E=96, dtype=torch.bfloat16, param_dtype=torch.float32,
                                             device="cuda")]
    fn = torch.compile(lambda *a: merge_norm_gate(*a[:7], 1e-6, a[7]), fullgraph=True)
    out = fn(*t)
    grads = torch.autograd.grad(out, t, torch.ones_like(out))
    eager = _call(merge_norm_gate, t)
    eager_grads = torch.autograd.grad(eager, t, torch.ones_like(eager))
    assert torch.equal(out, eager)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)
