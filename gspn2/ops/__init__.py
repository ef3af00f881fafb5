"""The GSPN-2 propagation operator: one public entry point and its pure-PyTorch reference.

On CUDA tensors ``gspn_propagate`` runs the fused kernel of ``gspn2/csrc`` (see :mod:`gspn2.ops._cuda`
for the backend choice and ``GSPN2_BACKEND``); on CPU it runs the reference.
"""

from gspn2.ops.propagate import gspn_propagate
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref
from gspn2.ops import _cuda  # noqa: E402,F401  (registers the CUDA kernels of the gspn2:: ops)

__all__ = ["gspn_propagate", "gspn_propagate_ref", "gspn_propagate_backward_ref"]
from gspn2.ops import _flops  # noqa: E402,F401  (FLOP formulas of the gspn2:: ops for FlopCounterMode and fvcore)
