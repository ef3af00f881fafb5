"""gspn2's ops: the GSPN-2 propagation operator, the channels-last depthwise convolution, LayerNorm (and GELU)
over short rows, the mixer's fused output chain, the backward of its gated norm and the MLP's GELU-and-GEMM.

One public entry point each (:func:`gspn_propagate`, :func:`depthwise_conv2d`, :func:`layer_norm`,
:func:`merge_norm_gate`, :func:`norm_gate_backward`, :func:`gelu_linear`) and the pure-PyTorch references of the
propagation (:func:`gspn_propagate_ref`, the specification in code), of the norm (:func:`layer_norm_ref`), of
the output chain (:func:`merge_norm_gate_ref`), of
the gated norm's backward (:func:`norm_gate_backward_ref`) and of the MLP's half (:func:`gelu_linear_ref`). On CUDA tensors the fused kernels
of ``gspn2/csrc`` run (registered in C++ when the extension is imported, :mod:`gspn2.ops._cuda`); elsewhere
the references do. Backend and kernel choices: :mod:`gspn2.ops.options`.
"""

from gspn2.ops.propagate import gspn_propagate
from gspn2.ops.dwconv import depthwise_conv2d
from gspn2.ops.gelu_gemm import gelu_linear, gelu_linear_ref
from gspn2.ops.layernorm import layer_norm, layer_norm_ref
from gspn2.ops.merge import merge_norm_gate, merge_norm_gate_ref
from gspn2.ops.norm_backward import norm_gate_backward, norm_gate_backward_ref
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref
from gspn2.ops import _cuda  # noqa: F401  (imports the extension, which registers the CUDA kernels)
from gspn2.ops import options

__all__ = [
    "depthwise_conv2d",
    "gelu_linear",
    "gelu_linear_ref",
    "gspn_propagate",
    "gspn_propagate_backward_ref",
    "gspn_propagate_ref",
    "layer_norm",
    "layer_norm_ref",
    "merge_norm_gate",
    "merge_norm_gate_ref",
    "norm_gate_backward",
    "norm_gate_backward_ref",
    "options",
]
from gspn2.ops import _flops  # noqa: E402,F401  (FLOP formulas of the gspn2:: ops for FlopCounterMode and fvcore)
