"""Parameter and MAC counting with fvcore, including the ``gspn2::propagate`` op.

fvcore counts one multiply-add as one "flop", which is the MAC convention of the GSPN papers; we call the
result MACs. fvcore does not know our custom op, so a handle is registered for ``gspn2::propagate``:
4 MACs per output element (3 neighbour products + lambda * x, SPEC 1.1), the output being
``(B, 4, C, H, W)``, i.e. all four directions. Operators fvcore cannot count are not hidden: they are
returned in :attr:`ModelCount.unsupported_ops` (which includes the elementwise ops fvcore skips by design
only where fvcore itself reports them).

Example::

    from gspn2.counting import count_model
    c = count_model(model, input_size=(3, 224, 224))
    print(c.params, c.macs)
    print(c.table(max_depth=2))
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from fvcore.nn import FlopCountAnalysis
from fvcore.nn.jit_handles import get_shape

__all__ = ["ModelCount", "count_model", "propagate_mac_handle", "PROPAGATE_MACS_PER_ELEMENT"]

#: MACs per output element of ``gspn2::propagate`` (per direction; the output holds all four directions).
PROPAGATE_MACS_PER_ELEMENT = 4


def propagate_mac_handle(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle for ``gspn2::propagate``: ``4 * numel(h)`` with ``h`` of shape ``(B, 4, C, H, W)``."""
    shape = get_shape(outputs[0])
    if shape is None or len(shape) != 5:
        raise ValueError(f"gspn2::propagate: expected a (B, 4, C, H, W) output, got shape {shape}")
    return PROPAGATE_MACS_PER_ELEMENT * math.prod(shape)


@dataclass
class ModelCount:
    """Result of :func:`count_model`.

    Attributes:
        params: Number of parameters (all, trainable or not).
        macs: Multiply-accumulates of one forward pass at ``input_size`` and ``batch_size``.
        input_size: ``(C, H, W)`` that was counted.
        batch_size: Batch size that was counted (``macs`` scales with it).
        unsupported_ops: Operator name -> number of calls fvcore could not count.
        by_module: Module name -> MACs (``""`` is the whole model), every module of the model.
        params_by_module: Module name -> parameters (``""`` is the whole model).
    """

    params: int
    macs: int
    input_size: Tuple[int, int, int]
    batch_size: int
    unsupported_ops: Dict[str, int] = field(default_factory=dict)
    by_module: Dict[str, int] = field(default_factory=dict)
    params_by_module: Dict[str, int] = field(default_factory=dict)

    def table(self, max_depth: int = 2, min_fraction: float = 0.0) -> str:
        """Printable per-module breakdown down to ``max_depth`` name components.

        Rows with less than ``min_fraction`` of both total params and total MACs are left out.
        """
        rows = []
        for name, macs in self.by_module.items():
            depth = 0 if name == "" else name.count(".") + 1
            if depth > max_depth:
                continue
            params = self.params_by_module.get(name, 0)
            if name and max(params / max(self.params, 1), macs / max(self.macs, 1)) < min_fraction:
                continue
            rows.append((name or "(model)", params, macs))
        width = max(len("module"), *(len(r[0]) for r in rows))
        lines = [f"{'module':<{width}}  {'params':>12}  {'MACs':>16}  {'MACs %':>7}"]
        for name, params, macs in rows:
            share = 100.0 * macs / max(self.macs, 1)
            lines.append(f"{name:<{width}}  {params:>12,}  {macs:>16,}  {share:>6.2f}%")
        if self.unsupported_ops:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.unsupported_ops.items()))
            lines.append(f"not counted by fvcore: {ops}")
        return "\n".join(lines)

    def __str__(self) -> str:
        C, H, W = self.input_size
        return (
            f"params {self.params / 1e6:.2f} M, MACs {self.macs / 1e9:.3f} G "
            f"at batch {self.batch_size} x {C}x{H}x{W}"
        )


def _parse_input_size(input_size: Sequence[int]) -> Tuple[int, int, int]:
    if len(input_size) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in input_size):
        raise ValueError(f"`input_size` must be three positive ints (C, H, W), got {input_size!r}")
    return tuple(input_size)  # type: ignore[return-value]


def count_model(
    model: nn.Module, input_size: Sequence[int] = (3, 224, 224), batch_size: int = 1
) -> ModelCount:
    """Count parameters and forward MACs of ``model`` with fvcore (one real traced forward pass).

    Args:
        model: Any module that takes one ``(B, C, H, W)`` tensor.
        input_size: ``(C, H, W)`` of the input.
        batch_size: Batch size of the traced forward; MACs scale with it.
    Returns:
        :class:`ModelCount`. The model's train/eval mode is restored afterwards.
    """
    input_size = _parse_input_size(input_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    ref = next(model.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    x = torch.randn((batch_size, *input_size), generator=torch.Generator().manual_seed(0)).to(device, dtype)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            analysis = FlopCountAnalysis(model, (x,))
            analysis.set_op_handle("gspn2::propagate", propagate_mac_handle)
            # Unsupported ops are returned in the result instead of logged once per run.
            analysis.unsupported_ops_warnings(False)
            analysis.uncalled_modules_warnings(False)
            # fvcore's tracer warns through the root logger about every non-tensor output; keep it quiet.
            logging.getLogger("fvcore").setLevel(logging.ERROR)
            macs = int(analysis.total())
            by_module = {k: int(v) for k, v in analysis.by_module().items()}
            unsupported = {k: int(v) for k, v in analysis.unsupported_ops().items()}
    finally:
        model.train(was_training)

    params_by_module = {
        name: sum(p.numel() for p in module.parameters()) for name, module in model.named_modules()
    }
    return ModelCount(
        params=sum(p.numel() for p in model.parameters()),
        macs=macs,
        input_size=input_size,
        batch_size=batch_size,
        unsupported_ops=unsupported,
        by_module=by_module,
        params_by_module=params_by_module,
    )
