"""The fused CUDA kernels against the float64 reference: outputs, every gradient, dtypes, directions,
chunks, shapes, determinism, poisoned outputs, op registration. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import gspn2  # noqa: F401  (registers the ops)
from gspn2.ops import _cuda, gspn_propagate, gspn_propagate_backward_ref, gspn_propagate_ref, options

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# float32: relative error ||kernel - ref64|| / ||ref64|| allowed per output, kept in one place.
FP32_TOL = {"h": 1e-5, "grad_x": 2e-5, "grad_lam": 2e-5, "grad_gates": 1e-4}
# bf16 / fp16: kernel error <= LOWP_FACTOR x (error of the reference computed in that dtype) + LOWP_SLACK.
LOWP_FACTOR = 2.0
LOWP_SLACK = 1e-4

# (B, C, H, W, K, chunk): H != W, K in {1, 4, C}, groups larger than one block's channel slice (32 > 16),
# lines of one pixel, lines longer than 1024 pixels, W not a multiple of the access width, chunks that
# do not divide the scan length, long lines with many tiles. Lines of up to 1024 pixels run the streaming
# kernels (propagate_streaming.cu): small blocks with 1, 2 and 4 channels (2 and 4 only when that still gives
# the GPU 132 blocks: hence B = 33 and 17), big blocks (one channel, group split over several blocks),
# horizontal scans through the tile stage (W % 8 == 0 forward, W % 4 == 0 backward) and through the ring;
# longer lines run the general kernels. H and W of at most 32 with C / K in {1, 2, 4, 8} run the short-line
# kernels (propagate_short.cu): 4, 2 and 1 lines per warp with lines that fill their lanes (8, 16, 32 pixels)
# and lines that do not, horizontal and vertical lines of different classes in one block (5 x 30), planes
# whose bytes are not a multiple of 16 (the staged copies' unaligned ends), groups of 1, 2, 4 and 8 channels.
CASES = [
    (1, 3, 288, 264, 1, 100),
    (33, 2, 16, 24, 1, 5),
    (33, 2, 14, 14, 1, 7),
    (17, 8, 6, 8, 1, None),
    (17, 8, 9, 13, 1, 4),
    (1, 1, 40, 1024, 1, None),
    (1, 1, 1024, 8, 1, 9),
    (2, 4, 9, 13, 1, None),
    (2, 4, 9, 13, 4, 3),
    (1, 6, 16, 5, 3, 4),
    (2, 4, 7, 8, 4, None),
    (1, 3, 1, 11, 3, None),
    (1, 2, 10, 1, 1, 2),
    (1, 1, 1, 1, 1, None),
    (1, 32, 6, 8, 1, None),
    (1, 16, 12, 20, 1, 5),
    (3, 2, 14, 14, 1, 7),
    (1, 2, 7, 7, 2, None),
    (1, 2, 3, 1100, 2, None),
    (1, 2, 1100, 3, 1, 300),
    (1, 2, 200, 300, 1, None),
    (33, 2, 32, 20, 1, None),
    (17, 4, 24, 32, 2, 6),
    (4, 2, 8, 8, 1, None),
    (4, 2, 16, 16, 1, 3),
    (2, 2, 5, 30, 1, 4),
    (3, 8, 17, 9, 2, None),
    (130, 2, 7, 7, 1, None),
    (5, 3, 8, 8, 1, None),
]


SHORT_CASES = [c for c in CASES if max(c[2], c[3]) <= 32 and c[1] // c[4] in (1, 2, 4, 8)]


def _ids(case):
    B, C, H, W, K, chunk = case
    return f"B{B}C{C}H{H}W{W}K{K}c{chunk}"


def _inputs(B, C, H, W, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).to(dtype)
    lam = torch.randn(B, 4, C, H, W, generator=g, dtype=torch.float64).to(dtype)
    gates = (2 * torch.randn(B, 4, 3, K, H, W, generator=g, dtype=torch.float64)).to(dtype)
    grad_h = torch.randn(B, 4, C, H, W, generator=g, dtype=torch.float64).to(dtype)
    return x, lam, gates, grad_h


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """||a - b|| / max(||b||, scale): relative error, with a floor for outputs that are ~0 exactly
    (gate gradients of one-pixel lines are zero up to rounding)."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values (an element was not written?)"
    return ((a - b).norm() / max(b.norm().item(), scale, 1e-30)).item()


def _poison_cuda_cache() -> None:
    """Fill free blocks of the caching allocator with NaN so that unwritten outputs show up."""
    keep = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(16)]  # small-block pool
    keep.append(torch.full((1 << 26,), float("nan"), device="cuda"))  # large pool
    del keep


def _run_kernel(x, lam, gates, grad_h, chunk):
    xs, ls, gs = (t.cuda().requires_grad_(True) for t in (x, lam, gates))
    _poison_cuda_cache()
    h = gspn_propagate(xs, ls, gs, chunk)
    _poison_cuda_cache()
    grads = torch.autograd.grad(h, (xs, ls, gs), grad_h.cuda())
    torch.cuda.synchronize()
    return (h.detach(), *grads)


def _reference64(x, lam, gates, grad_h, chunk):
    x, lam, gates, grad_h = (t.double() for t in (x, lam, gates, grad_h))
    h = gspn_propagate_ref(x, lam, gates, chunk)
    return (h, *gspn_propagate_backward_ref(grad_h, x, lam, gates, h, chunk))


def _reference_lowp(x, lam, gates, grad_h, chunk):
    """The same computation done by PyTorch in the input dtype (the error yardstick)."""
    xs, ls, gs = (t.clone().requires_grad_(True) for t in (x, lam, gates))
    h = gspn_propagate_ref(xs, ls, gs, chunk, upcast=False)
    grads = torch.autograd.grad(h, (xs, ls, gs), grad_h, allow_unused=True)  # 1x1 images use no gate
    return (h.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (xs, ls, gs))))


NAMES = ("h", "grad_x", "grad_lam", "grad_gates")


def test_extension_is_built_on_gpu_machines():
    assert _cuda.extension_available(), f"gspn2._C failed to import: {_cuda.extension_error()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_float64_reference(case, dtype):
    B, C, H, W, K, chunk = case
    x, lam, gates, grad_h = _inputs(B, C, H, W, K, dtype, seed=hash(case) % 1000)
    got = _run_kernel(x, lam, gates, grad_h, chunk)
    ref = _reference64(x, lam, gates, grad_h, chunk)
    for name, g, r, t in zip(NAMES, got, ref, (x, lam, gates, lam)):
        assert g.dtype == dtype and g.shape == r.shape, name
    scale = 1e-2 * grad_h.double().norm().item()
    if dtype == torch.float32:
        for name, g, r in zip(NAMES, got, ref):
            err = _rel(g, r, scale)
            assert err <= FP32_TOL[name], f"{name}: {err:.3g} > {FP32_TOL[name]}"
    else:
        low = _reference_lowp(x, lam, gates, grad_h, chunk)
        for name, g, r, lo in zip(NAMES, got, ref, low):
            err, bound = _rel(g, r, scale), LOWP_FACTOR * _rel(lo, r, scale) + LOWP_SLACK
            assert err <= bound, f"{name}: kernel {err:.3g} > {bound:.3g} (reference in {dtype})"


# The short-line kernels (kernel="short"; auto takes them where they measured faster) against float64 and
# against the streaming kernels on the same inputs: bitwise equal (same arithmetic in the same order) where
# the streaming plan keeps the group in one block; where it splits the group (gate gradients summed from
# per-slice partials) equal to rounding. The streaming kernels on these shapes against float64.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SHORT_CASES, ids=_ids)
def test_short_kernels_match_float64_reference(case, dtype):
    options.set_options(kernel="short")
    B, C, H, W, K, _ = case
    for backward in (False, True):
        assert _cuda.plan(B, C, H, W, K, str(dtype).split(".")[1], backward=backward)["kernel"] == "short"
    test_matches_float64_reference(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SHORT_CASES, ids=_ids)
def test_short_kernels_equal_streaming_kernels(case, dtype):
    B, C, H, W, K, chunk = case
    name = str(dtype).split(".")[1]
    x, lam, gates, grad_h = _inputs(B, C, H, W, K, dtype, seed=hash(case) % 1000)
    options.set_options(kernel="short")
    got = _run_kernel(x, lam, gates, grad_h, chunk)
    options.set_options(kernel="fast")
    ref = _run_kernel(x, lam, gates, grad_h, chunk)
    one_block = _cuda.plan(B, C, H, W, K, name, backward=True, kernel="fast")["nsl"] == 1
    for name_, g, r in zip(NAMES, got, ref):
        if one_block or name_ != "grad_gates":
            assert torch.equal(g, r), f"{name_}: max |diff| {(g.double() - r.double()).abs().max().item():.3g}"
        else:
            err = _rel(g, r, 1e-2 * grad_h.double().norm().item())
            assert err <= (1e-6 if dtype == torch.float32 else 1e-2), f"{name_}: {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SHORT_CASES, ids=_ids)
def test_streaming_kernels_on_short_lines(case, dtype):
    options.set_options(kernel="fast")
    assert _cuda.plan(*case[:4], case[4], str(dtype).split(".")[1])["kernel"] == "fast"
    test_matches_float64_reference(case, dtype)


# The general kernels (lines longer than 1024 pixels) on shapes the streaming kernels would take.
GENERAL_CASES = [(2, 4, 9, 13, 4, 3), (1, 32, 6, 8, 1, None), (1, 2, 200, 300, 1, None), (3, 2, 14, 14, 1, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GENERAL_CASES, ids=_ids)
def test_general_kernels_match_float64_reference(case, dtype):
    options.set_options(kernel="general")
    assert _cuda.plan(*case[:4], case[4], str(dtype).split(".")[1])["kernel"] == "general"
    test_matches_float64_reference(case, dtype)


# The cluster kernels (horizontal directions, forward and backward; kernel="cluster" forces them on any
# height): 2, 4 and 8 CTAs per line, heights that are not a multiple of its row blocks, CTAs without own
# rows (H = 1, 20), one tile (W = 16), chunk restarts inside and at tile edges, K < C.
CLUSTER_CASES = [
    (33, 1, 40, 16, 1, 5),  # 2 CTAs per line
    (8, 2, 512, 32, 1, None),  # 4
    (1, 1, 1024, 64, 1, 16),  # 8
    (2, 2, 300, 48, 2, 7),
    (1, 4, 37, 64, 2, 3),
    (1, 3, 20, 16, 3, None),
    (1, 2, 1, 32, 1, None),
]


@pytest.mark.parametrize("case", CLUSTER_CASES, ids=_ids)
def test_cluster_kernel_matches_reference_and_streaming(case):
    B, C, H, W, K, chunk = case
    options.set_options(kernel="cluster")
    ncta = _cuda.plan(B, C, H, W, K, "float32")["cluster_ctas"]
    assert ncta in (2, 4, 8)
    test_matches_float64_reference(case, torch.float32)  # the horizontal directions in the cluster kernels
    assert _cuda.plan(B, C, H, W, K, "float32", backward=True)["cluster_ctas"] in (2, 4, 8)
    x, lam, gates, grad_h = _inputs(B, C, H, W, K, torch.float32, seed=3)
    got = _run_kernel(x, lam, gates, grad_h, chunk)
    options.set_options(kernel="fast")
    assert _cuda.plan(B, C, H, W, K, "float32")["cluster_ctas"] == 0
    # Same arithmetic in the same order per pixel: bitwise equal to the streaming kernels, forward and
    # backward (grad_x and the gate gradients of groups summed by the same reduce pass).
    want = _run_kernel(x, lam, gates, grad_h, chunk)
    for name, u, v in zip(NAMES, got, want):
        assert torch.equal(u, v), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CLUSTER_CASES[i] for i in (0, 2, 3, 4)], ids=_ids)
def test_cluster_kernels_16bit(case, dtype):
    """16-bit inputs (32-byte rows) through both cluster kernels: within the low-precision bound of the
    float64 reference, and bitwise equal to the streaming kernels, forward and every gradient (grad_lam in
    the input dtype, the grad_x terms and gate partials in fp32, unsplit gate gradients in the input dtype)."""
    B, C, H, W, K, chunk = case
    name = str(dtype).split(".")[1]
    options.set_options(kernel="cluster")
    assert _cuda.plan(B, C, H, W, K, name)["cluster_ctas"] > 0
    assert _cuda.plan(B, C, H, W, K, name, backward=True)["cluster_ctas"] > 0
    test_matches_float64_reference(case, dtype)
    inputs = _inputs(B, C, H, W, K, dtype, seed=5)
    _poison_cuda_cache()
    got = _run_kernel(*inputs, chunk)
    options.set_options(kernel="fast")
    want = _run_kernel(*inputs, chunk)
    for name_, u, v in zip(NAMES, got, want):
        assert torch.equal(u, v), name_


def _cluster_forward_against_fast(B, C, H, W, K, dtype, chunk, seed, ncta, expected_plan):
    """The forward on the cluster kernels with `ncta` CTAs per line, whose plan must hold `expected_plan`:
    bitwise equal to the streaming kernels."""
    name = str(dtype).split(".")[1]
    options.set_options(kernel="cluster", cluster_ctas=ncta)
    plan = _cuda.plan(B, C, H, W, K, name)
    assert {k: plan[k] for k in expected_plan} == expected_plan
    x, lam, gates, _ = _inputs(B, C, H, W, K, dtype, seed=seed)
    xs, ls, gs = (t.cuda() for t in (x, lam, gates))
    _poison_cuda_cache()
    got = gspn_propagate(xs, ls, gs, chunk)
    options.set_options(kernel="fast", cluster_ctas=0)
    assert _cuda.plan(B, C, H, W, K, name)["cluster_ctas"] == 0
    assert torch.equal(got, gspn_propagate(xs, ls, gs, chunk))


@pytest.mark.parametrize(
    "dtype,ncta,stages",
    [(torch.float32, 2, 1), (torch.float32, 4, 2), (torch.bfloat16, 2, 2)],
    ids=["fp32-1stage", "fp32-2stages", "bf16-2stages"],
)
def test_cluster_forward_stage_buffers(dtype, ncta, stages):
    """The cluster forward with one input stage buffer (float32, 304 rows per CTA) and with two (the next
    tile's loads in flight during the whole tile): bitwise equal to the streaming kernels over many tiles,
    with restarts."""
    _cluster_forward_against_fast(2, 2, 600, 160, 1, dtype, 37, seed=9, ncta=ncta,
                                  expected_plan={"cluster_ctas": ncta, "cluster_stages": stages})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk", [None, 37], ids=["whole", "chunk37"])
def test_cluster_forward_16bit_wide_copies(chunk, dtype):
    """The 16-bit cluster forward with 512 rows per CTA takes one stage buffer of 64-byte rows (two tiles of
    16 steps per copy, read in scan order in both directions): bitwise equal to the streaming kernels over
    several copies, with and without restarts inside copies."""
    _cluster_forward_against_fast(2, 2, 1000, 96, 1, dtype, chunk, seed=11, ncta=2,
                                  expected_plan={"cluster_ctas": 2, "cluster_sub": 2, "cluster_stages": 1})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cluster_backward_16bit_256_rows(dtype):
    """`cluster_ctas` lets the 16-bit backward take 256 rows per CTA (two TMA boxes per plane, 288 threads):
    every gradient bitwise equal to the streaming kernels', with restarts."""
    B, C, H, W, K, chunk = 2, 2, 500, 64, 1, 7
    name = str(dtype).split(".")[1]
    options.set_options(kernel="cluster", cluster_ctas=2)  # 250 rows per CTA, rounded up to 256
    plan = _cuda.plan(B, C, H, W, K, name, backward=True)
    assert plan["cluster_ctas"] == 2 and plan["cluster_smem_bytes"] <= 227 * 1024
    inputs = _inputs(B, C, H, W, K, dtype, seed=10)
    got = _run_kernel(*inputs, chunk)
    options.set_options(kernel="fast", cluster_ctas=0)
    want = _run_kernel(*inputs, chunk)
    for name_, u, v in zip(NAMES, got, want):
        assert torch.equal(u, v), name_


# Split vertical lines (kernel="cluster" splits every vertical line, `cluster_ctas` sets the CTAs per line of
# both cluster kernels): CTAs that own no position (W = 208 on 8 CTAs of 32), several exchanges per scan (every
# 16 steps), restarts on and off the exchange steps, K < C, 4 and 2 CTAs per line.
SPLIT_CASES = [
    ((1, 1, 64, 208, 1, 7), 8),
    ((2, 2, 40, 1008, 2, None), 4),
    ((3, 2, 50, 144, 1, 16), 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,n", SPLIT_CASES, ids=lambda v: _ids(v) if isinstance(v, tuple) else f"n{v}")
def test_split_vertical_lines(case, n, dtype):
    """Within the float64 reference's bounds, and bitwise equal to the streaming kernels (one block per line)."""
    B, C, H, W, K, chunk = case
    name = str(dtype).split(".")[1]
    options.set_options(kernel="cluster", cluster_ctas=n)
    for backward in (False, True):
        plan = _cuda.plan(B, C, H, W, K, name, backward=backward)
        assert plan["split_ctas"] == n and plan["cluster_ctas"] == n, backward
    test_matches_float64_reference(case, dtype)
    inputs = _inputs(B, C, H, W, K, dtype, seed=8)
    got = _run_kernel(*inputs, chunk)
    options.set_options(kernel="fast", cluster_ctas=0)
    assert _cuda.plan(B, C, H, W, K, name)["split_ctas"] == 0
    want = _run_kernel(*inputs, chunk)
    for name_, u, v in zip(NAMES, got, want):
        assert torch.equal(u, v), name_


def test_cluster_and_vertical_launches_side_by_side():
    """The cluster kernel and the split launch run on two streams (plan "overlap"), joined before the op
    returns: called from a stream of the user's and replayed from a CUDA graph, every output bitwise equal to
    the streaming kernels' (one launch)."""
    B, C, H, W, K, chunk = 2, 2, 40, 1008, 2, 7
    for backward in (False, True):
        plan = _cuda.plan(B, C, H, W, K, "float32", backward=backward, kernel="cluster", cluster_ctas=4)
        assert plan["overlap"] and plan["split_ctas"] == 4, backward
    x, lam, gates, grad_h = (t.cuda() for t in _inputs(B, C, H, W, K, torch.float32, seed=11))

    def both(kernel, ncta):
        h = torch.ops.gspn2.propagate(x, lam, gates, chunk, kernel, ncta)
        return (h, *torch.ops.gspn2.propagate_backward(grad_h, x, lam, gates, h, chunk, kernel, ncta))

    want = both("fast", 0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _poison_cuda_cache()
        got = both("cluster", 4)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = both("cluster", 4)
    for out in captured:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for name, u, v, w in zip(NAMES, got, captured, want):
        assert torch.equal(u, w), name
        assert torch.equal(v, w), name


def test_cluster_kernel_deterministic_and_chosen_by_auto():
    """auto: the forward's cluster kernel from H = 512 (every dtype), the backward's by problem size."""
    options.set_options(kernel="auto")
    assert _cuda.plan(1, 2, 768, 32, 2, "float32")["cluster_ctas"] == 8
    x, lam, gates, _ = _inputs(1, 2, 768, 32, 2, torch.float32, seed=4)
    xs, ls, gs = (t.cuda() for t in (x, lam, gates))
    a = gspn_propagate(xs, ls, gs, 40)
    assert torch.equal(a, gspn_propagate(xs, ls, gs, 40))
    torch.testing.assert_close(a, gspn_propagate_ref(xs.double(), ls.double(), gs.double(), 40).float(), rtol=1e-5, atol=1e-5)
    # The backward from 2^20 elements (B * C * H * W) on: deterministic, and equal to the float64 reference.
    case = (16, 4, 128, 128, 2, None)
    for dt in ("float32", "bfloat16", "float16"):  # the backward in every dtype, the forward from H = 512
        assert _cuda.plan(*case[:5], dt, backward=True)["cluster_ctas"] > 0, dt
        assert _cuda.plan(*case[:5], dt)["cluster_ctas"] == 0, dt
        assert _cuda.plan(1, 2, 512, 32, 2, dt)["cluster_ctas"] == 8, dt
    inputs = _inputs(*case[:5], torch.float32, seed=6)
    got = _run_kernel(*inputs, None)
    for name, u, v in zip(NAMES, got, _run_kernel(*inputs, None)):
        assert torch.equal(u, v), name
    ref = _reference64(*(t.cuda() for t in inputs), None)
    scale = 1e-2 * inputs[3].double().norm().item()
    for name, g, r in zip(NAMES, got, ref):
        assert _rel(g, r, scale) <= FP32_TOL[name], name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 32, 33, 40, 1), (16, 8, 28, 28, 1)], ids=["partials", "short"])
def test_deterministic(dtype, shape):
    # Two slices per group (gate partials); the short-line kernels (grad_x summed in shared memory).
    x, lam, gates, grad_h = _inputs(*shape, dtype, seed=5)
    a = _run_kernel(x, lam, gates, grad_h, 6)
    b = _run_kernel(x, lam, gates, grad_h, 6)
    for name, u, v in zip(NAMES, a, b):
        assert torch.equal(u, v), name


def test_non_contiguous_and_misaligned_inputs():
    x, lam, gates, grad_h = _inputs(2, 4, 10, 12, 2, torch.float32, seed=7)
    base = _run_kernel(x, lam, gates, grad_h, None)
    xt = x.cuda().transpose(-1, -2).contiguous().transpose(-1, -2)
    lt = lam.cuda().permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    gbig = torch.zeros(2, 4, 3, 2, 10, 24, device="cuda")
    gbig[..., ::2] = gates.cuda()
    gt = gbig[..., ::2]
    assert not (xt.is_contiguous() or lt.is_contiguous() or gt.is_contiguous())
    got = _run_kernel(xt, lt, gt, grad_h, None)
    for name, u, v in zip(NAMES, got, base):
        assert torch.equal(u, v), name
    # Contiguous but not 16-byte aligned (a storage offset of one element).
    flat = torch.empty(x.numel() + 1, device="cuda")
    xm = flat[1:].view_as(x).copy_(x.cuda())
    assert xm.data_ptr() % 16 != 0
    got = _run_kernel(xm, lam, gates, grad_h, None)
    for name, u, v in zip(NAMES, got, base):
        assert torch.equal(u, v), name


@pytest.mark.parametrize("chunk", [None, 3])
def test_opcheck(chunk):
    x, lam, gates, grad_h = _inputs(1, 4, 5, 6, 2, torch.float32, seed=9)
    xs, ls, gs = (t.cuda().requires_grad_(True) for t in (x, lam, gates))
    torch.library.opcheck(torch.ops.gspn2.propagate.default, (xs, ls, gs, chunk, "auto", 0))
    xs, ls, gs = (t.cuda() for t in (x, lam, gates))
    h = gspn_propagate(xs, ls, gs, chunk)
    torch.library.opcheck(torch.ops.gspn2.propagate_backward.default, (grad_h.cuda(), xs, ls, gs, h, chunk, "auto", 0))


def test_torch_compile_fullgraph():
    x, lam, gates, _ = _inputs(1, 4, 8, 6, 1, torch.float32, seed=10)
    xs, ls, gs = (t.cuda().requires_grad_(True) for t in (x, lam, gates))

    def f(x, lam, gates):
        return (gspn_propagate(x * 2, lam, gates, 3) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(xs, ls, gs)
    grads = torch.autograd.grad(loss, (xs, ls, gs))
    loss_ref = f(xs, ls, gs)
    grads_ref = torch.autograd.grad(loss_ref, (xs, ls, gs))
    torch.testing.assert_close(loss, loss_ref)
    for g, e in zip(grads, grads_ref):
        torch.testing.assert_close(g, e)


def test_float64_runs_the_reference_and_gradcheck():
    x, lam, gates, _ = _inputs(1, 2, 3, 4, 1, torch.float64, seed=11)
    args = tuple(t.cuda().requires_grad_(True) for t in (x, lam, gates))
    assert torch.autograd.gradcheck(lambda a, b, c: gspn_propagate(a, b, c, 2), args)


def test_reference_backend_option():
    x, lam, gates, _ = _inputs(1, 2, 5, 6, 1, torch.float32, seed=12)
    xs, ls, gs = (t.cuda().requires_grad_(True) for t in (x, lam, gates))
    with options.override(backend="reference"):
        h_ref = gspn_propagate(xs, ls, gs)
    assert h_ref.grad_fn is not None and "gspn2" not in type(h_ref.grad_fn).__name__.lower()
    torch.testing.assert_close(gspn_propagate(xs, ls, gs), h_ref, rtol=1e-5, atol=1e-5)


def test_checks_name_the_tensor():
    """The C++ checks of the CUDA implementation (also reached by calling torch.ops.gspn2.propagate directly)."""
    x, lam, gates, _ = _inputs(1, 4, 5, 6, 2, torch.float32, seed=13)
    xs, ls, gs = (t.cuda() for t in (x, lam, gates))
    op, bwd = torch.ops.gspn2.propagate, torch.ops.gspn2.propagate_backward
    with pytest.raises(ValueError, match=r"`lam` must have shape \(B, 4, C, H, W\) = \[1, 4, 4, 5, 6\]"):
        gspn_propagate(xs, ls[:, :, :, :4], gs)
    with pytest.raises(ValueError, match=r"`gates` must have shape"):
        op(xs, ls, gs[:, :3], None, "auto", 0)
    with pytest.raises(ValueError, match=r"`x` must be a CUDA tensor"):
        op(x, ls, gs, None, "auto", 0)
    with pytest.raises(TypeError, match=r"`gates` must have dtype"):
        op(xs, ls, gs.half(), None, "auto", 0)
    with pytest.raises(TypeError, match=r"`x` must be float32, float16 or bfloat16"):
        op(xs.int(), ls.int(), gs.int(), None, "auto", 0)
    with pytest.raises(ValueError, match=r"`chunk` must be None or >= 1"):
        op(xs, ls, gs, -1, "auto", 0)
    with pytest.raises(ValueError, match=r"`kernel` must be"):
        op(xs, ls, gs, None, "FAST", 0)
    with pytest.raises(ValueError, match=r"`gates` must have shape"):
        op(xs, ls, gs[:, :, :, :, :, :1], None, "auto", 0)  # no silent broadcast
    h = op(xs, ls, gs, None, "auto", 0)
    with pytest.raises(ValueError, match=r"`grad_h` must have shape"):
        bwd(h[:, :2], xs, ls, gs, h, None, "auto", 0)


def test_no_nan_leak_from_gates_outside_the_line():
    """A non-finite logit of a neighbour outside the line is ignored by the normalisation, in the kernels too."""
    for dtype in DTYPES:
        x, lam, gates, grad_h = _inputs(2, 2, 7, 9, 1, dtype, seed=14)
        gates = gates.clone()
        gates[:, 0:2, 0, :, 0, :] = float("nan")  # offset -1 of line position 0 (lines are columns)
        gates[:, 0:2, 2, :, -1, :] = float("inf")  # offset +1 of the last position
        gates[:, 2:4, 0, :, :, 0] = float("nan")  # rows: offset -1 of column 0
        got = _run_kernel(x, lam, gates, grad_h, None)
        for name, g in zip(NAMES, got):
            assert torch.isfinite(g).all(), (dtype, name)


_HOST_CHECK_SCRIPT = """
import torch, gspn2
x = torch.randn(1, 4, 5, 6, device="cuda")
lam = torch.randn(1, 4, 4, 5, 6, device="cuda")
gates = torch.randn(1, 4, 3, 2, 5, 6, device="cuda")
for args in ((x, lam[..., :4], gates), (x.cpu(), lam, gates)):
    try:
        torch.ops.gspn2.propagate(*args, None, "auto", 0)
    except ValueError as e:
        print(str(e).splitlines()[0])
"""


def test_cpp_checks_name_the_tensor():
    """C++ exceptions from the extension reach Python as ValueError (not a crash), in a subprocess."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HOST_CHECK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert "`lam` must have shape (B, 4, C, H, W) = [1, 4, 4, 5, 6], got [1, 4, 4, 5, 4]" in lines[-2]
    assert "`x` must be a CUDA tensor" in lines[-1]
