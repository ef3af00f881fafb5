"""The CUDA extension is part of the build wherever nvcc exists (CI compiles it on a CPU-only machine)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from gspn2.ops import _cuda, options


def _nvcc_present() -> bool:
    """The same search as setup.py: CUDA_HOME / CUDA_PATH, /usr/local/cuda, then the PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return True
    return os.path.isfile("/usr/local/cuda/bin/nvcc") or shutil.which("nvcc") is not None


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_extension_built_and_imports():
    assert _cuda.extension_available(), (
        f"nvcc is present but gspn2._C did not import ({_cuda.extension_error()}); "
        "rebuild with `pip install --no-build-isolation -e .`"
    )
    for name in ("plan", "limits"):
        assert callable(getattr(_cuda._C, name))
    # Importing the extension registered the CUDA kernels of every gspn2 op, and their autograd in C++.
    for op in ("propagate", "propagate_backward", "depthwise_conv2d", "depthwise_conv2d_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gspn2::{op}", "CUDA"), op
    for op in ("propagate", "depthwise_conv2d"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gspn2::{op}", "AutogradCUDA"), op


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_kernel_choice():
    """Planning needs no GPU: lines of up to 1024 pixels take the streaming kernels, longer ones the
    general kernels; the `kernel` argument forces a family and is validated."""
    model = _cuda.plan(128, 2, 56, 56, 1, "bfloat16")
    assert model["kernel"] == "fast" and model["cs"] == 2 and model["blocks"] == 512
    # Few blocks (B = 1, shared gates): one channel per block rather than idle SMs.
    assert _cuda.plan(1, 8, 256, 256, 1, "float32")["cs"] == 1
    big = _cuda.plan(16, 2, 1024, 1024, 2, "float32")
    assert big["kernel"] == "fast" and big["threads"] == 1024 and big["cs"] == 1 and big["tile_h"]
    # The backward's exchange line: padded to an odd stride (conflict-free), except in 1024-thread blocks
    # where only the unpadded line leaves room for the horizontal tile stage (float32, lines near 1024).
    assert _cuda.plan(128, 2, 56, 56, 1, "bfloat16", backward=True)["line_stride"] == 9
    assert _cuda.plan(128, 2, 56, 56, 1, "bfloat16")["line_stride"] == 3
    near = _cuda.plan(1, 1, 40, 1024, 1, "float32", backward=True, kernel="fast")
    assert near["threads"] == 1024 and near["line_stride"] == 4 and near["tile_h"]
    assert _cuda.plan(1, 1, 40, 512, 1, "float32", backward=True, kernel="fast")["line_stride"] == 5
    # ... and padded when the cluster kernel takes the horizontal directions (no stage needed).
    clustered = _cuda.plan(16, 2, 1024, 1024, 2, "float32", backward=True)
    assert clustered["cluster_ctas"] > 0 and clustered["line_stride"] == 5
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32", backward=True, kernel="fast")["line_stride"] == 4
    assert _cuda.plan(1, 2, 1100, 3, 1, "float32")["kernel"] == "general"
    longest = _cuda.limits()["fast_max_line"]  # the extension's limit, not a copy
    assert _cuda.plan(1, 2, longest, 3, 1, "float32")["kernel"] == "fast"
    assert _cuda.plan(1, 2, longest + 1, 3, 1, "float32")["kernel"] == "general"
    with pytest.raises(ValueError, match="kernel='fast'.*1024"):
        _cuda.plan(1, 2, 1100, 3, 1, "float32", kernel="fast")
    with pytest.raises(ValueError, match="`kernel` must be 'auto', 'fast', 'general', 'cluster' or 'short'"):
        _cuda.plan(1, 2, 10, 10, 1, "float32", kernel="FAST")


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_short_kernel_choice():
    """H and W of at most 32 with C / K in {1, 2, 4, 8} and enough blocks take the short-line kernels under
    auto: one block per (batch, group), one launch per pass, as many lines per warp as fit; otherwise the
    streaming kernels, and kernel='short' names what it needs."""
    longest = _cuda.limits()["short_max_line"]
    assert longest == 32
    for side, per_warp in ((7, 2), (8, 2), (9, 2), (14, 2), (17, 1), (28, 1)):
        for backward in (False, True):
            plan = _cuda.plan(128, 2, side, side, 1, "bfloat16", backward=backward)
            assert plan["kernel"] == "short", (side, backward)
            assert plan["lines_per_warp"] == per_warp and plan["threads"] == 32 * 4 // per_warp
            assert plan["blocks"] == 128 and plan["cs"] == 2 and plan["nsl"] == 1
    # Bank conflicts of the horizontal lanes (rows of W elements read down a column): 16-bit W = 16 is 4-way,
    # W = 32 16-way, float32 W = 28 4-way (taken: lines of at least 24 pixels), W = 32 32-way.
    assert _cuda.plan(128, 2, 16, 16, 1, "bfloat16")["kernel"] == "fast"
    assert _cuda.plan(128, 2, 32, 32, 1, "bfloat16")["kernel"] == "fast"
    assert _cuda.plan(128, 2, 28, 28, 1, "float32")["kernel"] == "short"
    assert _cuda.plan(128, 2, 32, 32, 1, "float32")["kernel"] == "fast"
    assert _cuda.plan(128, 2, 16, 16, 1, "bfloat16", kernel="short")["lines_per_warp"] == 2
    assert _cuda.plan(128, 2, 32, 32, 1, "bfloat16", kernel="short")["lines_per_warp"] == 1
    # Groups of 8 channels on lines of up to 8 pixels: the streaming kernels (measured faster).
    assert _cuda.plan(128, 8, 7, 7, 1, "bfloat16")["kernel"] == "fast"
    assert _cuda.plan(128, 8, 14, 14, 1, "bfloat16")["kernel"] == "short"
    assert _cuda.plan(20, 8, 5, 30, 4, "float32")["blocks"] == 80  # one block per (batch, group)
    # The block's planes: x, 4 x lam, 12 gate planes (forward); + 4 x grad_h, 4 x h and 4 fp32 grad_x terms.
    fwd = _cuda.plan(128, 2, 28, 28, 1, "bfloat16")["smem_bytes"]
    bwd = _cuda.plan(128, 2, 28, 28, 1, "bfloat16", backward=True)["smem_bytes"]
    assert fwd == 5 * (2 * 784 * 2 + 16) + 12 * (784 * 2 + 16)
    assert bwd == 13 * (2 * 784 * 2 + 16) + 12 * (784 * 2 + 16) + 4 * 2 * 784 * 4
    # Not taken: a line over 32 pixels, a group size they are not built for, planes beyond shared memory.
    assert _cuda.plan(128, 2, 33, 8, 1, "bfloat16")["kernel"] == "fast"
    assert _cuda.plan(128, 3, 8, 8, 1, "float32")["kernel"] == "fast"
    assert _cuda.plan(128, 8, 28, 28, 1, "bfloat16", backward=True)["kernel"] == "fast"
    assert _cuda.plan(128, 8, 28, 28, 1, "bfloat16")["kernel"] == "short"
    assert _cuda.plan(128, 2, 28, 28, 1, "bfloat16", kernel="fast")["kernel"] == "fast"
    # Under auto, blocks for at least half the SMs (planned as on an H200: 132); kernel='short' takes any batch.
    assert _cuda.plan(66, 2, 14, 14, 1, "bfloat16")["kernel"] == "short"
    assert _cuda.plan(65, 2, 14, 14, 1, "bfloat16")["kernel"] == "fast"
    assert _cuda.plan(1, 8, 32, 32, 1, "float32", kernel="short")["blocks"] == 1
    with pytest.raises(ValueError, match="kernel='short' needs H and W of at most 32.*H = 40"):
        _cuda.plan(1, 2, 40, 8, 1, "float32", kernel="short")
    with pytest.raises(ValueError, match="kernel='short'.*C / K = 3"):
        _cuda.plan(1, 3, 8, 8, 1, "float32", kernel="short")


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_cluster_kernel_choice():
    """Under auto (planned as on an H200 here) the horizontal directions go to the cluster kernels: the
    forward (every dtype) for H >= 512, the backward (every dtype) for B * C * H * W >= 2^20; the fewest CTAs
    per line, doubled while SMs would idle; never W not a multiple of its tile, or smaller problems.
    kernel="cluster" forces it and names what it needs."""
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32")["cluster_ctas"] == 2  # 128 CTAs on 132 SMs
    assert _cuda.plan(4, 2, 1024, 1024, 2, "float32")["cluster_ctas"] == 8  # 16 lines: doubled twice
    assert _cuda.plan(16, 2, 768, 768, 2, "float32")["cluster_ctas"] == 2
    for dt in ("float32", "bfloat16", "float16"):  # the forward from H = 512, every dtype
        assert _cuda.plan(16, 2, 512, 512, 2, dt)["cluster_ctas"] == 2, dt
        assert _cuda.plan(1, 8, 512, 512, 1, dt)["cluster_ctas"] == 8, dt
        assert _cuda.plan(1, 8, 384, 384, 1, dt)["cluster_ctas"] == 0, dt
    big = _cuda.plan(1, 8, 1024, 1024, 8, "float32")
    assert big["cluster_ctas"] == 8 and 0 < big["cluster_smem_bytes"] <= 227 * 1024
    # The forward's two input stage buffers where they fit: 16-bit rows (32 bytes), or float32 with at most
    # 256 rows per CTA; float32 with 512 rows keeps one (two would need 390 KB). 16-bit inputs take one buffer
    # of 64-byte rows (two tiles per copy) where two of those do not fit but one does: 512 rows per CTA.
    assert big["cluster_stages"] == 2  # 128 rows per CTA
    for dt, ctas, stages, sub in [("float32", 2, 1, 1), ("float32", 4, 2, 1), ("bfloat16", 2, 1, 2),
                                  ("bfloat16", 4, 2, 1), ("bfloat16", 8, 2, 1), ("float16", 2, 1, 2),
                                  ("float16", 4, 2, 1)]:
        pl = _cuda.plan(16, 2, 1024, 1024, 2, dt, cluster_ctas=ctas)
        assert (pl["cluster_ctas"], pl["cluster_stages"], pl["cluster_sub"]) == (ctas, stages, sub), (dt, ctas)
        assert pl["cluster_smem_bytes"] <= 227 * 1024, (dt, ctas)
    for dt in ("bfloat16", "float16"):
        assert _cuda.plan(16, 2, 768, 768, 2, dt)["cluster_sub"] == 2, dt  # 384 rows per CTA
        assert _cuda.plan(16, 2, 512, 512, 2, dt)["cluster_sub"] == 1, dt  # 256 rows: two 64-byte buffers fit
        assert _cuda.plan(16, 2, 1024, 1008, 2, dt)["cluster_sub"] == 1, dt  # W not a multiple of 32
        assert _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True)["cluster_sub"] == 1, dt
    assert _cuda.plan(16, 2, 768, 768, 2, "float32")["cluster_sub"] == 1
    assert _cuda.plan(16, 2, 1024, 1024, 2, "bfloat16")["cluster_ctas"] == 2
    no_cluster = [(16, 2, 1024, 1000, 2, "float32"), (16, 2, 1000, 1000, 2, "bfloat16"),
                  (64, 2, 256, 256, 2, "float32")]
    for args in no_cluster:
        assert _cuda.plan(*args)["cluster_ctas"] == 0, args
    for dt in ("float32", "bfloat16", "float16"):
        assert _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True)["cluster_ctas"] == 8, dt  # <= 128 rows per CTA
    # The 16-bit backward's CTAs fit two per SM (228 KB of shared memory, 1 KB of it reserved per CTA).
    for dt in ("bfloat16", "float16"):
        assert 2 * (_cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True)["cluster_smem_bytes"] + 1024) <= 228 * 1024
    # Threads per CTA: one per row and halo row (128 + 2 x 16); the float32 backward's phase B two per row.
    assert big["cluster_threads"] == 160
    for dt, threads in [("float32", 320), ("bfloat16", 160), ("float16", 160)]:
        assert _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True)["cluster_threads"] == threads, dt
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32")["cluster_threads"] == 544  # forward: 512 rows per CTA
    # Side by side on two streams: every backward with the cluster kernel, the forward with two stage buffers.
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32", backward=True)["overlap"]
    assert not _cuda.plan(16, 2, 1024, 1024, 2, "float32")["overlap"]  # one stage buffer
    assert _cuda.plan(16, 2, 512, 512, 2, "bfloat16")["overlap"]
    assert not _cuda.plan(16, 2, 1024, 1024, 2, "bfloat16")["overlap"]  # one stage buffer of 64-byte rows
    assert _cuda.plan(16, 2, 512, 512, 2, "float32")["overlap"]
    # The backward by problem size: 64 x 2 x 128^2 = 2^21 elements yes, 16 x 2 x 128^2 and 1 x 8 x 256^2 no.
    assert _cuda.plan(64, 2, 128, 128, 2, "float32", backward=True)["cluster_ctas"] == 2
    assert _cuda.plan(32, 49, 32, 32, 49, "float32", backward=True)["cluster_ctas"] == 2
    for args in [(16, 2, 128, 128, 2), (1, 8, 256, 256, 1), (64, 2, 128, 128, 2)]:
        assert _cuda.plan(*args, "float32")["cluster_ctas"] == 0, args  # the forward: H < 512
    assert _cuda.plan(64, 2, 128, 128, 2, "bfloat16", backward=True)["cluster_ctas"] == 2
    # 16-bit: also H >= 64 (bf16 32 x 49 x 32^2, 1.6 M elements, measured slower with the cluster kernel)
    assert _cuda.plan(32, 49, 32, 32, 49, "bfloat16", backward=True)["cluster_ctas"] == 0
    assert _cuda.plan(128, 8, 64, 64, 1, "bfloat16", backward=True)["cluster_ctas"] == 2
    for args in [(16, 2, 128, 128, 2, "float32"), (1, 8, 256, 256, 1, "float32"), (16, 2, 128, 128, 2, "bfloat16")]:
        assert _cuda.plan(*args, backward=True)["cluster_ctas"] == 0, args
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32", kernel="fast")["cluster_ctas"] == 0
    # The vertical lines split over a cluster where one block per line leaves SMs idle (with the cluster
    # kernels only): 64 lines of 1024 on 2 CTAs each, 16 lines on 8; not where the lines fill the GPU.
    for dt in ("float32", "bfloat16"):
        assert _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True)["split_ctas"] == 2, dt
        assert _cuda.plan(16, 2, 1024, 1024, 2, dt)["split_ctas"] == 2, dt
    assert _cuda.plan(16, 2, 384, 384, 2, "bfloat16")["split_ctas"] == 0  # no cluster forward below H = 512
    assert _cuda.plan(1, 8, 1024, 1024, 1, "float32")["split_ctas"] == 8
    assert _cuda.plan(128, 8, 64, 64, 1, "bfloat16", backward=True)["split_ctas"] == 0
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32", kernel="fast")["split_ctas"] == 0
    options.set_options(kernel="cluster")  # every vertical line split, 2 CTAs or more
    assert _cuda.plan(16, 2, 1024, 1024, 2, "bfloat16")["split_ctas"] == 2
    assert _cuda.plan(128, 8, 64, 64, 1, "bfloat16", backward=True)["split_ctas"] == 2
    options.set_options(kernel="cluster")  # the process option fills `kernel` (restored by the fixture)
    assert _cuda.plan(2, 2, 40, 16, 1, "float32")["cluster_ctas"] > 0  # any height
    assert _cuda.plan(8, 2, 512, 512, 2, "float32")["cluster_ctas"] == 4  # 32 lines x 2 CTAs < 0.9 x 132 SMs
    assert _cuda.plan(1, 8, 256, 256, 8, "float32")["cluster_ctas"] == 8
    assert _cuda.plan(8, 2, 512, 512, 2, "float32", backward=True)["cluster_ctas"] == 4
    assert _cuda.plan(2, 2, 40, 16, 1, "bfloat16")["cluster_ctas"] > 0  # forced: the forward in 16-bit too
    assert _cuda.plan(2, 2, 40, 16, 1, "bfloat16", backward=True)["cluster_ctas"] > 0
    with pytest.raises(ValueError, match="kernel='cluster'.*multiple of 16"):
        _cuda.plan(2, 2, 40, 24, 1, "float32")
    with pytest.raises(ValueError, match="kernel='cluster'.*1024"):
        _cuda.plan(1, 2, 1100, 32, 1, "float32")
    with pytest.raises(ValueError, match="`dtype` must be"):
        _cuda.plan(1, 2, 10, 10, 1, "fp32")
    # `cluster_ctas` (benchmarks) overrides the count where the rows fit, and is validated.
    assert _cuda.plan(16, 2, 1024, 1024, 2, "float32", cluster_ctas=4)["cluster_ctas"] == 4
    with pytest.raises(ValueError, match="`cluster_ctas` must be 0"):
        _cuda.plan(16, 2, 1024, 1024, 2, "float32", cluster_ctas=3)
    with pytest.raises(ValueError, match="`cluster_ctas` = 2 leaves more than 128 rows"):
        _cuda.plan(16, 2, 1024, 1024, 2, "float32", backward=True, cluster_ctas=2)
    # The 16-bit backward takes up to 256 rows per CTA there (two TMA boxes per plane, within one SM's shared
    # memory); auto keeps 128.
    for dt in ("bfloat16", "float16"):
        wide = _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True, cluster_ctas=4)
        assert wide["cluster_ctas"] == 4 and wide["cluster_smem_bytes"] <= 227 * 1024, dt
        with pytest.raises(ValueError, match="`cluster_ctas` = 2 leaves more than 256 rows"):
            _cuda.plan(16, 2, 1024, 1024, 2, dt, backward=True, cluster_ctas=2)


def test_options_parse_the_environment_once_and_strictly():
    assert options.from_env({}) == options.Options()
    got = options.from_env(
        {"GSPN2_BACKEND": " Reference ", "GSPN2_KERNEL": "FAST", "GSPN2_DWCONV": "", "GSPN2_MERGE": "Fused",
         "GSPN2_MLP": "SEPARATE", "GSPN2_NORM_BACKWARD": " fused", "GSPN2_EAGER_AUTOGRAD": "Python",
         "GSPN2_SMALL_GEMM": "GEMM", "GSPN2_RECOMPUTE": "All", "GSPN2_NORM_AFFINE": "Weight",
         "GSPN2_ADDMM": " Split"}
    )
    assert (got.backend, got.kernel, got.dwconv, got.merge, got.mlp, got.norm_backward, got.eager_autograd,
            got.small_gemm, got.recompute, got.norm_affine, got.addmm) == (
        "reference", "fast", "auto", "fused", "separate", "fused", "python", "gemm", "all", "weight", "split")
    for var in ("GSPN2_BACKEND", "GSPN2_KERNEL", "GSPN2_DWCONV", "GSPN2_MERGE", "GSPN2_MLP", "GSPN2_NORM_BACKWARD",
                "GSPN2_EAGER_AUTOGRAD", "GSPN2_SMALL_GEMM", "GSPN2_RECOMPUTE", "GSPN2_NORM_AFFINE",
                "GSPN2_ADDMM"):
        with pytest.raises(ValueError, match=var):
            options.from_env({var: "nonsense"})
    with pytest.raises(ValueError, match="`kernel`"):
        options.set_options(kernel="bogus")
    with pytest.raises(ValueError, match="`cluster_ctas`"):
        options.set_options(cluster_ctas=3)
    with pytest.raises(ValueError, match="`merge`"):
        options.set_options(merge="one")
    with pytest.raises(ValueError, match="`mlp`"):
        options.set_options(mlp="both")
    with pytest.raises(ValueError, match="`norm_backward`"):
        options.set_options(norm_backward="yes")
    with pytest.raises(ValueError, match="`small_gemm`"):
        options.set_options(small_gemm="matmul")
    with pytest.raises(ValueError, match="`recompute`"):
        options.set_options(recompute="none")
    with pytest.raises(ValueError, match="`norm_affine`"):
        options.set_options(norm_affine="gemm")
    with pytest.raises(ValueError, match="`addmm`"):
        options.set_options(addmm="unfused")
    with pytest.raises(TypeError, match="unknown gspn2 option"):
        options.set_options(kernal="fast")
    with options.override(kernel="general") as o:
        assert o.kernel == options.kernel_family() == "general"
    assert options.kernel_family() == "auto"


def test_op_arguments_are_validated_on_cpu():
    x, lam, gates = torch.randn(1, 2, 3, 4), torch.randn(1, 4, 2, 3, 4), torch.randn(1, 4, 3, 1, 3, 4)
    with pytest.raises(ValueError, match="`kernel` must be"):
        torch.ops.gspn2.propagate(x, lam, gates, None, "FAST", 0)
    with pytest.raises(ValueError, match="`cluster_ctas` must be"):
        torch.ops.gspn2.propagate(x, lam, gates, None, "auto", 5)


def test_cpu_tensors_run_the_reference():
    from gspn2.ops import gspn_propagate, gspn_propagate_ref

    options.set_options(backend="reference", kernel="general")  # neither is consulted on CPU
    x, lam, gates = torch.randn(1, 2, 3, 4), torch.randn(1, 4, 2, 3, 4), torch.randn(1, 4, 3, 1, 3, 4)
    torch.testing.assert_close(gspn_propagate(x, lam, gates), gspn_propagate_ref(x, lam, gates))


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_dwconv_tensor_core_plan():
    """The tensor-core kernels' weight-gradient plan (no GPU needed): tiles of 16 rows x 8 or 16 columns (the
    fewest that cover W), chunks that cover the tiles, about 256 CTAs over the channel blocks."""
    # gspn2_tiny's mixer at 56^2: 4 x 4 tiles of 16 x 16 per image, 4 blocks of 32 channels, 64 chunks each.
    q = _cuda.dwconv_mma_plan(128, 120, 56, 56)
    assert (q["tiles_h"], q["tiles_w"], q["tiles"], q["channel_blocks"]) == (4, 4, 2048, 4)
    assert (q["chunks"], q["tiles_per_chunk"]) == (64, 32)
    assert _cuda.dwconv_mma_plan(2, 8, 7, 7)["tiles_w"] == 1  # 8 columns
    assert _cuda.dwconv_mma_plan(2, 8, 14, 14)["tiles_w"] == 1  # 16 columns
    assert _cuda.dwconv_mma_plan(2, 8, 14, 40)["tiles_w"] == 3
    for B, C, H, W in [(41, 1024, 7, 7), (3, 16, 9, 33), (1, 8, 1, 1), (7, 960, 300, 17)]:
        q = _cuda.dwconv_mma_plan(B, C, H, W)
        assert q["tiles"] == B * q["tiles_h"] * q["tiles_w"] and q["tiles_h"] * 16 >= H
        assert q["channel_blocks"] * 32 >= C
        assert q["chunks"] * q["channel_blocks"] <= 256 + q["channel_blocks"]
        assert (q["chunks"] - 1) * q["tiles_per_chunk"] < q["tiles"] <= q["chunks"] * q["tiles_per_chunk"]
    with pytest.raises(ValueError, match="must be >= 1"):
        _cuda.dwconv_mma_plan(0, 8, 7, 7)


@pytest.mark.skipif(not _nvcc_present(), reason="no nvcc: setup.py builds the reference-only package")
@pytest.mark.skipif(os.environ.get("GSPN2_BUILD_CUDA") == "0", reason="GSPN2_BUILD_CUDA=0 skips the extension")
def test_dwconv_tile_plan():
    """The depthwise tile kernels' plan (no GPU needed): warp tiles that cover the image, chunks that cover
    the tiles, every kernel's shared memory within the budget, fewer warps where 8 would not fit."""
    # gspn2_tiny's mixer at 56^2, bf16: 7 warp tiles of 4 x 4 across (4 x 28 outputs per CTA).
    q = _cuda.dwconv_plan(128, 120, 56, 56, 7, "bfloat16")
    assert (q["sub_h"], q["sub_w"], q["tiles_h"], q["tiles_w"], q["channel_blocks"]) == (1, 7, 14, 2, 4)
    # the buffers' mbarriers (128 bytes), taps (fp32), two staging buffers of the halo tile (bf16)
    assert q["smem_forward"] == 128 + 7 * 7 * 32 * 4 + 2 * (4 + 6) * (28 + 6) * 32 * 2
    for args in [(128, 120, 56, 56, 7, "bfloat16"), (41, 1024, 7, 7, 7, "float32"), (3, 17, 9, 33, 5, "float16"),
                 (2, 64, 224, 3, 3, "float32"), (1, 8, 1, 1, 7, "bfloat16")]:
        for cols in (4, 8):
            q = _cuda.dwconv_plan(*args, cols=cols)
            B, C, H, W = args[:4]
            assert q["tiles_h"] * q["sub_h"] * q["rows"] >= H and q["tiles_w"] * q["sub_w"] * cols >= W, (args, q)
            assert q["tiles"] == B * q["tiles_h"] * q["tiles_w"] and q["channel_blocks"] * 32 >= C
            assert (q["chunks"] - 1) * q["tiles_per_chunk"] < q["tiles"] <= q["chunks"] * q["tiles_per_chunk"]
            assert max(q["smem_forward"], q["smem_wgrad"], q["smem_backward"]) <= q["smem_limit"] == 96 * 1024
    # float32 7x7 on 7^2: 4 warps would need 107 KB in the one-pass backward, so the plan takes 2.
    q = _cuda.dwconv_plan(41, 1024, 7, 7, 7, "float32")
    assert q["sub_h"] * q["sub_w"] == 2 and q["tiles_per_chunk"] == 3
    # A smaller GPU's limit shrinks the CTA tile further.
    assert _cuda.dwconv_plan(41, 1024, 7, 7, 7, "float32", smem_limit=48 * 1024)["sub_h"] == 1
    with pytest.raises(ValueError, match="`K` must be 3, 5 or 7"):
        _cuda.dwconv_plan(1, 8, 8, 8, 9)
    with pytest.raises(ValueError, match="`cols` must be 4 or 8"):
        _cuda.dwconv_plan(1, 8, 8, 8, 3, cols=6)
    with pytest.raises(ValueError, match="`dtype` must be"):
        _cuda.dwconv_plan(1, 8, 8, 8, 3, "float64")
