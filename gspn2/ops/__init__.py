"""The GSPN-2 propagation operator: one public entry point and its pure-PyTorch reference."""

from gspn2.ops.propagate import gspn_propagate
from gspn2.ops.reference import gspn_propagate_backward_ref, gspn_propagate_ref

__all__ = ["gspn_propagate", "gspn_propagate_ref", "gspn_propagate_backward_ref"]
