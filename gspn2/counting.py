"""Parameter and MAC counting with fvcore, including the ``gspn2::propagate`` op.

fvcore counts one multiply-add as one "flop", which is the MAC convention of the GSPN papers; we call the
result MACs. fvcore does not know our custom ops, so handles are registered for them:
``gspn2::depthwise_conv2d``, K * K MACs per output element (as fvcore counts a depthwise convolution), and
``gspn2::propagate``, 4 MACs per output element (3 neighbour products + lambda * x, docs/spec.md 1.6), the output being
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

import importlib
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = [
    "GSPN2_COMPONENTS",
    "MAC_TOLERANCE",
    "PAPER_COUNTS",
    "PARAM_TOLERANCE",
    "PROPAGATE_MACS_PER_ELEMENT",
    "ModelCount",
    "PaperCount",
    "count_model",
    "depthwise_conv_mac_handle",
    "propagate_mac_handle",
    "register_fvcore_default_handles",
]

def _fvcore_nn():
    """``fvcore.nn``, imported on first use: ``import gspn2`` (and with it :mod:`gspn2.ops`) does not need
    fvcore, only counting does."""
    with warnings.catch_warnings():
        # fvcore.nn scripts its focal loss at import time; torch deprecates jit.script. Not our concern here.
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        return importlib.import_module("fvcore.nn")


def fvcore_available() -> bool:
    """Whether fvcore imports (it is a dependency of the package; a bare environment may lack it)."""
    try:
        importlib.import_module("fvcore")
    except ImportError:
        return False
    return True


def get_shape(value: Any):
    """The shape fvcore reads from a traced value (``fvcore.nn.jit_handles.get_shape``)."""
    return importlib.import_module("fvcore.nn.jit_handles").get_shape(value)


#: MACs per output element of ``gspn2::propagate`` (per direction; the output holds all four directions).
PROPAGATE_MACS_PER_ELEMENT = 4


class PaperCount(NamedTuple):
    """Published size of a model at 224x224 with 1000 classes."""

    params: float
    macs: float


#: GSPN-2 paper (arXiv 2512.07884), Table of ImageNet-1k results; MACs as fvcore counts them.
PAPER_COUNTS: Dict[str, PaperCount] = {
    "gspn2_tiny": PaperCount(params=24e6, macs=4.2e9),
    "gspn2_small": PaperCount(params=50e6, macs=9.2e9),
    "gspn2_base": PaperCount(params=89e6, macs=14.2e9),
}
#: Allowed relative deviation from :data:`PAPER_COUNTS` (the sizing contract of the model family).
PARAM_TOLERANCE = 0.03
MAC_TOLERANCE = 0.05

#: ``(label, regex)`` rules that split a :class:`gspn2.models.GSPN2` into components; a module whose full
#: name matches a regex counts for that label (the regexes select disjoint modules).
GSPN2_COMPONENTS: Tuple[Tuple[str, str], ...] = (
    ("stem", r"stem"),
    ("downsampling", r"stages\.\d+\.downsample"),
    ("local perception units", r"stages\.\d+\.blocks\.\d+\.lpu[12]"),
    ("block norms", r"stages\.\d+\.blocks\.\d+\.norm[12]"),
    ("mixers", r"stages\.\d+\.blocks\.\d+\.mixer"),
    ("MLPs", r"stages\.\d+\.blocks\.\d+\.mlp"),
    ("layer scale", r"stages\.\d+\.blocks\.\d+\.ls[12]"),
    ("head", r"head"),
)


def propagate_mac_handle(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle for ``gspn2::propagate``: ``4 * numel(h)`` with ``h`` of shape ``(B, 4, C, H, W)``."""
    shape = get_shape(outputs[0])
    if shape is None or len(shape) != 5:
        raise ValueError(f"gspn2::propagate: expected a (B, 4, C, H, W) output, got shape {shape}")
    return PROPAGATE_MACS_PER_ELEMENT * math.prod(shape)


def depthwise_conv_mac_handle(inputs: List[Any], outputs: List[Any]) -> int:
    """fvcore handle for ``gspn2::depthwise_conv2d``: ``K * K`` MACs per output element, as fvcore counts a
    depthwise ``nn.Conv2d`` (the fused ``+ x`` is elementwise and, like fvcore's, not counted)."""
    out, weight = get_shape(outputs[0]), get_shape(inputs[1])
    if out is None or weight is None or len(out) != 4 or len(weight) != 4:
        raise ValueError(f"gspn2::depthwise_conv2d: expected 4-D output and weight, got {out} and {weight}")
    return weight[2] * weight[3] * math.prod(out)


#: fvcore handles of gspn2's custom ops, by the names fvcore's traces give them.
FVCORE_HANDLES = {
    "gspn2::propagate": propagate_mac_handle,
    "gspn2::depthwise_conv2d": depthwise_conv_mac_handle,
}


def register_fvcore_default_handles() -> None:
    """Add :data:`FVCORE_HANDLES` to fvcore's table of default handles, which every ``FlopCountAnalysis``
    starts from, so that one built without ``set_op_handle`` (timm's ``benchmark.py``) counts gspn2's ops.
    Called when :mod:`gspn2.ops` is imported (if fvcore is installed) and again by :func:`count_model`;
    calling it twice is harmless. A handle fvcore already has for one of these names is a
    conflict, not something to overwrite: it raises ``RuntimeError``."""
    # importlib: ``fvcore.nn.flop_count`` as an attribute is the function of that name, not the module.
    _fvcore_nn()  # imports fvcore.nn (and flop_count) with its import-time warning filtered
    table = getattr(importlib.import_module("fvcore.nn.flop_count"), "_DEFAULT_SUPPORTED_OPS", None)
    if not isinstance(table, dict):
        raise RuntimeError(
            "fvcore.nn.flop_count has no _DEFAULT_SUPPORTED_OPS table (an fvcore this gspn2 was not written "
            "for): gspn2's ops cannot be registered with it"
        )
    for name, handle in FVCORE_HANDLES.items():
        if table.get(name, handle) is not handle:
            raise RuntimeError(f"fvcore already has a different handle for {name!r}: {table[name]!r}")
        table[name] = handle


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
        by_operator: Operator -> MACs, named as fvcore names them, without namespace (``"conv"``,
            ``"linear"``, ``"layer_norm"``, ``"propagate"`` for ``gspn2::propagate``).
        params_by_module: Module name -> parameters (``""`` is the whole model).
    """

    params: int
    macs: int
    input_size: Tuple[int, int, int]
    batch_size: int
    unsupported_ops: Dict[str, int] = field(default_factory=dict)
    by_module: Dict[str, int] = field(default_factory=dict)
    by_operator: Dict[str, int] = field(default_factory=dict)
    params_by_module: Dict[str, int] = field(default_factory=dict)

    @property
    def propagate_macs(self) -> int:
        """MACs of all ``gspn2::propagate`` calls (fvcore drops the ``gspn2::`` namespace)."""
        return self.by_operator.get("propagate", 0)

    def grouped(
        self, rules: Sequence[Tuple[str, str]] = GSPN2_COMPONENTS
    ) -> List[Tuple[str, int, int]]:
        """``(label, params, macs)`` per component; modules are matched by full name against each rule's
        regex. A final ``"other"`` row holds whatever no rule matched, so the rows always sum to the
        totals (and a rule set that double counts shows up as a negative ``"other"``)."""
        rows = []
        for label, pattern in rules:
            regex = re.compile(pattern)
            names = [n for n in self.params_by_module if n and regex.fullmatch(n)]
            rows.append(
                (
                    label,
                    sum(self.params_by_module[n] for n in names),
                    sum(self.by_module.get(n, 0) for n in names),
                )
            )
        rows.append(
            ("other", self.params - sum(r[1] for r in rows), self.macs - sum(r[2] for r in rows))
        )
        return rows

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
        # Trace-time warnings about Python conditionals (input checks) do not affect the counts.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            analysis = _fvcore_nn().FlopCountAnalysis(model, (x,))
            analysis.set_op_handle(**FVCORE_HANDLES)
            # Unsupported ops are returned in the result instead of logged once per run.
            analysis.unsupported_ops_warnings(False)
            analysis.uncalled_modules_warnings(False)
            macs = int(analysis.total())
            by_module = {k: int(v) for k, v in analysis.by_module().items()}
            by_operator = {k: int(v) for k, v in analysis.by_operator().items()}
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
        by_operator=by_operator,
        params_by_module=params_by_module,
    )
