"""gspn2.layers.pointwise: the 1x1 convolutions as GEMMs and the activation-recomputing autograd functions,
in both implementations (the Python autograd functions and the C++ ops ``gspn2::rows_*``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspn2.layers import (
    ChunkedConv1x1,
    Conv1x1,
    cpp_ops_available,
    gelu_linear,
    norm_linear,
    recomputed_silu,
    rows_linear,
)
from gspn2.layers.pointwise import POINTWISE_MAX_IN
from gspn2.ops import options

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
needs_cpp = pytest.mark.skipif(not cpp_ops_available(), reason="gspn2's extension (the C++ ops) is not built")


@pytest.fixture(params=["cpp", "python"])
def impl(request):
    """The test runs with the C++ ops (``eager_autograd=auto``) and with the Python functions."""
    if request.param == "cpp" and not cpp_ops_available():
        pytest.skip("gspn2's extension (the C++ ops) is not built")
    with options.override(eager_autograd="auto" if request.param == "cpp" else "python"):
        yield request.param


def test_gelu_linear_gradcheck(impl):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gelu_linear, (h, w, b))
    assert torch.autograd.gradcheck(gelu_linear, (h, w, None))
    expected = F.linear(F.gelu(h), w, b)
    torch.testing.assert_close(gelu_linear(h, w, b), expected)


def test_norm_linear_gradcheck_and_values(impl):
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


def test_rows_linear_gradcheck_and_values(impl):
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

    # A float32 skip input widens the output to float32; the GEMM's gradients stay bf16 GEMMs, as autograd's.
    vf = torch.randn(64, 32, generator=g).requires_grad_()
    inputs = (xs, ws, bs, vf, ss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rows_linear(*inputs)
        ref = torch.addcmul(F.linear(xs, ws, bs), vf, ss)
    assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def _run(fn, inputs, cotangents, impl):
    """Outputs and input gradients (None where an input needs none) of ``fn(*inputs)`` under bf16 autocast."""
    with options.override(eager_autograd=impl):
        leaves = [None if t is None else _leaf(t, t.requires_grad) for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = fn(*leaves)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs], [None if t is None else t.grad for t in leaves]


def _assert_same(a, b):
    (outs_a, grads_a), (outs_b, grads_b) = a, b
    for x, y in zip(outs_a + grads_a, outs_b + grads_b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)


@needs_cpp
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("with_gate", [True, False])
@pytest.mark.parametrize("frozen", [(), ("weight", "norm"), ("x",)])
def test_cpp_ops_are_the_python_functions_bitwise(chunks, with_gate, frozen):
    """The C++ ops and the Python autograd functions: the same output and gradient bits under bf16 autocast
    (bf16 activations, float32 parameters), also where some inputs need no gradient."""
    g = torch.Generator().manual_seed(3)
    N, C, O = 48, 16, 24

    def r(*shape, dtype=torch.float32, name=""):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(name not in frozen)

    x = r(N, C, dtype=torch.bfloat16, name="x")
    gate = r(N, C, dtype=torch.bfloat16) if with_gate else None
    nw, nb = r(C, name="norm"), r(C, name="norm")
    w, b = r(O, C, name="weight"), r(O)
    cot = [torch.randn(N, O // chunks, generator=g, dtype=torch.bfloat16) for _ in range(chunks)]

    def nl(x, gate, nw, nb, w, b):
        return norm_linear(x, nw, nb, 1e-6, w, b, chunks, gate=gate)

    args = (x, gate, nw, nb, w, b)
    _assert_same(_run(nl, args, cot, "auto"), _run(nl, args, cot, "python"))

    xr, wr, br = r(N, O, name="x"), r(C, O, name="weight"), r(C)
    skip, scale = r(N, C, dtype=torch.bfloat16), r(C)
    cot1 = [torch.randn(N, C, generator=g, dtype=torch.bfloat16)]
    args = (xr, wr, br, skip, scale) if with_gate else (xr, wr, None, None, None)
    _assert_same(_run(rows_linear, args, cot1, "auto"), _run(rows_linear, args, cot1, "python"))

    h = r(N, O, dtype=torch.bfloat16, name="x")
    _assert_same(_run(gelu_linear, (h, wr, br), cot1, "auto"), _run(gelu_linear, (h, wr, br), cot1, "python"))


@needs_cpp
def test_cpp_ops_name_bad_arguments():
    x, w = torch.randn(4, 6), torch.randn(6, 6)
    with pytest.raises(ValueError, match="rows_norm_linear: `chunks` must be a positive int dividing 6"):
        torch.ops.gspn2.rows_norm_linear(x, None, None, None, w, None, 1e-6, 4, torch.float32)
    with pytest.raises(ValueError, match="rows_norm_linear: `gate` must have x's shape"):
        torch.ops.gspn2.rows_norm_linear(x, torch.randn(4, 5), None, None, w, None, 1e-6, 1, torch.float32)
    with pytest.raises(ValueError, match=r"rows_linear: `weight` must be \(out, 6\)"):
        torch.ops.gspn2.rows_linear(x, torch.randn(3, 5), None, None, None, torch.float32)
    with pytest.raises(ValueError, match="rows_linear: `skip_input` and `skip_scale` go together"):
        torch.ops.gspn2.rows_linear(x, w, None, torch.randn(4, 6), None, torch.float32)
    with pytest.raises(ValueError, match=r"rows_gelu_linear: `h` must be \(N, C\) rows"):
        torch.ops.gspn2.rows_gelu_linear(torch.randn(2, 4, 6), w, None)


@needs_cpp
def test_compile_traces_the_python_functions():
    """Under torch.compile the graph holds the Python functions' ATen ops (which Inductor fuses), never the
    opaque C++ ops, whatever ``eager_autograd`` says; eagerly the C++ op runs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, nw, nb = torch.randn(8, 6, requires_grad=True), torch.ones(6), torch.zeros(6)
    w, b = torch.randn(4, 6, requires_grad=True), torch.randn(4)

    def fn(x, w):
        return norm_linear(x, nw, nb, 1e-6, w, b)[0]

    with options.override(norm_affine="rows"):  # the formulation eager runs, bitwise
        torch._dynamo.reset()
        got = torch.compile(fn, backend=backend, fullgraph=True)(x, w)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert graphs and not any("rows_norm_linear" in t for t in targets)
    assert torch.equal(got, fn(x, w))
    # The C++ autograd node; the Python function's is a BackwardCFunction.
    assert type(fn(x, w).grad_fn).__name__ == "CppFunction"
    with options.override(eager_autograd="python"):
        assert type(fn(x, w).grad_fn).__name__ != "CppFunction"


def _compiled_targets(fn, *args):
    """``fn`` compiled with a backend that keeps Dynamo's graphs: the result and the names of every function
    the graphs call (the subgraphs of autograd functions included)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    targets = {str(n.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for n in sub.graph.nodes if n.op == "call_function"}
    return out, targets


@pytest.mark.parametrize("small_gemm", ["auto", "gemm", "pointwise"])
def test_narrow_gemms_under_compile_follow_the_option(small_gemm):
    """Under torch.compile, rows_linear (the training GEMMs) with at most POINTWISE_MAX_IN inputs is
    multiply-adds (no GEMM in the graph) unless ``small_gemm="gemm"``; a wider one stays a GEMM, and so does
    Conv1x1 (inference) of any width."""
    g = torch.Generator().manual_seed(0)
    narrow, wide = Conv1x1(POINTWISE_MAX_IN, 12), Conv1x1(POINTWISE_MAX_IN + 1, 12)
    xn = torch.randn(2, POINTWISE_MAX_IN, 3, 5, generator=g).contiguous(memory_format=torch.channels_last)
    xw = torch.randn(2, POINTWISE_MAX_IN + 1, 3, 5, generator=g).contiguous(memory_format=torch.channels_last)
    skip_in, skip = torch.randn(30, 12, generator=g), torch.randn(12, generator=g)
    pointwise = small_gemm != "gemm"
    with options.override(small_gemm=small_gemm, eager_autograd="python"):
        for conv, x in ((narrow, xn), (wide, xw)):
            got, targets = _compiled_targets(conv, x)
            assert any("linear" in t for t in targets), (small_gemm, targets)
            torch.testing.assert_close(got, conv(x))
        for conv, x in ((narrow, xn), (wide, xw)):
            rows = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
            w, b = conv.weight.flatten(1), conv.bias
            got, targets = _compiled_targets(lambda r: rows_linear(r, w, b, skip_in, skip), rows)
            assert any("linear" in t for t in targets) == (conv is wide or not pointwise), (small_gemm, targets)
            torch.testing.assert_close(got, F.linear(rows, w, b) + skip_in * skip)


@pytest.mark.parametrize("autocast", [False, True])
def test_pointwise_linear_values_and_gradients_are_the_gemms(autocast):
    """rows_linear with 8 inputs (the mixer's proj_up) compiled as multiply-adds: outputs and every gradient
    equal the GEMM's, in float32 to rounding, under bf16 autocast within bf16's rounding (float32 sums,
    one rounding, as cuBLAS)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    w, b = torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    skip_in, skip = torch.randn(64, 24, generator=g), torch.randn(24, generator=g)
    grad = torch.randn(64, 24, generator=g)
    results = {}
    for small_gemm in ("gemm", "pointwise"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, skip_in, skip)]
        with options.override(small_gemm=small_gemm, eager_autograd="python"):
            torch._dynamo.reset()
            fn = torch.compile(rows_linear, backend="aot_eager", fullgraph=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = fn(*leaves)
        out.backward(grad.to(out.dtype))
        results[small_gemm] = [out.detach().float()] + [t.grad for t in leaves]
    tol = dict(rtol=1.6e-2, atol=2e-2) if autocast else {}
    for got, want in zip(results["pointwise"], results["gemm"]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_cpp
def test_model_training_step_is_bitwise_the_same_with_either_implementation():
    """gspn2_micro's training forward and backward under bf16 autocast: the same loss and parameter
    gradients with the C++ ops as with the Python functions."""
    import timm

    import gspn2  # noqa: F401  (registers the models)

    torch.manual_seed(0)
    model = timm.create_model("gspn2_micro", num_classes=5).train().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.tensor([1, 3])
    results = []
    for impl in ("auto", "python"):
        model.zero_grad(set_to_none=True)
        with options.override(eager_autograd=impl):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@cuda
@pytest.mark.cuda
@needs_cpp
def test_cpp_ops_are_the_python_functions_bitwise_on_cuda():
    """On CUDA tensors (cuBLAS GEMMs, CUDA norm kernels): the C++ ops give the Python functions' bits, with
    gate and two chunks, under bf16 autocast."""
    g = torch.Generator(device="cuda").manual_seed(4)
    N, C, O = 256, 64, 96

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dtype).requires_grad_()

    x, gate = r(N, C, dtype=torch.bfloat16), r(N, C, dtype=torch.bfloat16)
    nw, nb, w, b = r(C), r(C), r(O, C), r(O)
    cot = [torch.randn(N, O // 2, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def run(impl):
        with options.override(eager_autograd=impl):
            leaves = [_leaf(t) for t in (x, gate, nw, nb, w, b)]
            lx, lgate, lnw, lnb, lw, lb = leaves
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = norm_linear(lx, lnw, lnb, 1e-6, lw, lb, 2, gate=lgate)
            torch.autograd.backward(outs, cot)
        return [o.detach() for o in outs], [t.grad for t in leaves]

    _assert_same(run("auto"), run("python"))


def _saved_for_backward(fn, *args):
    """``fn(*args)`` compiled with AOTAutograd, Inductor's decompositions and partitioner (no code
    generation): the result and the shapes of the activations the forward keeps for the backward (its
    outputs after ``fn``'s own, other than the inputs)."""
    import functools

    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    kept = []

    def forward_compiler(gm, example_inputs):
        inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
        (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        kept.extend(tuple(n.meta["val"].shape) for n in outs[1:] if isinstance(n, torch.fx.Node)
                    and n not in inputs and isinstance(n.meta.get("val"), torch.Tensor))
        return gm.forward

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=lambda g, _: g.forward,
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
            decompositions=select_decomp_table(),
        )

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), kept


def test_recompute_option_keeps_fewer_gemm_inputs_with_the_same_values_and_gradients():
    """Under torch.compile, the MLP's training formulation (norm_linear into fc1, gelu_linear for fc2) keeps
    only ``h`` of the (N, hidden) tensors with the option ``recompute="gelu"`` or ``"all"``, and the (N, C)
    normalised input of fc1 unless ``recompute="all"``, with the same outputs and gradients (bf16
    autocast)."""
    g = torch.Generator().manual_seed(3)
    N, C, hidden = 64, 16, 48
    x = torch.randn(N, C, generator=g)
    shapes = ((C,), (C,), (hidden, C), (hidden,), (C, hidden), (C,))
    params = [torch.randn(*s, generator=g) * 0.3 for s in shapes]

    def mlp(x, nw, nb, w1, b1, w2, b2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (h,) = norm_linear(x, nw, nb, 1e-6, w1, b1)
            return gelu_linear(h, w2, b2)

    results = {}
    for choice in ("keep", "gelu", "all"):
        leaves = [t.clone().requires_grad_() for t in (x, *params)]
        with options.override(recompute=choice, norm_affine="rows", eager_autograd="python"):
            out, kept = _saved_for_backward(mlp, *leaves)
        out.float().square().sum().backward()
        results[choice] = ([out.detach().float()] + [t.grad for t in leaves], kept)
    # Whether the partitioner keeps gelu(h) on its own depends on the graph (it does in gspn2_tiny at 224^2,
    # not in this small one); recompute="gelu" and "all" keep h alone.
    assert results["keep"][1].count((N, hidden)) >= 1
    assert results["gelu"][1].count((N, hidden)) == results["all"][1].count((N, hidden)) == 1
    # fc1's normalised input: kept, unless recompute="all".
    assert (N, C) in results["keep"][1] and (N, C) in results["gelu"][1] and (N, C) not in results["all"][1]
    for choice in ("gelu", "all"):
        for got, want in zip(results[choice][0], results["keep"][0]):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("choice,kept_hidden", [("keep", 2), ("gelu", 2), ("act", 1), ("all", 1)])
def test_recomputed_silu_keeps_its_input_alone_from_act_on(choice, kept_hidden):
    """The mixer's value branch, ``generate(silu(a))`` with ``a`` computed in the graph: compiled, the
    forward keeps ``a`` (SiLU's gradient needs it) and ``silu(a)`` (the GEMM's weight gradient) unless
    ``recompute`` is ``act`` or beyond, which recomputes ``silu(a)`` from ``a`` in backward; outputs and
    gradients stay those of eager."""
    g = torch.Generator().manual_seed(5)
    N, C, hidden, out_features = 64, 12, 40, 24
    x = torch.randn(N, C, generator=g)
    w1, w2 = torch.randn(hidden, C, generator=g) * 0.3, torch.randn(out_features, hidden, generator=g) * 0.3

    def branch(x, w1, w2):
        return F.linear(recomputed_silu(F.linear(x, w1)), w2)

    def run(compiled):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        with options.override(recompute=choice):
            if compiled:
                out, kept = _saved_for_backward(branch, *leaves)
            else:
                out, kept = branch(*leaves), None
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves], kept

    got, kept = run(compiled=True)
    assert kept.count((N, hidden)) == kept_hidden, kept
    for a, b in zip(got, run(compiled=False)[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_recompute_choices_name_what_the_compiled_backward_recomputes(monkeypatch):
    """Each ``recompute`` choice and the GEMM inputs it marks for recomputation under torch.compile (none
    outside it): the MLP's ``gelu(h)``, the mixer's ``silu(dwconv(v))`` (``generate``'s input), its gated
    norm output (``out_proj``'s input), the other normalised inputs (``in_proj``, ``fc1``)."""
    from gspn2.layers import pointwise

    marked = {"keep": set(), "auto": {"gelu", "silu"}, "gelu": {"gelu"}, "act": {"gelu", "silu"},
              "gate": {"gelu", "silu", "gate"}, "all": {"gelu", "silu", "gate", "norm"}}
    assert set(marked) == set(options._CHOICES["recompute"])
    what = ("gelu", "silu", "gate", "norm")
    for choice, want in marked.items():
        with options.override(recompute=choice):
            assert not any(pointwise._recomputes(w) for w in what)  # eager
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            assert {w for w in what if pointwise._recomputes(w)} == want, choice
            monkeypatch.undo()


@pytest.mark.parametrize("choice", ["gate", "all"])
@pytest.mark.parametrize("chunks,gated", [(2, False), (1, True)])
def test_recompute_all_norm_linear_chunks_and_gate(chunks, gated, choice):
    """``recompute="all"`` (and ``"gate"``, for the gated chain) writes norm_linear as plain ops with a
    recomputed GEMM input: in chunks (the mixer's in_proj) and with a gate (its out_proj), the compiled
    outputs and gradients equal those of the autograd function (bf16 autocast)."""
    g = torch.Generator().manual_seed(4)
    N, C, out = 32, 8, 12
    tensors = [torch.randn(*s, generator=g) for s in ((N, C), (N, C), (C,), (C,), (out, C), (out,))]

    def fn(x, gate, nw, nb, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return norm_linear(x, nw, nb, 1e-6, w, b, chunks, gate=gate if gated else None)

    results = {}
    for setting in ("keep", choice):
        leaves = [t.clone().requires_grad_() for t in tensors]
        with options.override(recompute=setting, norm_affine="rows", eager_autograd="python"):
            torch._dynamo.reset()
            outs = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
        sum(o.float().square().sum() for o in outs).backward()
        results[setting] = [o.detach().float() for o in outs] + [t.grad for t in leaves if t.grad is not None]
    assert len(results[choice]) == len(results["keep"]) == chunks + (6 if gated else 5)
    for got, want in zip(results[choice], results["keep"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_norm_affine_folded_into_the_gemm_is_the_same_function():
    """``norm_affine="weight"``: ``linear(layer_norm(x))`` with the norm's weight and bias folded into the
    GEMM's (no gate: in_proj in two chunks, fc1 in one). float64 gradients of every input, with and without
    the norm's parameters and the bias; values and gradients of the rows formulation to float64 rounding;
    under bf16 autocast, compiled (aot_eager), within bf16 rounding of the rows formulation."""
    g = torch.Generator().manual_seed(6)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    x, nw, nb, w, b = r(7, 6), r(6), r(6), r(4, 6), r(4)
    with options.override(eager_autograd="python", norm_affine="weight"):
        cases = [(x, nw, nb, 1e-6, w, b, 2), (x, nw, nb, 1e-6, w, None, 1), (x, None, None, 1e-6, w, b, 1),
                 (x, nw, None, 1e-6, w, b, 2)]
        for args in cases:
            assert torch.autograd.gradcheck(lambda *a: norm_linear(*a), args)
    cot = [torch.randn(7, 2, generator=g, dtype=torch.float64) for _ in range(2)]
    res = {}
    for mode in ("rows", "weight"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, nw, nb, w, b)]
        with options.override(eager_autograd="python", norm_affine=mode):
            outs = norm_linear(leaves[0], leaves[1], leaves[2], 1e-6, leaves[3], leaves[4], 2)
        torch.autograd.backward(outs, cot)
        res[mode] = [o.detach() for o in outs] + [t.grad for t in leaves]
    for got, want in zip(res["weight"], res["rows"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    N, C, out = 48, 16, 24
    tensors = [torch.randn(*s, generator=g) for s in ((N, C), (C,), (C,), (out, C), (out,))]

    def fn(x, nw, nb, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return norm_linear(x, nw, nb, 1e-6, w, b, 2)

    results = {}
    for mode in ("rows", "weight"):
        leaves = [(t * 1.0).requires_grad_() for t in tensors]
        with options.override(norm_affine=mode, eager_autograd="python"):
            torch._dynamo.reset()
            outs = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
        sum(o.float().square().sum() for o in outs).backward()
        assert all(o.dtype == torch.bfloat16 for o in outs)
        results[mode] = [o.detach().float() for o in outs] + [t.grad for t in leaves]
        assert [t.dtype for t in results[mode][2:]] == [torch.float32] * 5
    for got, want in zip(results["weight"], results["rows"]):  # bf16 rounding of the tensor's largest values
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_norm_affine_auto_folds_under_torch_compile_only(monkeypatch):
    """``norm_affine="auto"``: norm_linear folds the norm's weight and bias into the GEMM's while
    torch.compile traces (where it measured faster) and keeps them on the rows eagerly; ``weight`` folds and
    ``rows`` keeps in both."""
    from gspn2.layers import pointwise

    decided = []
    real = pointwise._folds_norm_affine
    monkeypatch.setattr(pointwise, "_folds_norm_affine", lambda: decided.append(real()) or decided[-1])
    x, nw, nb, w, b = (torch.randn(*s) for s in ((8, 6), (6,), (6,), (4, 6), (4,)))
    for choice, eager, compiled in (("auto", False, True), ("weight", True, True), ("rows", False, False)):
        with options.override(norm_affine=choice, recompute="keep", eager_autograd="python"):
            want = norm_linear(x, nw, nb, 1e-6, w, b, 1)[0]
            torch._dynamo.reset()
            got = torch.compile(lambda *a: norm_linear(*a, 1e-6, w, b, 1)[0], backend="aot_eager",
                                fullgraph=True)(x.clone().requires_grad_(), nw, nb)
        assert decided == [eager, compiled], choice
        decided.clear()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
