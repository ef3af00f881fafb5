"""FLOP formulas of gspn2's custom ops for the counters that do not see inside them.

* ``torch.utils.flop_counter.FlopCounterMode`` (a dispatch mode: it sees each custom op as one call and not
  the kernels inside it) gets a formula per op through ``register_flop_formula``. FlopCounterMode counts
  FLOPs, two per multiply-add, as it does for matmuls and convolutions; the formulas follow
  :mod:`gspn2.counting`'s MAC convention, doubled.
* fvcore's ``FlopCountAnalysis`` (which timm's ``benchmark.py`` uses) gets gspn2's handles in its table of
  default handles (:func:`gspn2.counting.register_fvcore_default_handles`, when fvcore is installed), so an analysis built without
  ``set_op_handle`` counts the ops too. fvcore counts MACs.

MACs per op, as :mod:`gspn2.counting` defines them:

* ``gspn2::propagate``: 4 per output element (3 neighbour products and ``lam * x``); the output
  ``(B, 4, C, H, W)`` holds every direction.
* ``gspn2::propagate_backward``: 8 per element of ``grad_h``: the adjoint recurrence (3 neighbour products
  and ``lam * a``) and the gradients of the three weights and of ``lam`` (4), twice the forward as for a
  linear layer. The elementwise gate normalisation is not counted, as in the forward.
* ``gspn2::depthwise_conv2d``: ``K * K`` per output element (as a depthwise convolution; the fused
  ``+ x`` and SiLU are elementwise and not counted).
* ``gspn2::depthwise_conv2d_backward``: ``K * K`` per element of the input gradient plus ``K * K`` per
  element of ``grad_y`` for the weight gradient, as FlopCounterMode counts ``convolution_backward``.
* ``gspn2::merge_norm_gate``: ``R`` per output element, the ``(N, R) x (R, E)`` product it contains (as a
  linear layer; the skip, the norm and the gate are elementwise and not counted).
* ``gspn2::merge_norm_gate_backward``: ``2 R`` per output element, the input and weight gradients of that
  product.
* ``gspn2::gelu_linear``: ``K`` per output element, the ``(M, K) x (K, N)`` product (as a linear layer; GELU
  is elementwise and not counted); ``gspn2::gelu_linear_backward``: twice that, the input and weight
  gradients.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from gspn2.counting import PROPAGATE_MACS_PER_ELEMENT, fvcore_available, register_fvcore_default_handles
from gspn2.ops import dwconv as _dwconv  # noqa: F401  (defines gspn2::depthwise_conv2d and its backward)
import gspn2.ops.gelu_gemm  # noqa: F401  (defines gspn2::gelu_linear and its backward)
from gspn2.ops import merge as _merge  # noqa: F401  (defines gspn2::merge_norm_gate and its backward)

__all__ = ["FLOPS_PER_MAC", "PROPAGATE_BACKWARD_MACS_PER_ELEMENT"]

#: FlopCounterMode's convention: one multiply-add is two FLOPs.
FLOPS_PER_MAC = 2
#: MACs per element of ``grad_h`` of ``gspn2::propagate_backward`` (see the module docstring).
PROPAGATE_BACKWARD_MACS_PER_ELEMENT = 2 * PROPAGATE_MACS_PER_ELEMENT


@register_flop_formula(torch.ops.gspn2.propagate)
def _propagate_flops(x_shape, lam_shape, gates_shape, chunk, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * PROPAGATE_MACS_PER_ELEMENT * math.prod(out_shape)


@register_flop_formula(torch.ops.gspn2.propagate_backward)
def _propagate_backward_flops(grad_h_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * PROPAGATE_BACKWARD_MACS_PER_ELEMENT * math.prod(grad_h_shape)


@register_flop_formula(torch.ops.gspn2.depthwise_conv2d)
def _depthwise_conv2d_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * w_shape[2] * w_shape[3] * math.prod(out_shape)


@register_flop_formula(torch.ops.gspn2.depthwise_conv2d_backward)
def _depthwise_conv2d_backward_flops(grad_y_shape, x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    taps = w_shape[2] * w_shape[3]
    return FLOPS_PER_MAC * taps * (math.prod(x_shape) + math.prod(grad_y_shape))


@register_flop_formula(torch.ops.gspn2.merge_norm_gate)
def _merge_norm_gate_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * math.prod(x_shape) * w_shape[0]


@register_flop_formula(torch.ops.gspn2.merge_norm_gate_backward)
def _merge_norm_gate_backward_flops(grad_out_shape, x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * 2 * math.prod(x_shape) * w_shape[0]


@register_flop_formula(torch.ops.gspn2.gelu_linear)
def _gelu_linear_flops(h_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * math.prod(h_shape) * w_shape[0]


@register_flop_formula(torch.ops.gspn2.gelu_linear_backward)
def _gelu_linear_backward_flops(grad_out_shape, h_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return FLOPS_PER_MAC * 2 * math.prod(h_shape) * w_shape[0]


# fvcore is a dependency of the package, but the op layer does not need it: without it, only the fvcore
# handles are missing (count_model then fails with fvcore's ImportError).
if fvcore_available():
    register_fvcore_default_handles()
