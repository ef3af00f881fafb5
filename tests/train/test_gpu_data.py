"""The GPU input path's logic, run on CPU tensors: parameter draws against timm's transforms (same seed,
same draws; many draws, same distributions), pixel ops against PIL, the workers' uint8 crops against
PIL, the loader's interface and determinism, unreadable images (worker decoding and nvJPEG decoding)."""

from __future__ import annotations

import collections
import math
import random
import shutil
import threading

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from timm.data.auto_augment import NAME_TO_OP, RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as tvt

from types import SimpleNamespace

from gspn2.train.config import AugConfig, DataConfig
from gspn2.train.data import (
    build_dataset,
    build_train_loader,
    build_transform,
    posterize_any_bits,
    read_image,
    skipped_images,
)
from gspn2.train.gpu_data import (
    RA_OPS,
    GpuAugment,
    GpuTrainLoader,
    RecipeSampler,
    apply_ra_op,
    build_gpu_train_loader,
    collate_decoded,
    decoded_dataset,
    erase_mask,
    recipe_of,
    resized_crop,
)
from tests.scripts._load import jpeg_folder


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    return jpeg_folder(tmp_path_factory, "gpu_jpegs", classes=2, train_per_class=4)


def _cfg(root="/unused", img_size=48, gpu_decode=False, **aug):
    d = DataConfig(root=str(root), num_classes=2, img_size=img_size, reduced_decode=False,
                   gpu_decode=gpu_decode)
    d = OmegaConf.structured(d)
    a = OmegaConf.structured(AugConfig(**aug))
    return d, a


def _params(raw):
    """The parameters of a raw batch of either decoding path (collate_decoded or collate_raw)."""
    return raw[1] if isinstance(raw[0], torch.Tensor) else raw[2]


def _seed(seed):  # what SeededSamples does before each sample
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)


class _Recorder:
    """timm's training transform, instrumented to record the parameters it draws (its own code runs)."""

    def __init__(self, data, aug):
        self.tf = build_transform(data, aug, is_training=True)
        self.log: dict = {}
        ts = self.tf.transforms
        for k, t in enumerate(ts):
            if isinstance(t, RandomResizedCropAndInterpolation):
                get = t.get_params

                def record_crop(img, scale, ratio, get=get):
                    self.log["crop"] = get(img, scale, ratio)
                    return self.log["crop"]

                t.get_params = record_crop
            elif isinstance(t, (tvt.RandomHorizontalFlip, tvt.RandomVerticalFlip)):
                key = "hflip" if isinstance(t, tvt.RandomHorizontalFlip) else "vflip"

                def record_flip(img, t=t, key=key):
                    out = t(img)
                    self.log[key] = out is not img  # torchvision returns the input itself when not flipping
                    return out

                ts[k] = record_flip
            elif isinstance(t, RandAugment):
                for op in t.ops:
                    fn = op.aug_fn

                    def record_op(img, *args, fn=fn, name=op.name, **kw):
                        self.log["ra"].append((name, float(args[0]) if args else 0.0))
                        return fn(img, *args, **kw)

                    op.aug_fn = record_op
            elif isinstance(t, tvt.ColorJitter):
                get = t.get_params

                def record_jitter(*a, get=get):
                    out = get(*a)
                    self.log["jitter"] = (out[0].tolist(), [None if v is None else float(v) for v in out[1:]])
                    return out

                t.get_params = record_jitter
            elif isinstance(t, RandomErasing):

                def record_erase(x, t=t):
                    before = x.clone()
                    out = t(x)
                    changed = (before != out).any(0)
                    rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
                    self.log["erase"] = (
                        None if rows.numel() == 0
                        else (rows[0].item(), cols[0].item(), rows.numel(), cols.numel())
                    )  # fmt: skip
                    return out

                ts[k] = record_erase

    def __call__(self, img):
        self.log = {"ra": []}
        self.tf(img)
        return self.log


def _mine(sampler, recipe, p):
    ra = [(recipe.ra_ops[k].name, a) for k, a in zip(p["ra_op"].tolist(), p["ra_arg"].tolist()) if k >= 0]
    top, left, h, w = p["erase"][0].tolist() if p["erase"].shape[0] else (0, 0, 0, 0)
    return ra, (None if h == 0 else (top, left, h, w))


@pytest.mark.parametrize("recipe_name", ["imagenet", "jitter"])
def test_same_seed_draws_what_timms_transform_draws(jpeg_root, recipe_name):
    """Per sample seed, the GPU path's parameters equal those timm's CPU transform draws and applies."""
    # the ImageNet recipe (RandAugment, which turns colour jitter off), and jitter + vflip without it
    extra = {} if recipe_name == "imagenet" else dict(auto_augment=None, vflip=0.3, recount=2)
    data, aug = _cfg(**extra)
    recorder = _Recorder(data, aug)
    recipe = recipe_of(data, aug)
    sampler = RecipeSampler(recipe)
    images = [read_image(p) for p in sorted((jpeg_root / "train").rglob("*.JPEG"))]
    seen = collections.Counter()
    for seed in range(120):
        img = images[seed % len(images)]
        _seed(seed)
        ref = recorder(img)
        _seed(seed)
        p = sampler(img.size)
        assert tuple(p["crop"].tolist()) == ref["crop"]
        assert bool(p["flip"][0]) == ref["hflip"]
        ra, erase = _mine(sampler, recipe, p)
        if recipe_name == "imagenet":
            assert [name for name, _ in ra] == [name for name, _ in ref["ra"]]
            assert [arg for _, arg in ra] == pytest.approx([arg for _, arg in ref["ra"]])
            seen["ra"] += len(ra)
        else:
            assert bool(p["flip"][1]) == ref["vflip"]
            order, factors = ref["jitter"]
            assert p["jitter_order"].tolist() == order
            assert p["jitter_factor"][:3].tolist() == pytest.approx(factors[:3]) and factors[3] is None
        if recipe_name == "imagenet":  # one box (recount 1): the recorder sees it exactly
            assert erase == ref["erase"]
        seen["erase"] += erase is not None
    assert seen["erase"] > 10 and (recipe_name != "imagenet" or seen["ra"] > 60)


def test_many_draws_follow_timms_distributions():
    """6000 draws: op frequencies, application rate, magnitudes, crop areas and erasing rates."""
    data, aug = _cfg(img_size=224)
    recipe = recipe_of(data, aug)
    sampler = RecipeSampler(recipe)
    n = 6000
    _seed(123)
    draws = [sampler((500, 375)) for _ in range(n)]
    ops = torch.stack([d["ra_op"] for d in draws])  # (n, 2)
    args = torch.stack([d["ra_arg"] for d in draws])
    applied = ops >= 0
    assert applied.float().mean().item() == pytest.approx(0.5, abs=0.015)  # p=0.5 per layer
    names = [op.name for op in recipe.ra_ops]
    assert len(names) == 15 and "PosterizeIncreasing" in names  # inc1: timm's increasing op set
    counts = torch.bincount(ops[applied], minlength=15).float() / applied.sum()
    assert (counts - 1 / 15).abs().max() < 0.012  # uniform choice of op
    # magnitude ~ N(9, 0.5) clipped to [0, 10]: Rotate's angle is m/10 * 30 with a random sign
    rot = args[ops == names.index("Rotate")].double()
    assert (rot > 0).double().mean().item() == pytest.approx(0.5, abs=0.08)
    assert rot.abs().mean().item() == pytest.approx(27.0 * (1 - 0.0003), abs=0.35)
    assert rot.abs().max().item() <= 30.0 + 1e-9 and rot.abs().std().item() == pytest.approx(1.45, abs=0.2)
    # PosterizeIncreasing keeps 4 - int(4 m / 10) bits: 1 bit; 0 bits when m reaches the cap of 10
    # (P(m >= 10) = 2.3%); 2 bits below m = 7.5 (0.13%)
    post = args[ops == names.index("PosterizeIncreasing")]
    assert set(post.tolist()) <= {0.0, 1.0, 2.0}
    assert 0.005 < (post == 0).double().mean().item() < 0.045
    assert (post == 2).double().mean().item() < 0.01
    # crop areas (fraction of the image) against timm's own draw, quantile by quantile
    crops = torch.stack([d["crop"] for d in draws]).double()
    frac = (crops[:, 2] * crops[:, 3] / (500 * 375)).numpy()
    random.seed(7)
    img = torch.empty(1).expand(375, 500)
    ref = np.array([(lambda b: b[2] * b[3] / (500 * 375))(RandomResizedCropAndInterpolation.get_params(
        img, recipe.scale, recipe.ratio)) for _ in range(n)])
    qs = np.linspace(0.05, 0.95, 19)
    assert np.abs(np.quantile(frac, qs) - np.quantile(ref, qs)).max() < 0.025
    flips = torch.stack([d["flip"] for d in draws]).double()
    assert flips[:, 0].mean().item() == pytest.approx(0.5, abs=0.015) and not flips[:, 1].any()
    erased = torch.stack([d["erase"][0] for d in draws])
    on = erased[:, 2] > 0
    assert on.double().mean().item() == pytest.approx(0.25, abs=0.015)
    area = (erased[on, 2] * erased[on, 3]).double() / (224 * 224)
    assert area.min() >= 0.018 and area.max() <= 1 / 3 + 0.01  # min_area 0.02, max_area 1/3 (rounded sides)
    assert area.mean().item() == pytest.approx((0.02 + 1 / 3) / 2, abs=0.01)


def _natural_image(jpeg_root, size=48):
    img = read_image(sorted((jpeg_root / "train").rglob("*.JPEG"))[0])
    return img.resize((size, size), Image.Resampling.BICUBIC, box=(100, 80, 300, 280))


def _t(img):
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float()


_ARGS = {
    "Rotate": (27.0, -13.0), "ShearX": (0.27, -0.1), "ShearY": (0.2, -0.27), "TranslateXRel": (0.4, -0.2),
    "TranslateYRel": (0.1, -0.4), "Posterize": (0, 1, 4, 8), "Solarize": (0, 100, 256),
    "SolarizeAdd": (0, 99),
    "Color": (0.1, 1.9), "Contrast": (0.1, 1.9), "Brightness": (0.1, 1.9), "Sharpness": (0.1, 1.9),
}  # fmt: skip


@pytest.mark.parametrize("name", RA_OPS)
def test_randaugment_ops_match_pil(jpeg_root, name):
    img = _natural_image(jpeg_root)
    base = name.replace("Increasing", "").replace("Original", "")
    fill = (124, 116, 104)
    for arg in _ARGS.get(base, (0,)):
        if base in ("AutoContrast", "Equalize", "Invert"):
            ref = NAME_TO_OP[name](img)
        else:
            fn = posterize_any_bits if base == "Posterize" else NAME_TO_OP[name]
            ref = fn(img, arg, fillcolor=fill, resample=Image.Resampling.BICUBIC)
        out = apply_ra_op(name, _t(img), torch.tensor([float(arg)]), fill, "bicubic")[0]
        diff = (out - _t(ref)[0]).abs()
        assert torch.equal(out, out.round()) and out.min() >= 0 and out.max() <= 255
        if name in ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"):
            # the same mapping and fill; torch's bicubic kernel (a=-0.75) is not PIL's (a=-0.5)
            assert diff.mean() < 1.0 and diff.max() <= 12, (name, arg, diff.mean(), diff.max())
        else:
            assert diff.max() <= 1 and diff.mean() < 0.05, (name, arg, diff.mean(), diff.max())


def test_crop_flip_and_erasing_geometry_match_the_cpu_ops(jpeg_root):
    full = read_image(sorted((jpeg_root / "train").rglob("*.JPEG"))[1])
    x = torch.from_numpy(np.array(full)).permute(2, 0, 1)
    for box in ((10, 20, 200, 150), (0, 0, full.height, full.width), (50, 60, 30, 40)):  # (i, j, h, w)
        ref = tvt.functional.resized_crop(full, *box, [48, 40], tvt.InterpolationMode.BICUBIC)
        out = resized_crop(x, box, (48, 40), "bicubic")[0]
        diff = (out - _t(ref)[0]).abs()
        assert out.shape == (3, 48, 40) and diff.mean() < 0.6 and diff.max() <= 8, (box, diff.mean())
    data, aug = _cfg(img_size=40)
    gpu = GpuAugment(recipe_of(data, aug), "cpu")
    img = _t(_natural_image(jpeg_root, 40))
    p = {
        "flip": torch.tensor([[True, False], [False, False]]),
        "ra_op": torch.full((2, 2), -1), "ra_arg": torch.zeros(2, 2, dtype=torch.float64),
        "jitter_order": torch.zeros(2, 4, dtype=torch.int64), "jitter_factor": torch.zeros(2, 4),
        "erase": torch.tensor([[[3, 5, 10, 7]], [[0, 0, 0, 0]]]), "noise_seed": torch.tensor([1, 2]),
    }  # fmt: skip
    out = gpu.augment(torch.cat([img, img]), p)
    normalized = (img / 255 - gpu.mean) / gpu.std
    mask = erase_mask(p["erase"], 40, 40)
    assert mask[0, 0].sum() == 70 and mask[0, 0, 3:13, 5:12].all() and not mask[1].any()
    assert torch.allclose(out[0][:, ~mask[0, 0]], normalized.flip(-1)[0][:, ~mask[0, 0]], atol=1e-5)
    assert torch.allclose(out[1], normalized[0], atol=1e-5)  # no flip, no erasing
    noise = out[0][:, mask[0, 0]]
    assert noise.std() > 0.5 and noise.abs().mean() < 1.5  # per-pixel standard normal noise


@pytest.mark.parametrize("gpu_decode,recipe", [(False, "imagenet"), (True, "imagenet"), (False, "jitter")])
def test_gpu_pipeline_on_cpu_tensors_reproduces_the_cpu_pipeline(jpeg_root, gpu_decode, recipe):
    """Same seed, same sample: the GPU path's images are the CPU path's up to interpolation kernels
    (erased samples compared outside the box, whose noise is drawn apart). ``jitter``: colour jitter
    instead of RandAugment."""
    extra = {} if recipe == "imagenet" else dict(auto_augment=None)
    data, aug = _cfg(img_size=48, gpu_decode=gpu_decode, **extra)
    assert (recipe_of(data, aug).jitter is not None) == (recipe == "jitter")
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    cpu = build_train_loader(dataset, 4, 1, 0, seed=3, num_workers=0, pin_memory=False)
    gpu = build_gpu_train_loader(dataset, data, aug, 4, "cpu", 1, 0, seed=3, num_workers=0, pin_memory=False)
    assert isinstance(gpu, GpuTrainLoader) and len(gpu) == len(cpu) == 2 and gpu.generator is not None
    diffs = []
    for epoch in (0, 1):
        cpu.sampler.set_epoch(epoch)
        gpu.sampler.set_epoch(epoch)
        raws = list(gpu.loader)  # the raw batches, to read the erasing boxes
        for (xc, yc), (xg, yg), raw in zip(cpu, gpu, raws):
            assert torch.equal(yc, yg) and xg.shape == xc.shape == (4, 3, 48, 48)
            assert xg.dtype == torch.float32
            keep = ~erase_mask(_params(raw)["erase"], 48, 48).expand_as(xg)
            diffs.append((xc - xg).abs()[keep].mean().item())
    # normalised units (1 level of 0..255 is ~0.017): on average under half a level apart
    assert np.mean(diffs) < 0.02 and max(diffs) < 0.06, diffs


@pytest.mark.parametrize("gpu_decode", [False, True])
def test_gpu_loader_is_deterministic_and_keeps_the_trainer_interface(jpeg_root, gpu_decode):
    data, aug = _cfg(img_size=32, gpu_decode=gpu_decode)
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))

    def epoch(loader, e):
        loader.sampler.set_epoch(e)
        loader.generator.manual_seed(e)
        return [x for x, _ in loader]

    a = build_gpu_train_loader(dataset, data, aug, 4, "cpu", 1, 0, seed=1, num_workers=0, pin_memory=False)
    b = build_gpu_train_loader(dataset, data, aug, 4, "cpu", 1, 0, seed=1, num_workers=2, pin_memory=False,
                               prefetch_factor=2)
    a0, a1, b0, a0_again = epoch(a, 0), epoch(a, 1), epoch(b, 0), epoch(a, 0)
    assert len(a0) == len(b0) == 2 and a0[0].shape == (4, 3, 32, 32)
    assert all(torch.equal(x, y) for x, y in zip(a0, b0))  # worker count does not change the images
    assert all(torch.equal(x, y) for x, y in zip(a0, a0_again))  # the seed and epoch decide them
    assert not torch.equal(a0[0], a1[0])


def test_batches_prepared_ahead_by_a_thread_are_the_same(jpeg_root):
    data, aug = _cfg(img_size=32)
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    args = (dataset, data, aug, 2, "cpu", 1, 0)
    inline = build_gpu_train_loader(*args, seed=4, num_workers=0, pin_memory=False)
    with pytest.raises(ValueError, match="data.gpu_prefetch > 0 needs data.num_workers >= 1"):
        build_gpu_train_loader(*args, seed=4, num_workers=0, pin_memory=False, ahead=2)
    ahead = build_gpu_train_loader(*args, seed=4, num_workers=1, pin_memory=False, ahead=2)
    for loader in (inline, ahead):
        loader.sampler.set_epoch(3)
    pairs = list(zip(inline, ahead))
    assert len(pairs) == 4 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs)
    # an epoch left early stops its thread; the next epoch starts from the beginning
    it = iter(ahead)
    next(it)
    it.close()
    assert not any(t.name == "gpu-data-ahead" and t.is_alive() for t in threading.enumerate())
    assert torch.equal(next(iter(ahead))[0], pairs[0][1][0])
    # an error in the thread reaches the consumer
    ahead.augment.r = None
    with pytest.raises(AttributeError):
        next(iter(ahead))
    with pytest.raises(ValueError, match="data.gpu_prefetch"):
        GpuTrainLoader(ahead.loader, ahead.augment, ahead=-1)


@pytest.mark.parametrize("gpu_decode", [False, True])
def test_unreadable_images_are_skipped_and_counted(jpeg_root, tmp_path, gpu_decode):
    root = tmp_path / "bad"
    shutil.copytree(jpeg_root, root)
    files = sorted((root / "train").rglob("*.JPEG"))
    files[0].write_bytes(b"not an image")  # the worker's header check fails
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[: len(raw) // 3])  # header fine, the data truncated: the decoders fail
    png = files[2].with_suffix(".png")
    Image.open(files[2]).convert("RGB").save(png)  # another format: the worker decodes it
    files[2].unlink()
    data, aug = _cfg(img_size=32, gpu_decode=gpu_decode)
    dataset = build_dataset(root, "train", build_transform(data, aug, is_training=True))
    loader = build_gpu_train_loader(dataset, data, aug, 4, "cpu", 1, 0, seed=0, num_workers=0,
                                    pin_memory=False)
    loader.sampler.set_epoch(0)
    batches = list(loader)
    assert [x.shape[0] for x, _ in batches] == [4, 4] and all(torch.isfinite(x).all() for x, _ in batches)
    skipped = skipped_images(dataset)
    # the PNG is read; the header-less file is caught in the worker, the truncated one by the worker's
    # decoders (worker decoding) or by nvJPEG and PIL (gpu_decode)
    assert sorted(skipped) == [str(files[0]), str(files[1])]
    if not gpu_decode:  # a skipped sample is replaced by the next readable image, as on the CPU path
        paths = [path for raw in loader.loader for path in raw[2]]
        assert len(paths) == 8 and str(png) in paths
        assert set(paths) <= {str(f) for f in (root / "train").rglob("*.*")} - {str(files[0]), str(files[1])}
    with pytest.raises(Exception, match=r"not an image|cannot read image"):
        bad = build_dataset(root, "train", build_transform(data, aug, is_training=True), bad_images="fail")
        fail = build_gpu_train_loader(bad, data, aug, 4, "cpu", 1, 0, seed=0, num_workers=0, pin_memory=False)
        for _ in fail:
            pass


def test_recipes_the_gpu_path_does_not_implement_are_refused():
    with pytest.raises(ValueError, match="aug.train_interpolation"):
        recipe_of(*_cfg(train_interpolation="random"))
    with pytest.raises(ValueError, match="no_aug"):
        recipe_of(*_cfg(no_aug=True))
    with pytest.raises(ValueError, match="RandAugment op 'Desaturate'"):
        recipe_of(*_cfg(auto_augment="rand-m9-t3a"))
    r = recipe_of(*_cfg())
    assert r.jitter is None and r.ra_layers == 2 and r.erasing.per_pixel  # RandAugment turns jitter off
    assert r.mean.tolist() == pytest.approx([0.485, 0.456, 0.406]) and r.ra_fill == (124, 116, 104)
    assert math.isclose(r.ratio[1], 4 / 3) and r.size == (48, 48)


def test_worker_crops_match_pils_resize_of_the_box(jpeg_root):
    """Worker decoding: libjpeg-turbo's decode, then torch's uint8 antialiased resize of the drawn box,
    against Pillow's decode and ``resize(box=...)`` of the same box, and against the crop-then-resize of
    timm's CPU transform (torchvision's ``resized_crop`` on the PIL image).

    Tolerances, from the two resamplers' rounding: against ``resize(box=...)``, at most 2 levels per
    pixel and under 0.1 on average, inside a 3-pixel border (at the border Pillow's kernels read pixels
    outside the box, which a crop does not have); against crop-then-resize, the whole image, at most
    4 levels and under 0.35 on average."""
    for interpolation, resample in (("bicubic", Image.Resampling.BICUBIC),
                                    ("bilinear", Image.Resampling.BILINEAR)):
        data, aug = _cfg(img_size=40, train_interpolation=interpolation)
        recipe = recipe_of(data, aug)
        assert recipe.interpolation == interpolation
        view = decoded_dataset(build_dataset(jpeg_root, "train", None), RecipeSampler(recipe))
        for index in range(len(view)):
            _seed(index)
            (crop, params, path), _ = view[index]
            assert crop.dtype == torch.uint8 and crop.shape == (3, 40, 40)
            i, j, h, w = params["crop"].tolist()
            full = read_image(path)
            boxed = _t(full.resize((40, 40), resample, box=(j, i, j + w, i + h)))[0]
            inner = (crop.int() - boxed.int())[:, 3:-3, 3:-3].abs()
            assert inner.max() <= 2 and inner.float().mean() < 0.1, (path, (i, j, h, w), inner.max())
            cropped = _t(tvt.functional.resized_crop(full, i, j, h, w, [40, 40], tvt.InterpolationMode(
                interpolation)))[0]
            whole = (crop.int() - cropped.int()).abs()
            assert whole.max() <= 4 and whole.float().mean() < 0.35, (path, (i, j, h, w), whole.max())


def test_worker_decoding_draws_what_timms_transform_draws(jpeg_root):
    """The parameters drawn from the worker-decoded image's size are the CPU transform's, seed by seed."""
    data, aug = _cfg()
    recorder = _Recorder(data, aug)
    recipe = recipe_of(data, aug)
    view = decoded_dataset(build_dataset(jpeg_root, "train", None), RecipeSampler(recipe))
    erased = 0
    for seed in range(40):
        index = seed % len(view)
        _seed(seed)
        (_, p, path), _ = view[index]
        _seed(seed)
        ref = recorder(read_image(path))
        assert tuple(p["crop"].tolist()) == ref["crop"] and bool(p["flip"][0]) == ref["hflip"]
        ra, erase = _mine(None, recipe, p)
        assert [name for name, _ in ra] == [name for name, _ in ref["ra"]]
        assert [arg for _, arg in ra] == pytest.approx([arg for _, arg in ref["ra"]])
        assert erase == ref["erase"]
        erased += erase is not None
    assert erased > 3


def test_worker_decoded_batches_reach_the_device_as_uint8_and_only_augment_there(jpeg_root):
    data, aug = _cfg(img_size=32)
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    loader = build_gpu_train_loader(dataset, data, aug, 4, "cpu", 1, 0, seed=2, num_workers=0,
                                    pin_memory=False)
    loader.sampler.set_epoch(0)
    raw = next(iter(loader.loader))
    assert raw[0].dtype == torch.uint8 and raw[0].shape == (4, 3, 32, 32) and raw[3].shape == (4,)
    stages = []
    x, y = loader.augment(raw, mark=stages.append)
    assert stages == ["upload", "augment"] and x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    # the augmentation is the same code as the nvJPEG path's, applied to the workers' crops
    expected = loader.augment.augment(raw[0].float(), raw[1])
    assert torch.equal(x, expected) and torch.equal(y, raw[3])
    nv_data, nv_aug = _cfg(img_size=32, gpu_decode=True)
    nv = build_gpu_train_loader(dataset, nv_data, nv_aug, 4, "cpu", 1, 0, seed=2, num_workers=0,
                                pin_memory=False)
    nv.sampler.set_epoch(0)
    stages.clear()
    nv.augment(next(iter(nv.loader)), mark=stages.append)
    assert stages == ["decode", "crop", "upload", "augment"]
    with pytest.raises(TypeError, match="data.gpu_decode must be true or false, got 'yes'"):
        bad = SimpleNamespace(**{**OmegaConf.to_container(data), "gpu_decode": "yes"})
        build_gpu_train_loader(dataset, bad, aug, 4, "cpu", 1, 0, seed=2, num_workers=0, pin_memory=False)
    assert collate_decoded([((raw[0][k], {"a": torch.tensor(k)}, "p"), 1) for k in range(2)])[0].shape == (
        2, 3, 32, 32)
