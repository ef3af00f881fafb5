"""CUDA backend of the ``gspn2::propagate`` ops: the only module that imports the compiled extension.

The fused kernels (``gspn2/csrc``) are registered as the CUDA implementation of the same
``torch.library`` ops that :mod:`gspn2.ops.propagate` defines, so the fake (meta) implementation and the
autograd formula stay one op for every device. On CPU the pure-PyTorch reference runs.

Backend choice on CUDA tensors, made explicit and logged once at first use:

* ``GSPN2_BACKEND=auto`` (default) or ``cuda``: the fused CUDA kernel for float32, float16 and bfloat16.
  If the extension was not built this raises, saying how to build it; there is no silent fallback.
  float64 (gradcheck) runs the reference, which the kernel does not implement.
* ``GSPN2_BACKEND=reference``: the pure-PyTorch reference on CUDA tensors too (slow: one Python step
  per scan step), e.g. to debug or to run where the extension cannot be built.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch

from gspn2.ops._checks import check_propagate_inputs
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref

__all__ = ["BACKEND_ENV", "KERNEL_ENV", "FAST_MAX_LINE", "CLUSTER_TILE", "CLUSTER_AUTO_MIN_LINE", "CLUSTER_AUTO_MIN_ELEMS_BWD", "CLUSTER_AUTO_MIN_LINE_BWD_16BIT", "backend", "kernel_family", "extension_available", "extension_error", "BUILD_HINT", "forward", "backward", "plan"]

log = logging.getLogger("gspn2.ops")

#: Environment variable that selects the backend for CUDA tensors.
BACKEND_ENV = "GSPN2_BACKEND"
_BACKENDS = ("auto", "cuda", "reference")
#: Environment variable that selects the kernel family: ``auto`` (streaming kernels for lines of up to
#: FAST_MAX_LINE pixels, with the horizontal directions in the cluster kernels on sm_90 (forward: float32,
#: H >= CLUSTER_AUTO_MIN_LINE; backward: B * C * H * W >= CLUSTER_AUTO_MIN_ELEMS_BWD, and for 16-bit inputs
#: H >= CLUSTER_AUTO_MIN_LINE_BWD_16BIT); general kernels beyond), ``fast`` (streaming only), ``general``,
#: or ``cluster`` (the streaming plan with the cluster kernels on every pass, forward and backward, every
#: dtype; an error where W is not a multiple of CLUSTER_TILE).
KERNEL_ENV = "GSPN2_KERNEL"
_KERNELS = ("auto", "fast", "general", "cluster")
#: Longest line (max(H, W)) the streaming kernels take (gspn2/csrc/propagate.h, kFastMaxLine).
FAST_MAX_LINE = 1024
#: The cluster kernel's tile (scan steps): W must be a multiple of it (kClusterTile).
CLUSTER_TILE = 16
#: GSPN2_KERNEL=auto uses the cluster kernel in the forward for H >= this (kClusterAutoMinLine) ...
CLUSTER_AUTO_MIN_LINE = 768
#: ... and in the backward for B * C * H * W >= this (kClusterAutoMinElemsBwd) ...
CLUSTER_AUTO_MIN_ELEMS_BWD = 1 << 20
#: ... with, for 16-bit inputs, H >= this (kClusterAutoMinLineBwd16).
CLUSTER_AUTO_MIN_LINE_BWD_16BIT = 64

BUILD_HINT = (
    "gspn2's CUDA extension (gspn2._C) is not built, so gspn_propagate cannot run its kernel on a CUDA "
    "tensor. Build it from the repository root with nvcc available (CUDA_HOME or /usr/local/cuda): "
    "`pip install --no-build-isolation -e .` (TORCH_CUDA_ARCH_LIST selects the GPUs, default \"8.0;9.0\"). "
    f"Or set {BACKEND_ENV}=reference to run the slow pure-PyTorch reference on the GPU."
)

try:
    from gspn2 import _C  # the compiled extension (setup.py)
except ImportError as exc:  # not built: CPU-only install, or no nvcc at build time
    _C = None
    _IMPORT_ERROR: Optional[ImportError] = exc
else:
    _IMPORT_ERROR = None

_announced: set[str] = set()


def extension_available() -> bool:
    """Whether ``gspn2._C`` was built and imports."""
    return _C is not None


def extension_error() -> Optional[ImportError]:
    """The error raised when importing ``gspn2._C``, if it failed."""
    return _IMPORT_ERROR


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of the environment variable ``name`` (case and spaces ignored; unset or empty -> ``auto``),
    which must be one of ``choices``."""
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def backend() -> str:
    """The backend requested for CUDA tensors by ``GSPN2_BACKEND`` (``auto``, ``cuda`` or ``reference``)."""
    return env_choice(BACKEND_ENV, _BACKENDS)


def kernel_family() -> str:
    """The kernel family requested by ``GSPN2_KERNEL`` (``auto``, ``fast``, ``general`` or ``cluster``)."""
    return env_choice(KERNEL_ENV, _KERNELS)


def _check_kernel_env(H: int, W: int) -> None:
    # Validated here, before the extension sees it (its own check is a second line of defence).
    family = kernel_family()
    if family in ("fast", "cluster") and max(H, W) > FAST_MAX_LINE:
        raise ValueError(
            f"{KERNEL_ENV}={family}: the streaming kernels take lines of up to {FAST_MAX_LINE} pixels, "
            f"got H={H}, W={W}; use {KERNEL_ENV}=auto"
        )
    if family == "cluster" and W % CLUSTER_TILE != 0:
        raise ValueError(
            f"{KERNEL_ENV}=cluster: the cluster kernels take W a multiple of {CLUSTER_TILE}, got W={W}; "
            f"use {KERNEL_ENV}=auto"
        )


def _announce(key: str, message: str, warn: bool = False) -> None:
    if key in _announced:
        return
    _announced.add(key)
    if warn:
        warnings.warn(message, stacklevel=3)
    log.info(message)


def _use_reference(x: torch.Tensor) -> bool:
    if backend() == "reference":
        _announce(
            "reference",
            f"gspn2: {BACKEND_ENV}=reference: gspn_propagate runs the pure-PyTorch reference on CUDA tensors (slow)",
            warn=True,
        )
        return True
    if x.dtype == torch.float64:
        _announce("float64", "gspn2: float64 inputs run the pure-PyTorch reference (the CUDA kernel is fp32/fp16/bf16)")
        return True
    if _C is None:
        raise RuntimeError(BUILD_HINT) from _IMPORT_ERROR
    _announce("cuda", "gspn2: gspn_propagate backend on CUDA tensors: fused CUDA kernel (gspn2._C)")
    return False


def _checked(result):
    value, error = result
    if error:
        raise ValueError(error)
    return value


def _check_backward_extra(grad_h: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> None:
    B, C, H, W = x.shape
    for name, t in (("grad_h", grad_h), ("h", h)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, 4, C, H, W):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"gspn2: `{name}` must have shape (B, 4, C, H, W) = {(B, 4, C, H, W)}, got {shape}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"gspn2: `{name}` must match `x` in dtype and device, got {t.dtype} on {t.device}")


def forward(x, lam, gates, chunk=None):
    """The CUDA forward (no dispatch, no autograd): ``h`` of shape (B, 4, C, H, W).

    Inputs are validated here first (the same checks as :func:`gspn2.ops.gspn_propagate`); the extension
    checks them again in C++.
    """
    check_propagate_inputs(x, lam, gates, chunk)
    _check_kernel_env(x.shape[2], x.shape[3])
    return _checked(_C.forward(x, lam, gates, chunk))


def backward(grad_h, x, lam, gates, h, chunk=None):
    """The CUDA backward: ``(grad_x, grad_lam, grad_gates)``."""
    check_propagate_inputs(x, lam, gates, chunk)
    _check_backward_extra(grad_h, x, h)
    _check_kernel_env(x.shape[2], x.shape[3])
    return tuple(_checked(_C.backward(grad_h, x, lam, gates, h, chunk)))


def plan(B, C, H, W, K, dtype="float32", backward=False):
    """The kernels' launch plan (kernel family, channel slice, tile, block shape, shared memory).

    Streaming plans of the forward also give ``cluster_ctas``: CTAs per line of the cluster kernel that
    computes the horizontal directions (0: the streaming kernel does). Without a GPU the plan is an H200's.
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"`dtype` must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    _check_kernel_env(H, W)
    return _checked(_C.plan(B, C, H, W, K, dtype, backward))


@torch.library.register_kernel("gspn2::propagate", "cuda")
def _propagate_cuda(x, lam, gates, chunk):
    if _use_reference(x):
        return gspn_propagate_ref(x, lam, gates, chunk)
    return forward(x, lam, gates, chunk)


@torch.library.register_kernel("gspn2::propagate_backward", "cuda")
def _propagate_backward_cuda(grad_h, x, lam, gates, h, chunk):
    if _use_reference(x):
        return gspn_propagate_backward_ref(grad_h, x, lam, gates, h, chunk)
    return backward(grad_h, x, lam, gates, h, chunk)
