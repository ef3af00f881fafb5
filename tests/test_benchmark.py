"""gspn2.benchmark: median_ms and graph_ms (call counts and argument checks, no timing assertions),
dwconv_shapes, model_step."""

from __future__ import annotations

import pytest

import torch

import gspn2  # noqa: F401  (registers the models)
from gspn2.benchmark import (
    DWCONV_VARIANTS, dwconv_shapes, dwconv_variant_options, graph_ms, median_ms, model_step,
)
from gspn2.ops import dwconv, options


def test_runs_warmup_then_timed_calls():
    calls = []
    ms = median_ms(lambda: calls.append(1), warmup=3, iters=5, cuda=False)
    assert len(calls) == 8
    assert isinstance(ms, float) and ms >= 0.0


@pytest.mark.parametrize("warmup, iters", [(-1, 5), (0, 0)])
def test_bad_counts_are_named(warmup, iters):
    with pytest.raises(ValueError, match="`warmup` must be >= 0 and `iters` >= 1"):
        median_ms(lambda: None, warmup=warmup, iters=iters)


def test_graph_ms_bad_counts_are_named():
    with pytest.raises(ValueError, match="`reps` and `iters` must be >= 1 and `warmup` >= 0"):
        graph_ms(lambda: None, reps=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graph_ms_replays_the_captured_calls():
    x = torch.zeros(4, device="cuda")
    calls = []

    def step():
        calls.append(1)
        x.add_(1)

    ms = graph_ms(step, reps=5, iters=4, warmup=2)
    torch.cuda.synchronize()
    assert len(calls) == 2 + 5  # Python runs the warm-up and the capture only
    # the warm-up, then 5 adds per replay: median_ms's one untimed replay and its 4 timed ones
    assert x.tolist() == [2.0 + 5 * (1 + 4)] * 4
    assert ms > 0.0


def test_dwconv_shapes_of_a_model():
    shapes = dwconv_shapes("gspn2_tiny", 224)
    # per stage: the 3x3 LPU on C channels with its residual (two per block), the mixer's 7x7 on 1.5C (one);
    # gspn2_tiny's depths are 2, 3, 8, 2
    assert shapes[:2] == [(80, 56, 3, True, 4), (120, 56, 7, False, 2)]
    assert shapes[-2:] == [(640, 7, 3, True, 4), (960, 7, 7, False, 2)]
    assert [s[4] for s in shapes[1::2]] == [2, 3, 8, 2]
    # an odd input: the stem's two stride-2 convolutions round up
    assert dwconv_shapes("gspn2_tiny", 225)[0][1] == 57
    with pytest.raises(ValueError, match="`model` must be a GSPN-2 model"):
        dwconv_shapes("resnet18", 224)


def test_dwconv_variant_names_select_the_op_arguments():
    """Each ``t<kernel>v<cols>`` name sets the options whose op arguments are (kernel, cols); auto keeps
    AUTO_VARIANT; anything else is refused by name."""
    saved = options.current()
    try:
        for name in DWCONV_VARIANTS:
            options.set_options(**dwconv_variant_options(name))
            assert dwconv.variant(7) == (int(name[1]), int(name[3])), name
        for name in ("", "auto"):
            options.set_options(**dwconv_variant_options(name))
            assert dwconv.variant(3) == (dwconv.FAMILIES.index(dwconv.AUTO_VARIANT[3][0]), dwconv.AUTO_VARIANT[3][1])
        for bad in ("t3v4", "t0v2", "tile", "T0V4"):
            with pytest.raises(ValueError, match="depthwise variant"):
                dwconv_variant_options(bad)
    finally:
        options.set_options(**{f: getattr(saved, f) for f in saved.__dataclass_fields__})


def test_model_step_trains_and_infers():
    """The benchmarked step: training updates the parameters and leaves no gradients behind, inference
    changes nothing; a task other than infer / train is refused by name."""
    torch.manual_seed(0)
    step, model = model_step("gspn2_micro", "train", 32, 2, device="cpu")
    assert model.training
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    step, model = model_step("gspn2_micro", "infer", 32, 2, device="cpu")
    assert not model.training
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="`task`"):
        model_step("gspn2_micro", "eval", 32, 2, device="cpu")


def test_inductor_config_items_are_parsed_and_checked():
    from gspn2.benchmark import inductor_config

    got = inductor_config(["combo_kernels=True", "triton.mix_order_reduction_split_size=128"])
    assert got == {"combo_kernels": True, "triton.mix_order_reduction_split_size": 128}
    for bad, match in (("nope=1", "has no 'nope'"), ("triton.nope=1", "has no 'triton.nope'"),
                       ("combo_kernels", "takes KEY=VALUE"), ("combo_kernels=yes", "not a Python literal")):
        with pytest.raises(ValueError, match=match):
            inductor_config([bad])
