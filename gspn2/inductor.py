"""gspn2's changes to the graphs Inductor (``torch.compile``'s default backend) builds, and the compile call
that applies them.

Inductor's post-grad patterns rewrite ``mm(a, b) + m`` as ``addmm(m, a, b)`` whenever ``m`` has the product's
shape, not only for a bias vector. On CUDA, ATen runs ``addmm`` with such a matrix input and a separate output
as a copy of ``m`` into the output followed by a GEMM with ``beta = 1`` (only a bias vector goes to
cuBLASLt's epilogue), so the sum costs a copy and a second read of the output besides the GEMM. In a GSPN-2
training step's backward those are the sums of two gradients of one activation: the mixer's ``generate``
input gradient plus the skip's, and the two chunks of ``in_proj``. :func:`split_matrix_addmm` turns them back
into ``mm`` and ``add``, which Inductor then fuses with the pointwise kernel that reads the sum.

The option ``addmm`` (:mod:`gspn2.ops.options`, ``GSPN2_ADDMM``) decides: ``split`` applies the pass,
``auto`` / ``fused`` leave Inductor's graphs as they are. :func:`compile` applies it; a model compiled with
``torch.compile`` directly gets Inductor's graphs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from gspn2.ops import options as _options

__all__ = ["SplitMatrixAddmm", "compile", "compile_options", "split_matrix_addmm"]


def split_matrix_addmm(graph: torch.fx.Graph) -> int:
    """Rewrites every ``addmm(m, a, b)`` of ``graph`` whose input ``m`` is a matrix (not a bias vector), with
    ``alpha = beta = 1``, as ``mm(a, b) + m``; returns how many it rewrote. Each new node gets its fake value
    (``meta["val"]``), as Inductor's later passes expect."""
    aten = torch.ops.aten
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        m, a, b = node.args[:3]
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1 or len(node.args) > 3:
            continue
        val = m.meta.get("val") if isinstance(m, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != 2 or "val" not in node.meta:
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            add = graph.call_function(aten.add.Tensor, (mm, m))
        out = node.meta["val"]
        with out.fake_mode:
            mm.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
        add.meta["val"] = out
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


class SplitMatrixAddmm(CustomGraphPass):
    """:func:`split_matrix_addmm` as an Inductor post-grad pass (``post_grad_custom_post_pass``), with an id
    for Inductor's cache (this file's hash)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        split_matrix_addmm(graph)

    def uuid(self) -> Optional[Any]:
        return get_hash_for_files((__file__,))


def compile_options(mode: Optional[str] = None) -> Optional[dict]:
    """Inductor's settings for ``torch.compile(..., mode=mode)`` plus gspn2's pass where the option
    ``addmm`` asks for it (``split``); ``None`` where nothing is added (then compile with ``mode``)."""
    if _options.current().addmm != "split":
        return None
    from torch._inductor import list_mode_options

    settings = dict(list_mode_options(mode or "default"))
    settings["post_grad_custom_post_pass"] = SplitMatrixAddmm()
    return settings


def compile(model: Any, mode: Optional[str] = None, **kwargs: Any) -> Any:
    """``torch.compile(model, mode=mode, **kwargs)`` with gspn2's Inductor pass where the option ``addmm``
    asks for it (then the mode's settings go in as ``options``, which is what ``mode`` does)."""
    settings = compile_options(mode)
    if settings is None:
        return torch.compile(model, mode=mode, **kwargs)
    return torch.compile(model, options=settings, **kwargs)
