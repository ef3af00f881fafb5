"""The ``gspn2::propagate`` ops: schemas, the reference and fake implementations, autograd, and the public entry.

Two ops live in the ``gspn2`` namespace:

* ``gspn2::propagate(x, lam, gates, chunk, kernel, cluster_ctas) -> h``
* ``gspn2::propagate_backward(grad_h, x, lam, gates, h, chunk, kernel, cluster_ctas) -> (grad_x, grad_lam, grad_gates)``

``kernel`` and ``cluster_ctas`` choose the CUDA kernels (:mod:`gspn2.ops.options`); other devices validate and
ignore them. Implementations:

* CUDA: ``gspn2/csrc/propagate.cpp`` registers the fused kernels and their autograd formula in C++, so a
  call runs no Python below the op. The checks live there. In plain eager code :func:`gspn_propagate`
  calls the op through the extension's direct entry (:func:`gspn2.ops._cuda.direct_call`), which skips
  ``torch.ops``' argument parsing.
* Every other device: the pure-PyTorch reference (:mod:`gspn2.ops.reference`), with the checks of
  :mod:`gspn2.ops._checks`, and the autograd formula below.
* Fake tensors (``torch.compile``, ``torch.export``): the checks, then an empty output.
"""

from __future__ import annotations

from typing import Optional

import torch

from gspn2.ops import _cuda
from gspn2.ops import options as _options
from gspn2.ops._checks import (
    check_backward_inputs,
    check_chunk,
    check_kernel_type,
    check_options,
    check_propagate_inputs,
    refuse_forward_ad,
    refuse_nested,
)
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref

__all__ = ["gspn_propagate"]

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define(
    "propagate(Tensor x, Tensor lam, Tensor gates, int? chunk, str kernel, int cluster_ctas) -> Tensor"
)
_LIB.define(
    "propagate_backward(Tensor grad_h, Tensor x, Tensor lam, Tensor gates, Tensor h, int? chunk, str kernel, "
    "int cluster_ctas) -> (Tensor, Tensor, Tensor)"
)
if not _cuda.extension_available():  # CUDA tensors raise the build hint instead of running the reference
    for _name in ("propagate", "propagate_backward"):
        _LIB.impl(_name, _cuda.raise_build_hint, "CUDA")


@torch.library.impl(_LIB, "propagate", "CompositeExplicitAutograd")
def _propagate_reference(x, lam, gates, chunk, kernel, cluster_ctas):
    check_propagate_inputs(x, lam, gates, chunk)
    check_options(kernel, cluster_ctas)
    return gspn_propagate_ref(x, lam, gates, chunk)


@torch.library.register_fake("gspn2::propagate", lib=_LIB)
def _propagate_fake(x, lam, gates, chunk, kernel, cluster_ctas):
    check_propagate_inputs(x, lam, gates, chunk)
    check_options(kernel, cluster_ctas)
    B, C, H, W = x.shape
    return x.new_empty((B, 4, C, H, W))


@torch.library.impl(_LIB, "propagate_backward", "CompositeExplicitAutograd")
def _propagate_backward_reference(grad_h, x, lam, gates, h, chunk, kernel, cluster_ctas):
    check_propagate_inputs(x, lam, gates, chunk)
    check_backward_inputs(grad_h, x, h)
    check_options(kernel, cluster_ctas)
    return gspn_propagate_backward_ref(grad_h, x, lam, gates, h, chunk)


@torch.library.register_fake("gspn2::propagate_backward", lib=_LIB)
def _propagate_backward_fake(grad_h, x, lam, gates, h, chunk, kernel, cluster_ctas):
    check_propagate_inputs(x, lam, gates, chunk)
    check_backward_inputs(grad_h, x, h)
    check_options(kernel, cluster_ctas)
    # Every backend returns contiguous gradients, whatever the strides of the inputs.
    return x.new_empty(x.shape), lam.new_empty(lam.shape), gates.new_empty(gates.shape)


def _check_backward_call(grad_h, x, lam, gates, h, chunk, kernel, cluster_ctas):
    check_propagate_inputs(x, lam, gates, chunk)
    check_backward_inputs(grad_h, x, h)


refuse_nested(_LIB, "propagate", lambda x, lam, gates, chunk, *opts: check_propagate_inputs(x, lam, gates, chunk))
refuse_nested(_LIB, "propagate_backward", _check_backward_call)


def _setup_context(ctx, inputs, output):
    x, lam, gates, chunk, kernel, cluster_ctas = inputs
    ctx.save_for_backward(x, lam, gates, output)
    ctx.options = (chunk, kernel, cluster_ctas)


def _backward(ctx, grad_h):
    x, lam, gates, h = ctx.saved_tensors
    grad_x, grad_lam, grad_gates = torch.ops.gspn2.propagate_backward.default(
        grad_h.contiguous(), x, lam, gates, h, *ctx.options
    )
    return grad_x, grad_lam, grad_gates, None, None, None


# Every device but CUDA, whose formula (the same one) is registered in C++ for the AutogradCUDA key.
torch.library.register_autograd("gspn2::propagate", _backward, setup_context=_setup_context, lib=_LIB)


def gspn_propagate(
    x: torch.Tensor,
    lam: torch.Tensor,
    gates: torch.Tensor,
    chunk: Optional[int] = None,
    *,
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """Four-direction GSPN line-scan propagation (docs/spec.md, "The propagation operator").

    For direction ``d`` and pixel ``p`` at line position ``q``::

        h_d[p] = lam_d[p] * x[p] + sum_{o in -1,0,+1} w_{d,o}[p] * prev(q + o)

    with ``w = sigmoid(gates)`` normalised over the neighbours inside the line, ``prev`` the hidden
    state of the previous line of the scan (zero on the first line and on the first line of each chunk).

    Args:
        x: ``(B, C, H, W)`` features.
        lam: ``(B, 4, C, H, W)`` input gates, one per direction (0: left->right, 1: right->left,
            2: top->bottom, 3: bottom->top).
        gates: ``(B, 4, 3, K, H, W)`` raw gate logits for neighbour offsets -1, 0, +1; ``K`` groups
            with ``C % K == 0`` (``K = 1``: one affinity shared by all channels).
        chunk: ``None`` scans the whole image; an int restarts the scan every ``chunk`` steps, counted
            from each direction's starting edge.
        kernel: the CUDA kernel family (``auto``, ``fast``, ``general``, ``cluster``, ``short``); ``None``: the
            process option (:mod:`gspn2.ops.options`, ``GSPN2_KERNEL``). Ignored on other devices.
    Returns:
        ``(B, 4, C, H, W)`` hidden states of all four directions in the image frame, dtype of ``x``.
    Raises:
        TypeError / ValueError naming the argument on bad input.

    On CUDA tensors the fused kernels run (float64, and ``backend="reference"``, run the differentiable
    reference instead); elsewhere the reference does.
    """
    opts = _options.current()
    if chunk is not None:
        check_chunk(chunk)  # before the schema's 64-bit int can overflow
    if kernel is None:
        kernel = opts.kernel
    else:
        check_kernel_type(kernel)  # the schema would raise a RuntimeError for an int, and decode bytes
    if isinstance(x, torch.Tensor) and x.is_cuda and (x.dtype == torch.float64 or opts.backend == "reference"):
        check_propagate_inputs(x, lam, gates, chunk)
        check_options(kernel, opts.cluster_ctas)
        return gspn_propagate_ref(x, lam, gates, chunk)
    if not (isinstance(x, torch.Tensor) and isinstance(lam, torch.Tensor) and isinstance(gates, torch.Tensor)):
        for name, t in (("x", x), ("lam", lam), ("gates", gates)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"gspn_propagate: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    refuse_forward_ad("gspn_propagate", x=x, lam=lam, gates=gates)  # the reference above has it
    if _DIRECT is not None and _cuda.direct_call_allowed((x, lam, gates)):
        return _DIRECT(x, lam, gates, chunk, kernel, opts.cluster_ctas)
    return _OP(x, lam, gates, chunk, kernel, opts.cluster_ctas)


_DIRECT = _cuda.direct_call("propagate")
_OP = torch.ops.gspn2.propagate.default
