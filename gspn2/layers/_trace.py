"""Which formulation the blocks compute: the memory-saving training formulation or the module calls.

The blocks' training formulation uses autograd functions (:func:`~gspn2.layers.norm_linear`,
:func:`~gspn2.layers.gelu_linear`) that save fewer activations. Three recorders cannot use them:

* ``torch.fx`` symbolic tracing runs ``forward`` once on Proxies and bakes every Python branch into the
  graph, so a branch on ``torch.is_grad_enabled()`` would fix the graph to the grad mode of the trace;
* ``torch.jit.trace`` (which fvcore and so timm's ``benchmark.py`` use to count MACs) records an autograd
  function as an opaque ``PythonOp`` that no MAC counter sees and that ``torch.jit.save`` refuses;
* TorchScript cannot compile an autograd function (the two are ``torch.jit.unused`` there).

While any of them records, and whenever autograd does not (inference), the blocks call their modules
instead: plain differentiable ops, the same function, correct in both grad modes, and each module's
forward hooks and fvcore's per-module counts see it. ``torch.compile`` and ``torch.export`` are not
recorders in this sense (Dynamo folds both tracing queries to ``False``).
"""

from __future__ import annotations

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

__all__ = ["fused_training"]


def fused_training() -> bool:
    """True when the blocks compute their training formulation: autograd records the forward and neither
    ``torch.fx`` nor ``torch.jit.trace`` does (always False in TorchScript)."""
    if torch.jit.is_scripting():
        return False
    else:
        return torch.is_grad_enabled() and not (torch.jit.is_tracing() or is_fx_symbolic_tracing())
