"""What a timm user reaches for works on GSPN-2: torch.fx (timm's tracer, feature extraction), TorchScript,
torch.export with dynamic sizes, EMA weights through timm's loaders, MAC/FLOP counters, and clear errors for
inputs the model cannot take.

timm's own model tests run against gspn2 with ``scripts/run_timm_tests.sh``; these are ours, on
``gspn2_micro`` and small inputs (the CPU op loops over scan steps in Python).
"""

from __future__ import annotations

import io
import math

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules, load_checkpoint
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor, get_graph_node_names

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.counting import PROPAGATE_MACS_PER_ELEMENT, count_model
from gspn2.models.gspn2 import check_input, checkpoint_filter_fn, min_input_size
from gspn2.ops import gspn_propagate
from gspn2.ops._flops import PROPAGATE_BACKWARD_MACS_PER_ELEMENT
from gspn2.train.checkpoint import CHECKPOINT_FORMAT, load_checkpoint as load_train_checkpoint, save_checkpoint
from tests.models._models import images, micro
from tests.models._reference import reference

# timm's own fx tests trace with these settings (tests/test_models.py, _create_fx_model).
TIMM_TRACER_KWARGS = dict(
    leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True
)


def _fx_classifier(model: torch.nn.Module) -> torch.nn.Module:
    """timm's way: a feature extractor returning the last node, separate train and eval graphs."""
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=TIMM_TRACER_KWARGS)
    return create_feature_extractor(
        model,
        train_return_nodes=[train_nodes[-1]],
        eval_return_nodes=[eval_nodes[-1]],
        tracer_kwargs=TIMM_TRACER_KWARGS,
    )


# ------------------------------------------------------------------------------------------ torch.fx


def test_fx_graph_equals_eager_in_eval_and_trains_every_parameter():
    model = micro()
    fx = _fx_classifier(model)
    x = images(2, 40, 48)
    model.eval()
    fx.eval()
    with torch.inference_mode():
        assert torch.equal(next(iter(fx(x).values())), model(x))
    # Traced once, the graph is right in either grad mode: it recorded the plain (inference) formulation.
    with torch.no_grad():
        assert torch.equal(next(iter(fx(x).values())), model(x))

    model.train()
    fx.train()
    out = next(iter(fx(x).values()))
    torch.testing.assert_close(out, model(x))  # the eager training path: same function, other kernels
    out.mean().backward()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(list(fx.parameters()))
    missing = [n for n, p in fx.named_parameters() if p.grad is None]
    assert not missing, f"no gradient through the fx graph for {missing}"
    assert all(p.grad.abs().sum() > 0 for n, p in fx.named_parameters() if not n.endswith("bias"))


def test_fx_leaves_are_called_not_traced_through():
    model = micro().eval()
    graph = NodePathTracer(**TIMM_TRACER_KWARGS).trace(model)
    called = {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}
    assert {"check_input", "propagate", "depthwise_conv", "layer_norm_last_dim"} <= called
    # The op entry points are registered too, for modules of one's own that call them directly.
    assert {gspn_propagate, gspn2.ops.depthwise_conv2d, gspn2.layers.norm_linear} <= set(get_notrace_functions())


def test_plain_symbolic_trace_equals_eager():
    model = micro().eval()
    traced = torch.fx.symbolic_trace(model)
    x = images(1, 33, 47)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))


def test_features_only_fx_equals_intermediates():
    torch.manual_seed(0)
    fx = timm.create_model("gspn2_micro", features_only=True, feature_cls="fx").eval()
    model = timm.create_model("gspn2_micro").eval()
    prefix = "graph_module."
    weights = {k[len(prefix) :]: v for k, v in fx.state_dict().items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("head.") for k in missing)  # the extractor has no head
    assert [f["module"] for f in fx.feature_info.get_dicts()] == [f"stages.{i}" for i in range(4)]
    x = images(1, 64, 64)
    with torch.no_grad():
        got = fx(x)
        want = model.forward_intermediates(x, intermediates_only=True)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_fx_graph_checks_its_input_when_run():
    fx = torch.fx.symbolic_trace(micro().eval())
    with pytest.raises(ValueError, match="4-D"):
        fx(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match=">= 29"):
        fx(torch.randn(1, 3, 28, 32))


# ------------------------------------------------------------------------------------------ TorchScript


def test_torchscript_matches_eager_and_saves():
    model = micro().eval()
    scripted = torch.jit.script(model)
    x = images(2, 33, 40)
    with torch.no_grad():
        want = model(x)
        got = scripted(x)
        oracle = reference(model)(x)
    assert torch.equal(got, want)  # the same formulation: the module calls of inference
    torch.testing.assert_close(got, oracle, rtol=0, atol=1e-6)
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    with torch.no_grad():
        assert torch.equal(loaded(x), got)


def test_torchscript_of_the_fx_graph_runs():
    """timm's test_model_forward_fx_torchscript: the leaves of the fx graph must be scriptable."""
    model = micro().eval()
    scripted = torch.jit.script(_fx_classifier(model).eval())
    x = images(1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(next(iter(scripted(x).values())), model(x))


def test_jit_trace_records_no_python_op_in_training():
    """Under torch.jit.trace (fvcore, timm's profiler) the autograd functions would be opaque PythonOps."""
    model = micro().train()
    traced = torch.jit.trace(model, images(1, 32, 32), check_trace=False)
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert "prim::PythonOp" not in kinds
    assert "gspn2::propagate" in kinds
    torch.jit.save(traced, io.BytesIO())


# ------------------------------------------------------------------------------------------ torch.export


def test_op_exports_with_dynamic_batch():
    """The op's input check compares each size on its own: a dynamic batch is not tied to C and pinned."""

    class Op(torch.nn.Module):
        def forward(self, x, lam, gates):
            return gspn_propagate(x, lam, gates)

    B, C, H, W = 3, 2, 5, 6
    args = (torch.randn(B, C, H, W), torch.rand(B, 4, C, H, W), torch.randn(B, 4, 3, 1, H, W))
    b, h, w = torch.export.Dim("b"), torch.export.Dim("h"), torch.export.Dim("w")
    shapes = ({0: b, 2: h, 3: w}, {0: b, 3: h, 4: w}, {0: b, 4: h, 5: w})
    ep = torch.export.export(Op(), args, dynamic_shapes=shapes)  # a pinned batch raises here
    other = (torch.randn(5, C, 4, 7), torch.rand(5, 4, C, 4, 7), torch.randn(5, 4, 3, 1, 4, 7))
    torch.testing.assert_close(ep.module()(*other), gspn_propagate(*other))


def test_model_exports_with_dynamic_batch_height_width():
    # A small member keeps the export quick; the model code is that of every registered GSPN2.
    torch.manual_seed(0)
    model = timm.create_model("gspn2_micro", depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=5).eval()
    auto = torch.export.Dim.AUTO
    with torch.no_grad():
        ep = torch.export.export(model, (images(2, 64, 64),), dynamic_shapes={"x": {0: auto, 2: auto, 3: auto}})
    x_shape = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x").meta["val"].shape
    assert all(isinstance(s, torch.SymInt) for s in (x_shape[0], x_shape[2], x_shape[3]))
    for shape in [(3, 3, 64, 64), (1, 3, 96, 72), (4, 3, 64, 80)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), model(x))


# ------------------------------------------------------------------------------------------ EMA weights


def _train_checkpoint(tmp_path, with_ema: bool = True):
    model = micro()
    ema = micro()
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(1.0)  # the EMA weights differ from the model's everywhere
    state = {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),
        "model_name": "gspn2_micro",
        "ema": ema.state_dict() if with_ema else None,
        "ema_updates": 7 if with_ema else 0,
        "epoch": 1,
        "step": 7,
        "config": {},
    }
    path = tmp_path / "last.pt"
    save_checkpoint(state, path)
    return path, model, ema


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_timm_loaders_get_the_ema_when_asked(tmp_path):
    path, model, ema = _train_checkpoint(tmp_path)
    # timm's validate.py: load_checkpoint(model, args.checkpoint, args.use_ema)
    for use_ema, expected in ((True, ema), (False, model)):
        fresh = micro()
        load_checkpoint(fresh, str(path), use_ema=use_ema)
        assert _same_weights(fresh, expected), f"use_ema={use_ema}"
    # A pretrained file: timm's load_state_dict defaults to the EMA, then our filter unwraps nothing more.
    pretrained = timm.create_model(
        "gspn2_micro", pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(file=str(path), num_classes=10)
    )
    assert _same_weights(pretrained, ema)
    # Our own loader still reads the file, and the alias is the same dict as `ema`.
    state = load_train_checkpoint(path)
    assert state["state_dict_ema"].keys() == state["ema"].keys()
    assert all(torch.equal(state["state_dict_ema"][k], v) for k, v in state["ema"].items())


def test_ema_alias_is_stored_once(tmp_path):
    path, _, _ = _train_checkpoint(tmp_path)
    no_alias = tmp_path / "plain.pt"
    torch.save(torch.load(path, weights_only=True) | {"state_dict_ema": None}, no_alias)
    assert path.stat().st_size < 1.05 * no_alias.stat().st_size


def test_without_ema_timm_falls_back_to_the_model_weights(tmp_path):
    path, model, _ = _train_checkpoint(tmp_path, with_ema=False)
    assert "state_dict_ema" not in torch.load(path, weights_only=True)
    fresh = micro()
    load_checkpoint(fresh, str(path), use_ema=True)
    assert _same_weights(fresh, model)


def test_checkpoint_filter_fn_prefers_the_ema_of_a_whole_checkpoint():
    model, ema = micro(), micro()
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(2.0)
    # A checkpoint written before train.py saved the timm key: only `ema`.
    old = {"format": CHECKPOINT_FORMAT, "model": model.state_dict(), "ema": ema.state_dict()}
    out = checkpoint_filter_fn(old, micro())
    assert all(torch.equal(out[k], v) for k, v in ema.state_dict().items())
    no_ema = {"format": CHECKPOINT_FORMAT, "model": model.state_dict(), "ema": None}
    out = checkpoint_filter_fn(no_ema, micro())
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------ MAC counts


def test_flop_formulas_of_the_custom_ops():
    B, C, H, W = 2, 2, 5, 6
    x = torch.randn(B, C, H, W, requires_grad=True)
    lam = torch.rand(B, 4, C, H, W, requires_grad=True)
    gates = torch.randn(B, 4, 3, 1, H, W, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        gspn_propagate(x, lam, gates).sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    out = B * 4 * C * H * W
    assert counts["gspn2.propagate"] == 2 * PROPAGATE_MACS_PER_ELEMENT * out
    assert counts["gspn2.propagate_backward"] == 2 * PROPAGATE_BACKWARD_MACS_PER_ELEMENT * out

    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    y = torch.randn(2, 4, 6, 7, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        gspn2.ops.depthwise_conv2d(y, conv.weight, conv.bias, add_input=True).sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts["gspn2.depthwise_conv2d"] == 2 * 9 * y.numel()
    assert counts["gspn2.depthwise_conv2d_backward"] == 2 * 9 * (y.numel() + y.numel())


@pytest.mark.parametrize("grad", [False, True])
def test_flop_counter_mode_agrees_with_gspn2_counting(grad):
    """FlopCounterMode counts two FLOPs per MAC and no norms or pooling; fvcore (gspn2.counting) counts
    those too. Everything else agrees exactly, in inference and on the training path."""
    model = micro().eval()
    c = count_model(model, (3, 64, 64))
    with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
        model(torch.ones(1, 3, 64, 64))
    macs = counter.get_total_flops() / 2
    not_counted_by_torch = c.by_operator["layer_norm"] + c.by_operator["adaptive_avg_pool2d"]
    assert macs == c.macs - not_counted_by_torch
    assert math.isclose(macs, c.macs, rel_tol=0.05)  # micro at 64^2: 3.7 % below (gspn2_tiny at 224^2: 0.74 %)


@pytest.mark.parametrize("train", [False, True])
def test_fvcore_as_timm_benchmark_uses_it_counts_everything(train):
    """timm's benchmark.py: FlopCountAnalysis with its default handles, grad enabled."""
    from fvcore.nn import FlopCountAnalysis

    model = micro()
    expected = count_model(model, (3, 64, 64)).macs
    model.train(train)
    analysis = FlopCountAnalysis(model, torch.ones(1, 3, 64, 64))
    analysis.unsupported_ops_warnings(False)
    analysis.uncalled_modules_warnings(False)
    assert analysis.total() == expected
    assert not any(op.startswith(("gspn2::", "prim::PythonOp")) for op in analysis.unsupported_ops())


# ------------------------------------------------------------------------------------------ input checks


@pytest.mark.parametrize(
    "shape,error,match",
    [
        ((3, 32, 32), ValueError, "4-D .* x.unsqueeze\\(0\\)"),
        ((0, 3, 32, 32), ValueError, "batch size 0"),
        ((1, 3, 28, 32), ValueError, "28x32 .* >= 29"),
        ((1, 3, 32, 28), ValueError, "32x28 .* >= 29"),
        ((1, 4, 32, 32), ValueError, "4 channels .* takes 3"),
    ],
)
def test_bad_input_is_a_clear_error(shape, error, match):
    model = micro().eval()
    with pytest.raises(error, match=match):
        model(torch.randn(shape))
    with pytest.raises(error, match=match):
        model.forward_intermediates(torch.randn(shape))


def test_smallest_input_runs_and_minimum_follows_the_stages():
    assert min_input_size(4) == 29
    assert [min_input_size(n) for n in (1, 2, 3)] == [1, 5, 13]
    model = micro().eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 29, 29)).shape == (1, 10)
        # Fewer stages need less: forward_intermediates(stop_early) checks against what it runs.
        feats = model.forward_intermediates(torch.randn(1, 3, 13, 13), indices=[2], stop_early=True)[1]
        assert feats[0].shape == (1, 64, 1, 1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        model([[1.0]])


def test_input_check_under_compile_fullgraph_dynamic():
    compiled = torch.compile(lambda x: check_input(x, 3, 29) * 2, fullgraph=True, dynamic=True, backend="eager")
    assert compiled(torch.ones(2, 3, 30, 31)).shape == (2, 3, 30, 31)
    assert compiled(torch.ones(5, 3, 64, 40)).shape == (5, 3, 64, 40)
    # Dynamo reports the raise as an unsupported "observed exception" that carries the message.
    with pytest.raises(Exception, match="needs H, W >= 29"):
        compiled(torch.ones(2, 3, 28, 40))


def test_scripted_model_checks_its_input():
    scripted = torch.jit.script(micro().eval())
    with pytest.raises(torch.jit.Error, match="batch size 0"):
        scripted(torch.randn(0, 3, 32, 32))
