"""gspn2's compiled extension (``gspn2._C``): the only module that imports it.

Importing the extension registers, in C++, the CUDA implementations of the ``gspn2::`` ops and their
autograd formulas for CUDA tensors (``gspn2/csrc/propagate.cpp``, ``gspn2/csrc/dwconv.cpp``), and the
device-generic C++ ops of the training formulation's GEMM chains (``gspn2/csrc/rows.cpp``, used by
:mod:`gspn2.layers.pointwise`). This module
also owns what Python knows of it: whether it was built, the build hint when it was not, the kernels'
limits (read from the extension, never copied here) and the launch planner for benchmarks and tests.

Without the extension, ``gspn2::propagate`` on a CUDA tensor raises :data:`BUILD_HINT` (there is no silent
fallback to the slow reference; ``GSPN2_BACKEND=reference`` asks for it explicitly), and the depthwise
convolution runs cuDNN.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from gspn2.ops import options as _options

__all__ = [
    "BUILD_HINT", "describe", "direct_call", "direct_call_allowed", "dwconv_mma_plan", "dwconv_plan", "dwconv_tma",
    "extension_available", "extension_error", "limits", "plan", "raise_build_hint", "require_extension",
]

log = logging.getLogger("gspn2.ops")

BUILD_HINT = (
    "gspn2's CUDA extension (gspn2._C) is not built, so gspn2's ops cannot run their kernels on a CUDA "
    "tensor. Build it from the repository root with nvcc available (CUDA_HOME or /usr/local/cuda): "
    "`pip install --no-build-isolation -e .` (TORCH_CUDA_ARCH_LIST selects the GPUs). "
    f"Or set {_options.BACKEND_ENV}=reference to run the slow pure-PyTorch reference on the GPU."
)

try:
    from gspn2 import _C  # the compiled extension (setup.py); importing it registers the CUDA kernels
except ImportError as exc:  # not built: CPU-only install, or no nvcc at build time
    _C = None
    _IMPORT_ERROR: Optional[ImportError] = exc
else:
    _IMPORT_ERROR = None


def extension_available() -> bool:
    """Whether ``gspn2._C`` was built and imports."""
    return _C is not None


def extension_error() -> Optional[ImportError]:
    """The error raised when importing ``gspn2._C``, if it failed."""
    return _IMPORT_ERROR


def require_extension() -> None:
    """Raise ``RuntimeError`` with :data:`BUILD_HINT` unless the extension is built."""
    if _C is None:
        raise RuntimeError(BUILD_HINT) from _IMPORT_ERROR


#: The ops with a direct eager entry in the extension (gspn2/csrc/calls.h).
DIRECT_CALLS = ("propagate", "depthwise_conv2d", "layer_norm", "rows_norm_linear", "rows_linear", "rows_gelu_linear")


def direct_call(name: str):
    """The extension's direct entry of ``gspn2::<name>`` (the same dispatcher op as ``torch.ops.gspn2.<name>``,
    called without torch.ops' argument parsing: a few microseconds less per call), or None where the
    extension is not built or was built from sources without it. Call it only where
    :func:`direct_call_allowed` holds."""
    if name not in DIRECT_CALLS:
        raise ValueError(f"`name` must be one of {DIRECT_CALLS}, got {name!r}")
    return getattr(_C, name, None) if _C is not None else None


def direct_call_allowed(args) -> bool:
    """Whether a direct entry may replace ``torch.ops`` for a call with these arguments: not while Dynamo
    traces (it cannot trace into the extension), not under ``torch.jit.trace`` (which records ``torch.ops``
    calls only) and not where ``__torch_function__`` applies (tensor subclasses, function modes), which only
    ``torch.ops`` honours. Dispatch-level machinery (autograd, fake tensors, ``TorchDispatchMode``) sees both
    alike."""
    return not (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
                or torch._C._has_torch_function(args))


def limits() -> dict:
    """The kernels' limits and the planner's thresholds, from the extension: ``fast_max_line`` (longest line of
    the streaming kernels), ``cluster_tile`` (W must be a multiple of it for the cluster kernels),
    ``cluster_auto_min_line``, ``cluster_auto_min_elems_bwd``, ``cluster_auto_min_line_bwd_16bit`` (where
    ``kernel="auto"`` takes the cluster kernels), ``dwconv_kernel_sizes``, ``ablate`` (profiling build flag)."""
    require_extension()
    return dict(_C.limits())


def plan(B, C, H, W, K, dtype="float32", backward=False, kernel=None, cluster_ctas=None) -> dict:
    """The kernels' launch plan (kernel family, channel slice, tile, block shape, shared memory).

    Streaming plans also give ``cluster_ctas``: CTAs per line of the cluster kernel that computes the
    horizontal directions (0: the streaming kernel does), and ``split_ctas``: CTAs per line of the split kernel
    that then computes the vertical ones (0: one block per line in the streaming kernel); with the cluster
    kernel, ``overlap``: whether the two launches run side by side on two streams, ``cluster_stages`` and
    ``cluster_sub``: its input stage buffers and tiles of 16 steps per input copy. Without a GPU the
    plan is an H200's. ``kernel`` and ``cluster_ctas`` default to the process options.
    """
    require_extension()
    opts = _options.current()
    return dict(
        _C.plan(
            B, C, H, W, K, dtype, backward,
            opts.kernel if kernel is None else kernel,
            opts.cluster_ctas if cluster_ctas is None else cluster_ctas,
        )
    )


def dwconv_plan(B, C, H, W, K, dtype="bfloat16", cols=4, smem_limit=0) -> dict:
    """The depthwise tile kernels' plan (gspn2/csrc/dwconv.h): warp tiles per CTA (``sub_h`` x ``sub_w``, each
    ``rows`` x ``cols`` outputs), CTA tiles, the weight gradient's ``chunks`` of ``tiles_per_chunk`` tiles and
    the shared memory of the forward, weight-gradient and one-pass kernels (bytes). ``smem_limit`` < 1: the
    96 KB budget the kernels plan within (a GPU with less lowers it). Needs no GPU.
    """
    require_extension()
    return dict(_C.dwconv_plan(B, C, H, W, K, dtype, cols, smem_limit))


def dwconv_mma_plan(B, C, H, W) -> dict:
    """The depthwise tensor-core kernels' weight-gradient plan (gspn2/csrc/dwconv.h): tiles of 16 rows x 8 or 16
    columns (``tiles_h`` x ``tiles_w`` per image, ``tiles`` in all), 32-channel blocks and the ``chunks`` of
    ``tiles_per_chunk`` consecutive tiles whose partial sums are added in a fixed order. Needs no GPU."""
    require_extension()
    return dict(_C.dwconv_mma_plan(B, C, H, W))


def dwconv_tma(enabled: bool) -> bool:
    """Lets the depthwise tile kernels stage their tiles by TMA where they were compiled for sm_90 (``True``,
    the default) or makes them stage by ``cp.async`` everywhere, as builds without sm_90 code do (``False``;
    the tests use it to run that path on an sm_90 GPU). Process-wide; returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool, got {enabled!r}")
    require_extension()
    return bool(_C.dwconv_set_tma(enabled))


def describe() -> str:
    """One line naming the backends in force, e.g. for a run's log."""
    o = _options.current()
    built = "built" if _C is not None else "not built"
    return (
        f"gspn2 ops: backend={o.backend}, kernel={o.kernel}, dwconv={o.dwconv}, merge={o.merge}, mlp={o.mlp}, "
        f"eager_autograd={o.eager_autograd}, CUDA extension {built}"
    )


def raise_build_hint(*args):
    """A CUDA kernel for ops whose CUDA implementation lives in the extension, where it is not built: raises
    ``RuntimeError`` with :data:`BUILD_HINT` (no silent fallback to a slow reference)."""
    raise RuntimeError(BUILD_HINT) from _IMPORT_ERROR
