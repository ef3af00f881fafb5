"""Process-wide choices of gspn2's op backends and kernels, parsed once.

The ops take every choice as an argument (``torch.ops.gspn2.propagate(..., kernel, cluster_ctas)``,
``torch.ops.gspn2.depthwise_conv2d(..., kernel, cols)``); the public functions fill those arguments from the
options held here. They are read from the environment once, when gspn2 is imported, and can be changed in
the process with :func:`set_options` or :func:`override` (under ``torch.compile``: before compiling).

==================  ===================================  ================================================
environment         option                               values
==================  ===================================  ================================================
``GSPN2_BACKEND``   ``backend``: CUDA tensors of         ``auto`` / ``cuda``: the fused kernels (float64
                    ``gspn_propagate``                   runs the reference); ``reference``: the
                                                         pure-PyTorch reference (slow)
``GSPN2_KERNEL``    ``kernel``: the propagation          ``auto`` (the planner's choice), ``fast``
                    kernel family                        (streaming only), ``general``, ``cluster``,
                                                         ``short`` (short lines: H, W <= 32)
(none)              ``cluster_ctas``: CTAs per line of   0 (the planner's choice), 2, 4, 8
                    the cluster kernels, horizontal
                    and split vertical (benchmarks)
``GSPN2_DWCONV``    ``dwconv``: the depthwise            ``auto`` (the kernel where it measured faster
                    convolution on CUDA tensors          than cuDNN: K = 3, 7), ``cuda`` (every K it
                                                         supports, else an error), ``cudnn``,
                                                         ``stencil`` (K * K shifted multiply-adds in
                                                         plain ops, which Inductor fuses; slower)
``GSPN2_DWCONV_``   ``dwconv_kernel``: the depthwise     ``auto`` (``gspn2.ops.dwconv.AUTO_VARIANT``: the
``KERNEL``          kernels' family                      backward and columns per kernel size), ``tile``
                                                         (input- and weight-gradient kernels), ``fused``
                                                         (one-pass backward), ``mma`` (the tensor
                                                         cores; 16-bit, C % 8 == 0, sm_90)
(none)              ``dwconv_tile_cols``: the depthwise  4 or 8 (benchmarks; ``auto`` picks its own)
                    kernels' output columns per thread
``GSPN2_MERGE``     ``merge``: the training mixer's      ``auto`` / ``separate``: a GEMM with the skip,
                    output chain (proj_up, skip, norm,   then the norm and gate fused into out_proj
                    gate)                                (measured faster); ``fused``: one
                                                         ``gspn2.ops.merge_norm_gate``, then out_proj
``GSPN2_NORM_``     ``norm_backward``: the backward of   ``auto`` / ``separate``: plain ops (Inductor
``BACKWARD``        the training mixer's gated norm      fuses them under ``torch.compile``; measured
                    (``LN(y) * silu(z)`` before          faster); ``fused``: on CUDA one
                    out_proj)                            ``gspn2.ops.norm_gate_backward`` (a Triton kernel)
``GSPN2_MLP``       ``mlp``: the training MLP's          ``auto`` / ``separate``: GELU as its own op
                    ``fc2(gelu(h))``                     before the fc2 GEMM (Inductor fuses it with its
                                                         neighbours); ``fused``: one
                                                         ``gspn2.ops.gelu_linear`` (GELU inside the GEMMs)
``GSPN2_SMALL_``    ``small_gemm``: under                ``auto`` / ``pointwise``: GEMMs of at most
``GEMM``            ``torch.compile``, the training      ``POINTWISE_MAX_IN`` inputs
                    formulation's GEMMs with few         (``gspn2.layers.pointwise``) as that many
                    input features (the mixer's          broadcast multiply-adds, which Inductor fuses
                    ``proj_up``: ``4 * proxy_dim``)      with the skip, norm and gate after them
                                                         (measured faster); ``gemm``: always a GEMM
``GSPN2_``          ``recompute``: under                 ``keep``: AOTAutograd's partitioner decides
``RECOMPUTE``       ``torch.compile``, which inputs of   (it keeps them); ``gelu``: the MLP's
                    the training formulation's GEMMs     ``gelu(h)`` is recomputed from ``h`` in
                    backward recomputes instead of       backward; ``auto`` / ``act``: also the mixer's
                    keeping from the forward             ``silu(dwconv(v))`` (``generate``'s input);
                                                         ``gate``: also the mixer's gated norm output
                                                         (``out_proj``'s input); ``all``:
                                                         also the other normalised inputs of
                                                         ``norm_linear``'s GEMMs (the recomputed
                                                         chains' backward is autograd's, so
                                                         ``norm_backward`` does not apply)
``GSPN2_NORM_``     ``norm_affine``: where the training  ``rows``: on the normalised rows (their
``AFFINE``          formulation applies the weight and   gradients are sums over the rows); ``weight``:
                    bias of a LayerNorm that feeds a     folded into the GEMM's weight and bias (their
                    GEMM without a gate (``in_proj``,    gradients come from the GEMM's weight-sized
                    ``fc1``)                             gradients; the norm's backward reduces along
                                                         rows only); ``auto``: ``weight`` under
                                                         ``torch.compile`` (measured faster), ``rows``
                                                         eagerly
``GSPN2_ADDMM``     ``addmm``: under ``torch.compile``   ``auto`` / ``fused``: Inductor's graphs as it
                    through ``gspn2.inductor.compile``,  builds them (``mm(a, b) + m`` as ``addmm``,
                    the sums of a GEMM and a matrix      which ATen runs as a copy of ``m`` and a GEMM
                    (``mm(a, b) + m``) that Inductor     with beta 1); ``split``: ``mm`` and ``add``,
                    writes as ``addmm``                  the add fused into the kernel that reads it
``GSPN2_LAYER_``    ``layer_norm``: eager LayerNorms     ``auto``: outside ``torch.compile``, gspn2's
``NORM``            over channels on CUDA tensors        LayerNorm kernel (``gspn2.ops.layer_norm``) where
                    (``LayerNorm2d``, the training       it takes the rows, ATen's elsewhere; ``cuda``:
                    GEMM chains' norms, the stem's       the kernel, else an error; ``aten``: always
                    norm and GELU)                       ATen's ``layer_norm`` (comparisons)
``GSPN2_EAGER_``    ``eager_autograd``: the training     ``auto``: outside ``torch.compile``, the C++ ops
``AUTOGRAD``        formulation's GEMM chains            ``gspn2::rows_*`` (their forward and backward
                    (``gspn2.layers.norm_linear``,       without Python) when the extension is built;
                    ``rows_linear``, ``gelu_linear``)    ``python``: the autograd functions in Python,
                                                         the form ``torch.compile`` always traces
==================  ===================================  ================================================

Values from the environment are case-insensitive; an unset or empty variable means ``auto``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Mapping

__all__ = [
    "BACKEND_ENV",
    "CLUSTER_CTAS",
    "DWCONV_ENV",
    "DWCONV_KERNEL_ENV",
    "DWCONV_KERNELS",
    "DWCONV_TILE_COLS",
    "EAGER_AUTOGRAD_ENV",
    "LAYER_NORM_ENV",
    "FORMULATIONS",
    "KERNELS",
    "KERNEL_ENV",
    "MERGE_ENV",
    "MLP_ENV",
    "NORM_AFFINE_ENV",
    "NORM_BACKWARD_ENV",
    "SMALL_GEMM_ENV",
    "RECOMPUTE_ENV",
    "ADDMM_ENV",
    "Options",
    "backend",
    "current",
    "dwconv_backend",
    "from_env",
    "kernel_family",
    "override",
    "set_options",
]

BACKEND_ENV = "GSPN2_BACKEND"
KERNEL_ENV = "GSPN2_KERNEL"
DWCONV_ENV = "GSPN2_DWCONV"
DWCONV_KERNEL_ENV = "GSPN2_DWCONV_KERNEL"
MERGE_ENV = "GSPN2_MERGE"
MLP_ENV = "GSPN2_MLP"
NORM_BACKWARD_ENV = "GSPN2_NORM_BACKWARD"
NORM_AFFINE_ENV = "GSPN2_NORM_AFFINE"
EAGER_AUTOGRAD_ENV = "GSPN2_EAGER_AUTOGRAD"
LAYER_NORM_ENV = "GSPN2_LAYER_NORM"
SMALL_GEMM_ENV = "GSPN2_SMALL_GEMM"
RECOMPUTE_ENV = "GSPN2_RECOMPUTE"
ADDMM_ENV = "GSPN2_ADDMM"

#: The propagation kernel families and the CTAs per cluster line the ops accept (also as op arguments).
KERNELS = ("auto", "fast", "general", "cluster", "short")
CLUSTER_CTAS = (0, 2, 4, 8)
#: The depthwise kernel families (after ``auto``, in the order of the op's ``kernel`` argument) and the tile
#: kernels' output columns per thread.
DWCONV_KERNELS = ("auto", "tile", "fused", "mma")
DWCONV_TILE_COLS = (4, 8)
#: The choices of the two formulation options (``merge``, ``mlp``): ``auto`` is the one measured faster.
FORMULATIONS = ("auto", "separate", "fused")
_CHOICES = {
    "backend": ("auto", "cuda", "reference"),
    "kernel": KERNELS,
    "dwconv": ("auto", "cuda", "cudnn", "stencil"),
    "dwconv_kernel": DWCONV_KERNELS,
    "merge": FORMULATIONS,
    "mlp": FORMULATIONS,
    "norm_backward": FORMULATIONS,
    "norm_affine": ("auto", "rows", "weight"),
    "eager_autograd": ("auto", "python"),
    "layer_norm": ("auto", "cuda", "aten"),
    "small_gemm": ("auto", "gemm", "pointwise"),
    "recompute": ("auto", "keep", "gelu", "act", "gate", "all"),
    "addmm": ("auto", "fused", "split"),
}
_INTS = {"cluster_ctas": CLUSTER_CTAS, "dwconv_tile_cols": DWCONV_TILE_COLS}
_ENV = {
    "backend": BACKEND_ENV,
    "kernel": KERNEL_ENV,
    "dwconv": DWCONV_ENV,
    "dwconv_kernel": DWCONV_KERNEL_ENV,
    "merge": MERGE_ENV,
    "mlp": MLP_ENV,
    "norm_backward": NORM_BACKWARD_ENV,
    "norm_affine": NORM_AFFINE_ENV,
    "eager_autograd": EAGER_AUTOGRAD_ENV,
    "layer_norm": LAYER_NORM_ENV,
    "small_gemm": SMALL_GEMM_ENV,
    "recompute": RECOMPUTE_ENV,
    "addmm": ADDMM_ENV,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of gspn2's ops (see the module docstring); validated on construction."""

    backend: str = "auto"
    kernel: str = "auto"
    cluster_ctas: int = 0
    dwconv: str = "auto"
    dwconv_kernel: str = "auto"
    dwconv_tile_cols: int = 4
    merge: str = "auto"
    mlp: str = "auto"
    norm_backward: str = "auto"
    norm_affine: str = "auto"
    eager_autograd: str = "auto"
    layer_norm: str = "auto"
    small_gemm: str = "auto"
    recompute: str = "auto"
    addmm: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"gspn2 option `{name}` must be one of {', '.join(choices)}; got {value!r}")
        for name, choices in _INTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
                raise ValueError(f"gspn2 option `{name}` must be one of {choices}; got {value!r}")


def from_env(environ: Mapping[str, str] = os.environ) -> Options:
    """The options that ``environ`` asks for; an invalid value raises ``ValueError`` naming the variable."""
    values = {}
    for name, var in _ENV.items():
        value = environ.get(var, "").strip().lower() or "auto"
        if value not in _CHOICES[name]:
            raise ValueError(f"{var} must be one of {', '.join(_CHOICES[name])}; got {environ.get(var)!r}")
        values[name] = value
    return Options(**values)


_current = from_env()


def current() -> Options:
    """The options in force."""
    return _current


def set_options(**changes) -> Options:
    """Change the options in force (validated, all or nothing); returns the previous ones."""
    global _current
    unknown = set(changes) - {f.name for f in dataclasses.fields(Options)}
    if unknown:
        raise TypeError(f"unknown gspn2 option(s): {', '.join(f'`{k}`' for k in sorted(unknown))}")
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous


@contextlib.contextmanager
def override(**changes) -> Iterator[Options]:
    """``with override(kernel="general"): ...`` runs the block with those options, then restores the old ones."""
    global _current
    previous = set_options(**changes)
    try:
        yield _current
    finally:
        _current = previous


def backend() -> str:
    """The backend for CUDA tensors of ``gspn_propagate`` (``auto``, ``cuda`` or ``reference``)."""
    return _current.backend


def kernel_family() -> str:
    """The propagation kernel family (``auto``, ``fast``, ``general``, ``cluster`` or ``short``)."""
    return _current.kernel


def dwconv_backend() -> str:
    """The depthwise-convolution backend on CUDA tensors (``auto``, ``cuda`` or ``cudnn``)."""
    return _current.dwconv
