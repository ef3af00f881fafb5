"""What a run ran on: the GSPN-2 operator's backend, its kernel family and the depthwise convolution.

These choices are made outside the config (see :mod:`gspn2.ops`); the trainer and the evaluator read them
once at start, log them, record them in their result files and W&B, and refuse a GPU run that would
need the CUDA extension when it is not built -- before anything is written.
"""

from __future__ import annotations

import torch

from gspn2.ops._cuda import BUILD_HINT, extension_available
from gspn2.ops.options import backend, current, dwconv_backend, kernel_family
from gspn2.train.config import ConfigError

__all__ = ["backend_info", "describe", "require_extension"]


def backend_info(device: torch.device) -> dict[str, object]:
    """The implementations that run on ``device``: a flat dict of strings and one bool.

    ``op``/``dwconv`` are what actually runs (CPU tensors always take the pure-PyTorch reference and
    torch's convolution); ``op_backend``, ``kernel_family``, ``dwconv_backend``, ``merge`` (the training
    mixer's output chain) and ``mlp`` (the training MLP's second GEMM) are the settings.
    """
    on_cuda = device.type == "cuda"
    op_backend = backend()
    dwconv = dwconv_backend()
    if not on_cuda or op_backend == "reference":
        op = "reference"
    else:
        op = "cuda-kernel"
    return {
        "device": device.type,
        "op": op,
        "op_backend": op_backend,
        "kernel_family": kernel_family() if op == "cuda-kernel" else "n/a",
        "dwconv": ("gspn2-kernel/cudnn" if dwconv == "auto" else dwconv) if on_cuda else "torch-cpu",
        "dwconv_backend": dwconv,
        "merge": current().merge,
        "mlp": current().mlp,
        "norm_backward": current().norm_backward,
        "norm_affine": current().norm_affine,
        "eager_autograd": current().eager_autograd,
        "layer_norm": current().layer_norm,
        "small_gemm": current().small_gemm,
        "recompute": current().recompute,
        "addmm": current().addmm,
        "extension_built": extension_available(),
    }


def describe(info: dict[str, object]) -> str:
    """One log line of :func:`backend_info`."""
    if info["device"] != "cuda":
        return "gspn2 op: pure-PyTorch reference (CPU tensors), depthwise conv: torch"
    family = f", kernel family {info['kernel_family']}" if info["op"] == "cuda-kernel" else ""
    return (
        f"gspn2 op: {info['op']} (GSPN2_BACKEND={info['op_backend']}{family}), "
        f"depthwise conv: GSPN2_DWCONV={info['dwconv_backend']}, GSPN2_MERGE={info['merge']}, "
        f"GSPN2_MLP={info['mlp']}, GSPN2_NORM_BACKWARD={info['norm_backward']}, "
        f"GSPN2_NORM_AFFINE={info['norm_affine']}, "
        f"GSPN2_EAGER_AUTOGRAD={info['eager_autograd']}, "
        f"GSPN2_LAYER_NORM={info['layer_norm']}, GSPN2_SMALL_GEMM={info['small_gemm']}, "
        f"GSPN2_RECOMPUTE={info['recompute']}, GSPN2_ADDMM={info['addmm']}, "
        f"extension built: {info['extension_built']}"
    )


def require_extension(device: torch.device) -> None:
    """Raise :class:`~gspn2.train.config.ConfigError` with the build hint if a run on ``device`` needs
    gspn2's CUDA extension and it is not built (a CUDA device with a backend other than ``reference``,
    or ``GSPN2_DWCONV=cuda``)."""
    if device.type != "cuda" or extension_available():
        return
    if backend() != "reference" or dwconv_backend() == "cuda":
        raise ConfigError(BUILD_HINT)
