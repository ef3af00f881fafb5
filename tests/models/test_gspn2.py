"""GSPN-2 model family: the timm model contract, gradients, resolutions and the global/local scan.

CPU only and small inputs: the CPU op loops over scan steps in Python.
"""

from __future__ import annotations

import io

import pytest
import timm
import torch
from timm.models import group_parameters

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.models import GSPN2, GSPN2Mixer
from gspn2.models.gspn2 import checkpoint_filter_fn
from tests.models._models import BIG_MODELS, MODEL_NAMES, images, micro


def test_registered_names():
    """Every member is registered with its own pretrained config, which reaches the built model."""
    assert set(timm.list_models("gspn2_*")) == set(MODEL_NAMES)
    model = timm.create_model("gspn2_micro")
    assert model.pretrained_cfg == timm.get_pretrained_cfg("gspn2_micro").to_dict()
    assert model.pretrained_cfg["input_size"] != timm.get_pretrained_cfg("gspn2_tiny").input_size


def test_micro_is_micro():
    n = sum(p.numel() for p in micro().parameters())
    assert 100_000 <= n <= 900_000, n


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_finite(name, default_models):
    model = default_models[name]
    size = (32, 32) if name == "gspn2_micro" else (64, 64)
    with torch.no_grad():
        out = model(images(2, *size))
    assert out.shape == (2, 1000)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,size", [("gspn2_micro", (32, 32)), ("gspn2_tiny", (32, 48))])
def test_backward_reaches_every_parameter(name, size):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7, drop_path_rate=0.1).train()
    out = model(images(2, *size))
    out.logsumexp(dim=1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradient for {bad}"
    # The gate logits only reach the loss through the propagation op: a zero gradient means a broken path.
    gen = model.stages[0].blocks[0].mixer.generate.weight.grad
    assert gen.abs().sum() > 0


@pytest.mark.parametrize("name,size", [("gspn2_micro", 64), ("gspn2_tiny", 32)])
def test_features_only(name, size):
    torch.manual_seed(0)
    model = timm.create_model(name, features_only=True, out_indices=(0, 1, 2, 3)).eval()
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    with torch.no_grad():
        feats = model(images(1, size, size))
    assert len(feats) == 4
    for f, stride, chs in zip(feats, model.feature_info.reduction(), model.feature_info.channels()):
        assert f.shape == (1, chs, size // stride, size // stride)
        assert torch.isfinite(f).all()


def test_features_only_subset_and_drop_path():
    model = timm.create_model("gspn2_micro", features_only=True, out_indices=(1, 3), drop_path_rate=0.2).eval()
    assert model.feature_info.reduction() == [8, 32]
    with torch.no_grad():
        feats = model(images(1, 64, 64))
    assert [f.shape[1] for f in feats] == model.feature_info.channels() == [32, 128]


def test_forward_intermediates_matches_features():
    model = micro().eval()
    x = images(1, 48, 40)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
    assert [t.shape[-2:] for t in inter] == [(12, 10), (6, 5), (3, 2), (1, 1)]


def test_prune_intermediate_layers():
    model = micro().eval()
    x = images(1, 32, 32)
    with torch.no_grad():
        full = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        kept = model.prune_intermediate_layers(indices=[0, 1])
        pruned = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        assert kept == [0, 1] and len(model.stages) == 2
        assert all(torch.equal(a, b) for a, b in zip(full, pruned))
        assert torch.equal(model(x), pruned[-1])  # no pooling, no norm, no classifier left


def test_grad_checkpointing_identical():
    model = micro().train()  # no drop path / dropout: train mode is deterministic
    x = images(2, 32, 32)
    ref = model(x)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.set_grad_checkpointing(True)
    assert all(s.grad_checkpointing for s in model.stages)
    out = model(x)
    out.sum().backward()
    assert torch.equal(out, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_state_dict_round_trip():
    model = micro().eval()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(123)
    fresh = timm.create_model("gspn2_micro", num_classes=10).eval()
    x = images(2, 32, 32)
    with torch.no_grad():
        assert not torch.equal(fresh(x), model(x))  # a different init really is different
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        assert torch.equal(fresh(x), model(x))


def test_checkpoint_filter_fn_unwraps_trainer_checkpoints():
    model = micro()
    sd = model.state_dict()
    wrapped = {"model": {f"module._orig_mod.{k}": v for k, v in sd.items()}, "epoch": 3}
    out = checkpoint_filter_fn(wrapped, model)
    assert out.keys() == sd.keys()
    fresh = micro()
    fresh.load_state_dict(out)


@pytest.mark.parametrize("size", [(33, 47), (64, 96), (47, 33)])
def test_odd_and_non_square_sizes(size):
    model = micro().eval()
    with torch.no_grad():
        feats = model.forward_features(images(1, *size))
        out = model.forward_head(feats)
    assert out.shape == (1, 10) and torch.isfinite(out).all()
    assert feats.shape[1] == 128 and feats.shape[-2] >= 1 and feats.shape[-1] >= 1


def test_tiny_non_square(default_models):
    with torch.no_grad():
        out = default_models["gspn2_tiny"](images(1, 33, 47))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_same_model_two_resolutions():
    model = micro().eval()
    with torch.no_grad():
        a = model.forward_features(images(2, 32, 32))
        b = model.forward_features(images(2, 64, 48))
        c = model.forward_features(images(2, 32, 32))
    assert a.shape == (2, 128, 1, 1) and b.shape == (2, 128, 2, 1)
    assert torch.equal(a, c)  # running at another size left no state behind


@pytest.mark.parametrize("size", [(16, 16), (24, 40)])
def test_global_mixer_sees_the_whole_image_local_does_not(size):
    """A change at the top-left pixel reaches the bottom-right pixel through a global scan at any size
    (nothing is sized for 224^2), but not through chunked (local) scans or the 7x7 depthwise conv."""
    H, W = size
    torch.manual_seed(0)
    glob = GSPN2Mixer(8, chunk=None).eval()
    local = GSPN2Mixer(8, chunk=4).eval()
    local.load_state_dict(glob.state_dict())
    x = torch.randn(1, 8, H, W, dtype=torch.float64)
    x2 = x.clone()
    x2[..., 0, 0] += 1.0
    glob.double(), local.double()
    with torch.no_grad():
        g_delta = (glob(x2) - glob(x))[..., H - 1, W - 1].abs().max()
        l_delta = (local(x2) - local(x))[..., H - 1, W - 1].abs().max()
    assert g_delta > 1e-10
    assert l_delta == 0


def test_stage_chunks_reach_the_mixers():
    model = timm.create_model("gspn2_micro", stage_chunks=(4, 2, None, None))
    chunks = [stage.blocks[0].mixer.chunk for stage in model.stages]
    assert chunks == [4, 2, None, None]


def test_reset_classifier_and_pre_logits():
    model = micro().eval()
    x = images(2, 32, 32)
    with torch.no_grad():
        pre = model.forward_head(model.forward_features(x), pre_logits=True)
        assert pre.shape == (2, model.num_features) == (2, 128)
        model.reset_classifier(5)
        assert model.get_classifier().out_features == 5
        assert model(x).shape == (2, 5)
        model.reset_classifier(0)
        assert model(x).shape == (2, 128)
        torch.testing.assert_close(model(x), pre)


def test_group_matcher_and_no_weight_decay():
    model = micro()
    groups = group_parameters(model, model.group_matcher())
    grouped = [n for names in groups.values() for n in names]
    assert sorted(grouped) == sorted(n for n, _ in model.named_parameters())
    nwd = model.no_weight_decay()
    assert nwd and nwd <= {n for n, _ in model.named_parameters()}


def test_bf16_autocast_forward():
    model = micro().eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images(2, 32, 32))
    assert torch.isfinite(out.float()).all()


def test_unknown_constructor_argument_raises():
    with pytest.raises(TypeError):
        timm.create_model("gspn2_micro", not_an_arg=1)
    with pytest.raises(TypeError):
        GSPN2(not_an_arg=1)
    with pytest.raises(TypeError):
        GSPN2Mixer(8, bogus=2)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(stage_chunks=(0, None, None, None)), "stage_chunks[0]"),
        (dict(stage_chunks=(None, None, None)), "stage_chunks"),
        (dict(depths=(1, 1, 1)), "depths"),
        (dict(dims=(16, 32, 0, 128)), "dims[2]"),
        (dict(proxy_dim=3, affinity_groups=2), "affinity_groups"),
        (dict(proxy_dim=0), "proxy_dim"),
        (dict(drop_path_rate=1.5), "drop_path_rate"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=f"`{name}`".replace("[", r"\[").replace("]", r"\]")):
        GSPN2(**{"depths": (1, 1, 1, 1), "dims": (16, 32, 64, 128), **kwargs})


@pytest.mark.parametrize("name", BIG_MODELS)
def test_big_models_no_resolution_state(name, default_models):
    """No module of T/S/B keeps a size-dependent buffer: only parameters and no buffers at all."""
    assert list(default_models[name].buffers()) == []


def test_builds_on_meta_device():
    """Deferred init (``torch.device("meta")``) must work, as for timm's own models."""
    with torch.device("meta"):
        model = timm.create_model("gspn2_tiny", num_classes=10)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_forward_backward_on_meta_device():
    """Shape inference on meta tensors (no data): the training formulation's forward and backward dispatch
    without computing."""
    model = timm.create_model("gspn2_micro", num_classes=10).to("meta")
    x = torch.empty(2, 3, 32, 40, device="meta").requires_grad_()
    y = model(x.contiguous(memory_format=torch.channels_last))
    assert y.shape == (2, 10) and y.device.type == "meta"
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert gx.shape == x.shape
