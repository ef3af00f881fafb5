"""gspn2.inductor: the pass that writes Inductor's matrix ``addmm`` back as ``mm`` and ``add``, and the compile
call that applies it where the option ``addmm`` asks."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gspn2 import inductor
from gspn2.ops import options


def _sums(a, b, m, bias):
    return torch.addmm(m, a, b).relu(), torch.addmm(bias, a, b), torch.addmm(m, a, b, beta=0.5)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in ((16, 8), (8, 12), (16, 12), (12,))]


def _targets(gm: torch.fx.GraphModule) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_split_matrix_addmm_rewrites_only_the_sums_with_a_matrix():
    """An ``addmm`` whose input is a matrix (and alpha = beta = 1) becomes ``mm`` + ``add`` with the same
    values and fake values for Inductor's later passes; a bias vector's ``addmm`` and one with another beta
    stay as they are."""
    args = _inputs()
    gm = make_fx(_sums, tracing_mode="fake")(*args)
    assert _targets(gm).count("aten.addmm.default") == 3
    assert inductor.split_matrix_addmm(gm.graph) == 1
    gm.recompile()
    targets = _targets(gm)
    assert targets.count("aten.addmm.default") == 2 and "aten.mm.default" in targets
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta.get("val"), torch.Tensor), node
    for got, want in zip(gm(*args), _sums(*args)):
        torch.testing.assert_close(got, want)


def test_compile_applies_the_pass_where_the_option_asks(monkeypatch):
    """``gspn2.inductor.compile``: with ``addmm="split"`` the mode's Inductor settings plus the pass, which
    then runs on the compiled graph (the same values); with ``auto`` / ``fused`` plain ``torch.compile``."""
    calls = []
    real = inductor.split_matrix_addmm
    monkeypatch.setattr(inductor, "split_matrix_addmm", lambda graph: calls.append(real(graph)) or calls[-1])

    def fn(a, b, m):
        return (a @ b + m).relu()

    args = _inputs()[:3]
    for choice in ("auto", "fused"):
        with options.override(addmm=choice):
            assert inductor.compile_options("reduce-overhead") is None
    with options.override(addmm="split"):
        settings = inductor.compile_options("reduce-overhead")
        assert settings["triton.cudagraphs"] is True
        assert isinstance(settings["post_grad_custom_post_pass"], inductor.SplitMatrixAddmm)
        assert inductor.SplitMatrixAddmm().uuid() == settings["post_grad_custom_post_pass"].uuid()
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph skips the passes
            got = inductor.compile(fn)(*args)
    assert calls == [1]  # Inductor had fused the sum into addmm; the pass split it again
    torch.testing.assert_close(got, fn(*args))
