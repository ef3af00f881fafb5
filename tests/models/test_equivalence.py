"""The GSPN-2 blocks compute the function of their module-by-module oracle (tests/models/_reference.py).

The oracle holds the model's state dict in plain ``nn.Conv2d`` 1x1 convolutions, timm's ``LayerNorm2d``
and ``Mlp``, autograd saving every intermediate. Both get the same weights and inputs; outputs, input
gradients and every parameter gradient must agree:

* fp32: to 1e-5 of the largest magnitude of each tensor (the two only differ in summation order);
* bf16 autocast: the model's error against the fp32 oracle must be at most twice the oracle's own bf16
  error plus 1e-2 (flash-attn's rule; both round to bf16 at different places).

Plus the state dict layout (a checkpoint of the model loads into the oracle and the other way), the
saved-activation count per block (the estimate in docs/models.md) and ``torch.compile(fullgraph=True)``
tracing of the training formulation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Tuple

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.models import GSPN2Block
from gspn2.ops import options
from tests.models._models import MODEL_NAMES, images, micro
from tests.models._reference import assert_bf16_close, assert_same, reference, run

def _pair(build: Callable[[], torch.nn.Module]) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """(model, oracle) with the same weights; ``build()`` returns a gspn2 module."""
    torch.manual_seed(0)
    model = build()
    return model, reference(model)


def _block(**kwargs) -> GSPN2Block:
    block = GSPN2Block(16, ls_init_value=0.5, **kwargs)
    with torch.no_grad():  # non-trivial norms, skip and layer scale (init is ones/zeros)
        for name, p in block.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "skip", "gamma")):
                p.mul_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(("norm1.bias", "norm2.bias", "norm.bias")):
                p.add_(0.1 * torch.randn_like(p))
    return block


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(proxy_dim=4, affinity_groups=2, chunk=5, drop_path=0.5)],
    ids=["default", "P4-K2-local-droppath"],
)
def test_block_fp32(kwargs, channels_last, train):
    model, ref = _pair(lambda: _block(**kwargs))
    x = images(2, 13, 17, channels=16, channels_last=channels_last)
    assert_same(run(model, x, train, bf16=False), run(ref, x, train, bf16=False), rtol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_model_fp32(channels_last):
    """Whole model: stem, downsampling and head norms too; train mode with drop path."""
    model, ref = _pair(lambda: micro(drop_path_rate=0.2))
    x = images(2, 37, 45, channels_last=channels_last)
    assert_same(run(model, x, True, bf16=False), run(ref, x, True, bf16=False), rtol=1e-5)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_block_bf16_autocast(channels_last, train):
    model, ref = _pair(_block)
    x = images(2, 13, 17, channels=16, channels_last=channels_last)
    exact = run(ref, x, train, bf16=False)
    assert_bf16_close(run(model, x, train, bf16=True), run(ref, x, train, bf16=True), exact)


def test_model_bf16_autocast():
    model, ref = _pair(micro)
    x = images(2, 37, 45, channels_last=True)
    exact = run(ref, x, True, bf16=False)
    assert_bf16_close(run(model, x, True, bf16=True), run(ref, x, True, bf16=True), exact)


def test_comparison_catches_a_small_change():
    """The fp32 check is sharp: a 1e-3 change of one per-channel scale fails it."""
    model, ref = _pair(_block)
    with torch.no_grad():
        model.mixer.skip[0] *= 1 + 1e-3
    x = images(2, 13, 17, channels=16, channels_last=True)
    with pytest.raises(AssertionError, match="differs from the oracle"):
        assert_same(run(model, x, True, bf16=False), run(ref, x, True, bf16=False), rtol=1e-5)


# ---- state dict layout ----

#: Keys and shapes of ``timm.create_model("gspn2_micro").state_dict()``: the checkpoint layout that every
#: saved gspn2_micro has; the other members differ only in depths and widths.
MICRO_STATE_DICT = Path(__file__).parent / "data" / "gspn2_micro_state_dict.json"


def test_checkpoint_layout_is_kept():
    """The model's state dict has the recorded keys, order and shapes, and a state dict of that layout
    loads strictly into it."""
    layout = json.loads(MICRO_STATE_DICT.read_text())
    model = timm.create_model("gspn2_micro")
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == layout
    assert list(model.state_dict()) == list(layout)
    g = torch.Generator().manual_seed(0)
    saved = {k: torch.randn(shape, generator=g) for k, shape in layout.items()}
    model.load_state_dict(saved, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_oracle_has_the_same_parameters(name):
    """Every registered member: the oracle (parameter shapes from plain torch/timm constructors) takes the
    model's state dict strictly, and the parameter counts agree."""
    with torch.device("meta"):  # shapes only: building GSPN-2-B on CPU takes seconds
        model = timm.create_model(name)
        ref = reference(model)
    layout = [(k, v.shape) for k, v in model.state_dict().items()]
    assert [(k, v.shape) for k, v in ref.state_dict().items()] == layout
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in model.parameters())


# ---- saved activations (docs/models.md, "Speed") ----


def _saved_bytes_per_pixel(block: torch.nn.Module, bf16: bool) -> float:
    """Bytes autograd keeps for backward per pixel, from two input sizes (the difference drops the
    weights and their autocast copies, which do not grow with the image)."""

    def saved_bytes(H: int, W: int) -> int:
        storages = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        # Under autocast the activations reaching a block are bf16 (the stem's norm keeps its conv's dtype).
        x = images(1, H, W, channels=16, channels_last=True).to(torch.bfloat16 if bf16 else torch.float32)
        x.requires_grad_()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            block(x)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    return (saved_bytes(16, 24) - saved_bytes(8, 12)) / (16 * 24 - 8 * 12)


def test_saved_activations_per_block():
    """Elements saved per pixel, C channels, E = 1.5 C, MLP hidden 4C, P proxy channels, K groups:

    model:  4 C + 4 C + 5 E + (22 P + 24 K) + 3 x 2 fp32 LayerNorm statistics
    oracle: 6 C + 8 C + 8 E + (26 P + 24 K) + 3 x 2

    The model keeps, per block: the inputs of the two LPU convolutions and of the two block norms
    (4 C; the norms' outputs are recomputed, norm_linear), the MLP's pre-activation (4 C), and in the
    mixer v before and after its depthwise convolution, the SiLU's output, y and z (5 E; the mixer
    norm's output is recomputed too).
    """
    C, E, P, K = 16, 24, 2, 1
    model, ref = _pair(lambda: GSPN2Block(C))
    model.train(), ref.train()
    assert _saved_bytes_per_pixel(model, bf16=False) == 4 * (8 * C + 5 * E + 22 * P + 24 * K + 6)
    assert _saved_bytes_per_pixel(ref, bf16=False) == 4 * (14 * C + 8 * E + 26 * P + 24 * K + 6)
    # bf16 autocast: every activation in bf16 (2 bytes). CPU's layer_norm keeps its statistics in the
    # input dtype too; CUDA's keeps them in fp32 (12 bytes per pixel more).
    assert _saved_bytes_per_pixel(model, bf16=True) == 2 * (8 * C + 5 * E + 22 * P + 24 * K + 6)


# ---- torch.compile of the training formulation ----


def test_compile_fullgraph_traces_the_block():
    """Dynamo + AOT autograd capture the training formulation in one graph (autograd functions, autocast
    switches); the aot_eager backend keeps the test fast, the GPU test compiles the whole model with
    inductor."""
    torch.manual_seed(0)
    model = GSPN2Block(8).train()
    x = images(1, 5, 7, channels=8, channels_last=True).requires_grad_()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    x2 = x.detach().clone(memory_format=torch.channels_last).requires_grad_()
    torch.testing.assert_close(out, model(x2))
    model(x2).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.detach().to(torch.bfloat16)
        torch.testing.assert_close(compiled(xb), model(xb))


@pytest.mark.parametrize("merge,mlp", [("auto", "auto"), ("fused", "auto"), ("auto", "fused")])
def test_compile_fullgraph_under_autocast_training(merge, mlp):
    """The autocast queries of the training formulation (LayerNorm dtype, the recomputing functions'
    backward) trace without a graph break under autocast, forward and backward (Dynamo of torch 2.11 broke
    the graph at ``torch.amp.is_autocast_available`` in every LayerNorm); with either formulation of the
    mixer's output chain (option ``merge``) and of the MLP's second GEMM (option ``mlp``)."""
    with options.override(merge=merge, mlp=mlp):
        _compile_under_autocast()


def _compile_under_autocast():
    torch.manual_seed(0)
    model = GSPN2Block(8).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = images(1, 5, 7, channels=8, channels_last=True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        ref = model(x)
    torch.testing.assert_close(out, ref)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (grad_ref,) = torch.autograd.grad(ref.float().sum(), x)
    # The compiled norms of bf16 rows apply their float32 parameters unrounded (gspn2.layers.layer_norm_rows);
    # ATen's eager norm on the CPU takes them rounded to bf16: equal to bf16 accuracy.
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-2 * grad_ref.abs().max().item())


# ---- the mixer's output chain as one op (option merge="fused") ----


@pytest.fixture
def fused_merge():
    with options.override(merge="fused"):
        yield


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_block_fused_merge_fp32_and_bf16(fused_merge, train):
    """``merge="fused"`` (gspn2.ops.merge_norm_gate in the training mixer) computes the oracle's function."""
    model, ref = _pair(_block)
    x = images(2, 13, 17, channels=16, channels_last=True)
    assert_same(run(model, x, train, bf16=False), run(ref, x, train, bf16=False), rtol=1e-5)
    exact = run(ref, x, train, bf16=False)
    assert_bf16_close(run(model, x, train, bf16=True), run(ref, x, train, bf16=True), exact)


def test_fused_merge_runs_the_op_and_saves_as_much(fused_merge):
    """The training mixer calls the op once per block, and keeps as many activations: out_proj's input in
    place of the merged ``y``; the op's statistics are float32 on every device (CPU's layer_norm keeps the
    block norms' in the input dtype under bf16 autocast)."""
    C, E, P, K = 16, 24, 2, 1
    model, _ = _pair(lambda: GSPN2Block(C))
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(images(1, 8, 12, channels=C, channels_last=True)).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.gspn2.merge_norm_gate] == 2 * 8 * 12 * 4 * P * E
    assert _saved_bytes_per_pixel(model, bf16=False) == 4 * (8 * C + 5 * E + 22 * P + 24 * K + 6)
    assert _saved_bytes_per_pixel(model, bf16=True) == 2 * (8 * C + 5 * E + 22 * P + 24 * K + 4) + 8



# ---- the MLP's GELU and second GEMM as one op (option mlp="fused") ----


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_block_fused_mlp_fp32_and_bf16(train):
    """``mlp="fused"`` (gspn2.ops.gelu_linear in the training MLP) computes the oracle's function."""
    with options.override(mlp="fused"):
        model, ref = _pair(_block)
        x = images(2, 13, 17, channels=16, channels_last=True)
        assert_same(run(model, x, train, bf16=False), run(ref, x, train, bf16=False), rtol=1e-5)
        exact = run(ref, x, train, bf16=False)
        assert_bf16_close(run(model, x, train, bf16=True), run(ref, x, train, bf16=True), exact)


def test_fused_mlp_runs_the_op_and_saves_as_much():
    """The training MLP calls the op once per block (the MLP's second GEMM, 4C inputs per output) and keeps
    as many activations as the separate formulation: the pre-activation only."""
    C = 16
    model, _ = _pair(lambda: GSPN2Block(C))
    model.train()
    saved = {bf16: _saved_bytes_per_pixel(model, bf16=bf16) for bf16 in (False, True)}
    with options.override(mlp="fused"):
        with FlopCounterMode(display=False) as counter:
            model(images(1, 8, 12, channels=C, channels_last=True)).sum().backward()
        counts = counter.get_flop_counts()["Global"]
        assert counts[torch.ops.gspn2.gelu_linear] == 2 * 8 * 12 * 4 * C * C
        assert counts[torch.ops.gspn2.gelu_linear_backward] == 4 * 8 * 12 * 4 * C * C
        for bf16 in (False, True):
            assert _saved_bytes_per_pixel(model, bf16=bf16) == saved[bf16]
