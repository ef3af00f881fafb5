"""The CPU training loader: reduced-size JPEG decoding, fused tensor conversion, per-sample seeds,
worker count and persistence."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image, ImageOps
from timm.data.auto_augment import AugmentOp
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as tvt

from gspn2.train.config import AugConfig, ConfigError, DataConfig, check_train_config
from gspn2.train.data import (
    ReducedDecodeRandomResizedCrop,
    ToNormalizedTensor,
    build_dataset,
    build_train_loader,
    build_transform,
    default_num_workers,
    posterize_any_bits,
    read_image,
    reduction_factor,
    resolve_num_workers,
)
from tests.scripts._load import jpeg_folder
from tests.train._helpers import compose_cfg


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    return jpeg_folder(tmp_path_factory, "jpegs", classes=2, train_per_class=4)


def _files(root):
    return sorted(str(p) for p in (root / "train").rglob("*.JPEG"))


def _cfg(root, img_size=64, **data):
    d = OmegaConf.structured(DataConfig(root=str(root), num_classes=2, img_size=img_size, **data))
    return d, OmegaConf.structured(AugConfig())


def test_reduction_factor_never_upsamples_more_than_the_full_decode():
    assert reduction_factor(448, 448, 224, 224) == 2
    assert reduction_factor(447, 1000, 224, 224) == 1  # 1/2 would leave 223.5 rows for 224
    assert reduction_factor(900, 1000, 224, 224) == 4
    assert reduction_factor(1800, 1792, 224, 224) == 8
    assert reduction_factor(100, 100, 224, 224) == 1  # already upsampling: decoded at full size
    for h in range(100, 2000, 37):
        for w in range(100, 2000, 41):
            f = reduction_factor(h, w, 224, 160)
            assert f in (1, 2, 4, 8)
            assert f == 1 or (h / f >= 224 and w / f >= 160)  # reduced: still a downscale
            assert f == 8 or h / (2 * f) < 224 or w / (2 * f) < 160  # the largest such factor


def test_reduced_decode_draws_timms_crop_boxes_and_stays_close_to_the_full_decode(jpeg_root):
    # 64 px output so that most crops of these ~470x390 images allow a 1/2 or 1/4 decode
    size, scale, ratio = (64, 64), (0.08, 1.0), (3 / 4, 4 / 3)
    mine = ReducedDecodeRandomResizedCrop(size, scale, ratio, tvt.InterpolationMode.BICUBIC)
    timm = RandomResizedCropAndInterpolation(size, scale, ratio, interpolation="bicubic")
    factors, to_full, to_two_step = [], [], []
    for seed, path in enumerate(_files(jpeg_root) * 4):
        random.seed(seed)
        out = mine(path)
        factor, (i, j, h, w) = mine.last
        full = read_image(path)
        random.seed(seed)
        assert RandomResizedCropAndInterpolation.get_params(full, scale, ratio) == (i, j, h, w)
        random.seed(seed)
        ref = timm(full)  # the same draw again, applied to the full decode
        assert out.size == ref.size == (64, 64) and out.mode == "RGB"
        out = np.asarray(out, dtype=np.float64)
        diff = np.abs(out - np.asarray(ref, dtype=np.float64)).mean()
        factors.append(factor)
        if factor == 1:  # full-size decode: the same pixels but for the filter support at the crop's edges
            assert diff < 1.0, (path, diff)
            continue
        to_full.append(diff)
        # the same box on the full decode shrunk by `factor` first: what the reduced decode approximates
        small = full.reduce(factor)
        sx, sy = small.width / full.width, small.height / full.height
        box = (j * sx, i * sy, (j + w) * sx, (i + h) * sy)
        two_step = small.resize((64, 64), Image.Resampling.BICUBIC, box=box)
        to_two_step.append(np.abs(out - np.asarray(two_step, dtype=np.float64)).mean())
    assert {1, 2, 4} <= set(factors), factors
    # the DCT-domain shrink is a box-like prefilter: within a level of shrinking the decoded image, and
    # a level or two (on 0..255) from the one-step resize of the full decode; a box mapped wrongly onto
    # the reduced image misses by tens of levels
    assert max(to_two_step) < 1.5, to_two_step
    assert np.mean(to_full) < 3.0 and max(to_full) < 12.0, to_full


def test_reduced_decode_is_what_the_training_transform_uses(jpeg_root):
    d, a = _cfg(jpeg_root, reduced_decode=True)
    tf = build_transform(d, a, is_training=True)
    assert isinstance(tf.transforms[0], ReducedDecodeRandomResizedCrop) and tf.reads_paths
    dataset = build_dataset(jpeg_root, "train", tf)
    image, label = dataset[0]
    assert image.shape == (3, 64, 64) and label == 0
    d.reduced_decode = False
    first = build_transform(d, a, is_training=True).transforms[0]
    assert isinstance(first, RandomResizedCropAndInterpolation)


def test_fused_tensor_conversion_matches_to_tensor_and_normalize(jpeg_root):
    img = read_image(_files(jpeg_root)[0])
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ref = tvt.Normalize(mean, std)(tvt.functional.to_tensor(img))
    out = ToNormalizedTensor(mean, std)(img)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-5


def test_posterize_keeps_zero_bits_as_black():
    img = Image.fromarray((np.arange(256 * 3).reshape(16, 16, 3) * 7 % 256).astype(np.uint8))
    for bits in range(1, 9):
        ours, pils = posterize_any_bits(img, bits), ImageOps.posterize(img, bits)
        assert np.array_equal(np.asarray(ours), np.asarray(pils))
    assert not np.asarray(posterize_any_bits(img, 0)).any()
    with pytest.raises(ValueError, match="bits_to_keep"):
        posterize_any_bits(img, 9)
    # the recipe's PosterizeIncreasing at the magnitude cap (10) keeps 0 bits: timm's op with Pillow's
    # posterize raises there, the training transform's op gives black
    d, a = _cfg("/unused", img_size=32)
    ra = next(t for t in build_transform(d, a, is_training=True).transforms if hasattr(t, "ops"))
    op = next(o for o in ra.ops if o.name == "PosterizeIncreasing")
    assert op.aug_fn is posterize_any_bits
    capped = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    capped.aug_fn = op.aug_fn
    assert not np.asarray(capped(img)).any()


def _batches(loader, epochs):
    out = []
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        loader.generator.manual_seed(1000 + epoch)  # as the trainer does; must not change the images
        out.append([(x.clone(), y.clone()) for x, y in loader])
    return out


def test_loader_is_deterministic_per_epoch_for_any_worker_count(jpeg_root):
    d, a = _cfg(jpeg_root, img_size=32)
    dataset = build_dataset(jpeg_root, "train", build_transform(d, a, is_training=True))
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    in_main = _batches(build_train_loader(dataset, 4, 1, 0, seed=5, num_workers=0, pin_memory=False), [0, 1])
    # num_workers=0 augments in this process: the trainer's own random streams are left as they were
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
    assert torch.equal(torch.get_rng_state(), state[2])
    persistent = build_train_loader(dataset, 4, 1, 0, seed=5, num_workers=2, pin_memory=False,
                                    prefetch_factor=2)
    assert persistent.persistent_workers and persistent.prefetch_factor == 2
    in_workers = _batches(persistent, [0, 1])
    for epoch in range(2):
        assert len(in_main[epoch]) == len(in_workers[epoch]) == 2
        for (x0, y0), (x1, y1) in zip(in_main[epoch], in_workers[epoch]):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(in_main[0][0][0], in_main[1][0][0])  # a new epoch, new augmentations
    # a fresh loader started at epoch 1 (a resume) sees exactly epoch 1 of the run above
    resumed = _batches(build_train_loader(dataset, 4, 1, 0, seed=5, num_workers=0, pin_memory=False), [1])[0]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, in_main[1]))


def test_two_processes_augment_like_one(jpeg_root):
    d, a = _cfg(jpeg_root, img_size=32)
    dataset = build_dataset(jpeg_root, "train", build_transform(d, a, is_training=True))
    (one,) = _batches(build_train_loader(dataset, 4, 1, 0, seed=2, num_workers=0, pin_memory=False), [0])
    ranks = [_batches(build_train_loader(dataset, 2, 2, r, seed=2, num_workers=0, pin_memory=False), [0])[0]
             for r in range(2)]
    for step, (x, _) in enumerate(one):
        assert torch.equal(x, torch.cat([ranks[0][step][0], ranks[1][step][0]]))


def test_num_workers_default_to_the_cpus_per_local_process(monkeypatch):
    import os

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_num_workers() == resolve_num_workers(None) == resolve_num_workers("auto") == max(1, cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cpus))
    assert resolve_num_workers(None) == 1
    assert resolve_num_workers(3) == 3 and resolve_num_workers(0) == 0
    for bad in (-1, 2.5, "four", True):
        with pytest.raises(ValueError, match="data.num_workers"):
            resolve_num_workers(bad)


def test_loader_keys_compose_and_are_checked():
    cfg = compose_cfg(["experiment=in1k_gspn2_tiny", "data.root=/x"])
    assert cfg.data.num_workers is None and cfg.data.pipeline == "gpu" and cfg.data.reduced_decode
    assert cfg.data.persistent_workers and cfg.data.prefetch_factor == 2 and cfg.data.gpu_prefetch == 2
    check_train_config(cfg, check_paths=False)
    imagenet = ["experiment=in1k_gspn2_tiny", "data.root=/x"]
    with pytest.raises(ConfigError, match=r"data.pipeline must be one of cpu \| gpu; got 'dali'"):
        check_train_config(compose_cfg([*imagenet, "data.pipeline=dali"]), check_paths=False)
    with pytest.raises(ConfigError, match="data.prefetch_factor must be >= 1"):
        check_train_config(compose_cfg([*imagenet, "data.prefetch_factor=0"]), check_paths=False)
    with pytest.raises(ConfigError, match="data.gpu_prefetch must be >= 0"):
        check_train_config(compose_cfg([*imagenet, "data.gpu_prefetch=-1"]), check_paths=False)
    with pytest.raises(ConfigError, match="data.gpu_prefetch > 0 needs data.num_workers >= 1"):
        check_train_config(compose_cfg([*imagenet, "data.pipeline=gpu", "data.num_workers=0"]), check_paths=False)
    check_train_config(
        compose_cfg([*imagenet, "data.pipeline=gpu", "data.num_workers=0", "data.gpu_prefetch=0"]), check_paths=False
    )



def test_gpu_decode_is_a_checked_bool_off_by_default():
    imagenet = ["experiment=in1k_gspn2_tiny", "data.root=/x"]
    cfg = compose_cfg(imagenet)
    assert cfg.data.gpu_decode is False
    assert compose_cfg([*imagenet, "data.pipeline=gpu", "data.gpu_decode=true"]).data.gpu_decode is True
    with pytest.raises(Exception, match=r"override data\.gpu_decode=maybe") as info:
        compose_cfg([*imagenet, "data.gpu_decode=maybe"])
    assert "'maybe' is not a valid bool" in str(info.value.__cause__)
    # a config assembled without the schema (its types unchecked) still meets the value check
    loose = OmegaConf.create(OmegaConf.to_container(cfg))
    loose.data.gpu_decode = "yes"
    with pytest.raises(ConfigError, match="data.gpu_decode must be true or false; got 'yes'"):
        check_train_config(loose, check_paths=False)
