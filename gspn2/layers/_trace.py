"""Which formulation a Python-level graph recorder should see.

The blocks' training path uses autograd functions (:func:`~gspn2.layers.norm_linear`,
:func:`~gspn2.layers.gelu_linear`) that save fewer activations. Two recorders cannot use them:

* ``torch.fx`` symbolic tracing runs ``forward`` once on Proxies and bakes every Python branch into the
  graph, so a branch on ``torch.is_grad_enabled()`` would fix the graph to the grad mode of the trace;
* ``torch.jit.trace`` (which fvcore and so timm's ``benchmark.py`` use to count MACs) records an autograd
  function as an opaque ``PythonOp`` that no MAC counter sees and that ``torch.jit.save`` refuses.

While either records, the blocks take their inference formulation instead: plain differentiable ops, the
same function, correct in both grad modes. ``torch.compile`` and ``torch.export`` are not affected (Dynamo
folds both queries to ``False``).
"""

from __future__ import annotations

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

__all__ = ["recording_graph"]


def recording_graph() -> bool:
    """True while ``torch.fx`` symbolically traces or ``torch.jit.trace`` records the forward."""
    return torch.jit.is_tracing() or is_fx_symbolic_tracing()
