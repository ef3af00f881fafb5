"""The fast path of the GSPN-2 blocks computes the reference's function.

``fast_path=False`` runs every block module by module (``nn.Conv2d`` 1x1 convolutions,
timm's ``LayerNorm2d``, autograd saving every intermediate): that is the reference. Both paths get the
same weights and inputs; outputs, input gradients and every parameter gradient must agree:

* fp32: to 1e-5 of the largest magnitude of each tensor (the paths only differ in summation order);
* bf16 autocast: the fast path's error against the fp32 reference must be at most twice the reference's
  own bf16 error plus 1e-2 (flash-attn's rule; both round to bf16 at different places).

Plus the saved-activation count per block (the estimate in docs/models.md), the autograd functions that
recompute activations (gradcheck), ``torch.compile(fullgraph=True)`` tracing, and bad input.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Tuple

import pytest
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.layers import ChunkedConv1x1, Conv1x1, gelu_linear, norm_linear
from gspn2.models import GSPN2Block
from tests.models._models import micro

Grads = Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]


def _pair(build: Callable[[], torch.nn.Module]) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """(fast, reference) with the same weights; ``build()`` returns a fast-path module."""
    torch.manual_seed(0)
    fast = build()
    ref = build()
    ref.load_state_dict(fast.state_dict())
    for m in ref.modules():
        if hasattr(m, "fast_path"):
            m.fast_path = False
    return fast, ref


def _block(**kwargs) -> GSPN2Block:
    block = GSPN2Block(16, ls_init_value=0.5, **kwargs)
    with torch.no_grad():  # non-trivial norms, skip and layer scale (init is ones/zeros)
        for name, p in block.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "skip", "gamma")):
                p.mul_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(("norm1.bias", "norm2.bias", "norm.bias")):
                p.add_(0.1 * torch.randn_like(p))
    return block


def _run(model: torch.nn.Module, x: torch.Tensor, train: bool, bf16: bool, seed: int = 3) -> Grads:
    """Output, input gradient and parameter gradients of a fixed random projection of the output."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    torch.manual_seed(seed)  # the same drop-path draws for both paths
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * weight).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), x.grad.float(), grads


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _assert_same(fast: Grads, ref: Grads, rtol: float) -> None:
    assert fast[2].keys() == ref[2].keys()
    pairs = [("output", fast[0], ref[0]), ("input grad", fast[1], ref[1])]
    pairs += [(f"grad {n}", fast[2][n], ref[2][n]) for n in ref[2]]
    bad = [(what, err) for what, a, b in pairs if (err := _rel_err(a, b)) > rtol]
    assert not bad, f"fast path differs from the reference (relative to max |ref|, tol {rtol:g}): {bad}"


def _images(shape, channels_last: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(proxy_dim=4, affinity_groups=2, chunk=5, drop_path=0.5)],
    ids=["default", "P4-K2-local-droppath"],
)
def test_block_fp32(kwargs, channels_last, train):
    fast, ref = _pair(lambda: _block(**kwargs))
    x = _images((2, 16, 13, 17), channels_last)
    _assert_same(_run(fast, x, train, bf16=False), _run(ref, x, train, bf16=False), rtol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_model_fp32(channels_last):
    """Whole model: stem, downsampling and head norms too; train mode with drop path."""
    fast, ref = _pair(lambda: micro(drop_path_rate=0.2))
    x = _images((2, 3, 37, 45), channels_last)
    _assert_same(_run(fast, x, True, bf16=False), _run(ref, x, True, bf16=False), rtol=1e-5)


def _assert_bf16_close(fast: Grads, ref: Grads, exact: Grads) -> None:
    """Fast bf16 error against the fp32 reference <= 2 x the reference's bf16 error + 1e-2."""
    pairs = [("output", fast[0], ref[0], exact[0]), ("input grad", fast[1], ref[1], exact[1])]
    pairs += [(f"grad {n}", fast[2][n], ref[2][n], exact[2][n]) for n in exact[2]]
    bad = []
    for what, a, b, e in pairs:
        err_fast, err_ref = _rel_err(a, e), _rel_err(b, e)
        if err_fast > 2 * err_ref + 1e-2:
            bad.append((what, round(err_fast, 4), round(err_ref, 4)))
    assert not bad, f"bf16 fast path much worse than the bf16 reference (what, fast err, ref err): {bad}"


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_block_bf16_autocast(channels_last, train):
    fast, ref = _pair(_block)
    x = _images((2, 16, 13, 17), channels_last)
    exact = _run(ref, x, train, bf16=False)
    _assert_bf16_close(_run(fast, x, train, bf16=True), _run(ref, x, train, bf16=True), exact)


def test_model_bf16_autocast():
    fast, ref = _pair(micro)
    x = _images((2, 3, 37, 45), channels_last=True)
    exact = _run(ref, x, True, bf16=False)
    _assert_bf16_close(_run(fast, x, True, bf16=True), _run(ref, x, True, bf16=True), exact)


def test_comparison_catches_a_small_change():
    """The fp32 check is sharp: a 1e-3 change of one per-channel scale fails it."""
    fast, ref = _pair(_block)
    with torch.no_grad():
        fast.mixer.skip[0] *= 1 + 1e-3
    x = _images((2, 16, 13, 17), channels_last=True)
    with pytest.raises(AssertionError, match="differs from the reference"):
        _assert_same(_run(fast, x, True, bf16=False), _run(ref, x, True, bf16=False), rtol=1e-5)


def test_fast_path_switch_keeps_parameters():
    model = micro()
    assert all(m.fast_path for m in model.modules() if hasattr(m, "fast_path"))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_fast_path(False)
    assert not any(m.fast_path for m in model.modules() if hasattr(m, "fast_path"))
    torch.manual_seed(0)
    ref = micro(fast_path=False)
    assert ref.state_dict().keys() == sd.keys()
    assert all(ref.state_dict()[k].shape == v.shape for k, v in sd.items())
    with pytest.raises(TypeError, match="`enable`"):
        model.set_fast_path(1)


# ---- saved activations (docs/models.md, "Speed") ----


def _saved_bytes_per_pixel(block: torch.nn.Module, bf16: bool) -> float:
    """Bytes autograd keeps for backward per pixel, from two input sizes (the difference drops the
    weights and their autocast copies, which do not grow with the image)."""

    def saved_bytes(H: int, W: int) -> int:
        storages = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        # Under autocast the activations reaching a block are bf16 (the stem's norm keeps its conv's dtype).
        x = _images((1, 16, H, W), channels_last=True).to(torch.bfloat16 if bf16 else torch.float32)
        x.requires_grad_()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            block(x)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    return (saved_bytes(16, 24) - saved_bytes(8, 12)) / (16 * 24 - 8 * 12)


def test_saved_activations_per_block():
    """Elements saved per pixel, C channels, E = 1.5 C, MLP hidden 4C, P proxy channels, K groups:

    fast:      4 C + 4 C + 5 E + (22 P + 24 K) + 3 x 2 fp32 LayerNorm statistics
    reference: 6 C + 8 C + 8 E + (26 P + 24 K) + 3 x 2

    The fast path keeps, per block: the inputs of the two LPU convolutions and of the two block norms
    (4 C; the norms' outputs are recomputed, norm_linear), the MLP's pre-activation (4 C), and in the
    mixer v before and after its depthwise convolution, the SiLU's output, y and z (5 E; the mixer
    norm's output is recomputed too).
    """
    C, E, P, K = 16, 24, 2, 1
    fast, ref = _pair(lambda: GSPN2Block(C))
    fast.train(), ref.train()
    assert _saved_bytes_per_pixel(fast, bf16=False) == 4 * (8 * C + 5 * E + 22 * P + 24 * K + 6)
    assert _saved_bytes_per_pixel(ref, bf16=False) == 4 * (14 * C + 8 * E + 26 * P + 24 * K + 6)
    # bf16 autocast: every activation in bf16 (2 bytes). CPU's layer_norm keeps its statistics in the
    # input dtype too; CUDA's keeps them in fp32 (12 bytes per pixel more).
    assert _saved_bytes_per_pixel(fast, bf16=True) == 2 * (8 * C + 5 * E + 22 * P + 24 * K + 6)


# ---- the recomputing autograd functions ----


def test_gelu_linear_gradcheck():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gelu_linear, (h, w, b))
    assert torch.autograd.gradcheck(gelu_linear, (h, w, None))
    expected = torch.nn.functional.linear(torch.nn.functional.gelu(h), w, b)
    torch.testing.assert_close(gelu_linear(h, w, b), expected)


def test_norm_linear_gradcheck_and_values():
    """norm_linear = linear(layer_norm(x) [* silu(gate)]) in chunks: float64 gradients of every input
    (with and without gate and bias, one and two chunks), and, under bf16 autocast, bitwise the outputs
    and gradients of the unfused modules (norm in x's dtype, GEMMs in bf16)."""
    F = torch.nn.functional
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


def test_compile_fullgraph_traces_the_block():
    """Dynamo + AOT autograd capture the fast path in one graph (autograd functions, autocast switches);
    the aot_eager backend keeps the test fast, the GPU test compiles the whole model with inductor."""
    fast, _ = _pair(lambda: GSPN2Block(8))
    fast.train()
    x = _images((1, 8, 5, 7), channels_last=True).requires_grad_()
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in fast.named_parameters()}
    fast.zero_grad(set_to_none=True)
    x2 = x.detach().clone(memory_format=torch.channels_last).requires_grad_()
    torch.testing.assert_close(out, fast(x2))
    fast(x2).sum().backward()
    for n, p in fast.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.detach().to(torch.bfloat16)
        torch.testing.assert_close(compiled(xb), fast(xb))


def test_compile_fullgraph_under_autocast_training():
    """The autocast queries of the fast path (LayerNorm dtype, the recomputing functions' backward) trace
    without a graph break under autocast, forward and backward: torch 2.11's Dynamo broke the graph at
    ``torch.amp.is_autocast_available`` in every LayerNorm and then recompiled per channel count."""
    fast, _ = _pair(lambda: GSPN2Block(8))
    fast.train()
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    x = _images((1, 8, 5, 7), channels_last=True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        ref = fast(x)
    torch.testing.assert_close(out, ref)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (grad_ref,) = torch.autograd.grad(ref.float().sum(), x)
    torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("out_chunks,match", [(0, "`out_chunks`"), (5, "`out_chunks` \\(5\\) must divide")])
def test_conv1x1_bad_out_chunks(out_chunks, match):
    with pytest.raises(ValueError, match=match):
        ChunkedConv1x1(4, 8, out_chunks=out_chunks)


def test_conv1x1_is_the_convolution():
    torch.manual_seed(0)
    conv = ChunkedConv1x1(6, 8, out_chunks=2)
    x = torch.randn(2, 6, 3, 5)
    expected = torch.nn.functional.conv2d(x, conv.weight, conv.bias).chunk(2, dim=1)
    got_all = conv(x)
    assert isinstance(got_all, list) and len(got_all) == 2
    for got, want in zip(got_all, expected):
        assert got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, want)
    single = Conv1x1(6, 8)
    torch.testing.assert_close(single(x), torch.nn.functional.conv2d(x, single.weight, single.bias))
