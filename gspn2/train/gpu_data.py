"""GPU training input (``data.pipeline=gpu``): the workers prepare the crops, the GPU augments.

Worker processes draw each sample's augmentation parameters (:class:`RecipeSampler`) from the sample's
seed (:class:`~gspn2.train.data.SeededSamples`). Where the image is decoded is ``data.gpu_decode``:

* ``false``: each worker decodes its files on the CPU (``torchvision.io.decode_jpeg``, Pillow for what it
  refuses), crops the sample's box and resizes it to the recipe size as uint8 (torch's antialiased
  bicubic or bilinear, like PIL's resize); the batch travels as one uint8 tensor, is copied to the device
  in one transfer, and the device has only the batched augmentations left to do;
* ``true``: the workers read each JPEG's bytes and its header (the size) only; the main process decodes
  the batch with nvJPEG (``torchvision.io.decode_jpeg(list, device="cuda")``) and crops and resizes image
  by image on the device (antialiased like PIL).

The rest of the recipe runs batched on the device either way (:class:`GpuAugment`): flips, RandAugment
(timm's ops), colour jitter, normalisation and random erasing. Mixup/CutMix stay in the trainer, as on
the CPU path.

The recipe is read off the CPU transform that :func:`~gspn2.train.data.build_transform` builds for the same
config, and the parameters are drawn with the same random calls in the same order as timm's transforms
make them, so the same sample seed gives the same crop box, flips, RandAugment ops and magnitudes, colour
jitter factors and erasing boxes on both paths (tested). The pixel operations are written on float
tensors holding 0..255 values, rounded after every op as PIL's 8-bit images are; they run on any device,
so the tests run them on CPU tensors against PIL.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
import queue
import random
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from timm.data.auto_augment import LEVEL_TO_ARG, RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from torchvision import transforms as tvt
from torchvision.io import ImageReadMode, decode_jpeg

from gspn2.train.data import (
    _DECODE_ERRORS,
    CheckedImageFolder,
    ImageError,
    ToNormalizedTensor,
    build_train_loader,
    build_transform,
)

__all__ = [
    "RA_OPS",
    "Recipe",
    "recipe_of",
    "RecipeSampler",
    "GpuAugment",
    "GpuTrainLoader",
    "decode_pixels",
    "crop_resize_uint8",
    "build_gpu_train_loader",
]

#: RandAugment ops the GPU path implements (timm's names), with their pixel functions below
RA_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "PosterizeIncreasing",
    "PosterizeOriginal", "Solarize", "SolarizeIncreasing", "SolarizeAdd", "Color", "ColorIncreasing",
    "Contrast", "ContrastIncreasing", "Brightness", "BrightnessIncreasing", "Sharpness",
    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip
_INTERPOLATIONS = {tvt.InterpolationMode.BICUBIC: "bicubic", tvt.InterpolationMode.BILINEAR: "bilinear"}
_PIL_INTERPOLATIONS = {Image.Resampling.BICUBIC: "bicubic", Image.Resampling.BILINEAR: "bilinear"}


@dataclass
class RaOp:
    name: str
    prob: float
    magnitude: float
    magnitude_std: float
    magnitude_max: float | None
    hparams: dict


@dataclass
class Recipe:
    """The training transform's settings, as :func:`recipe_of` reads them off timm's transform."""

    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    interpolation: str
    hflip: float
    vflip: float
    ra_ops: list[RaOp]
    ra_layers: int
    ra_weights: list[float] | None
    ra_fill: tuple[int, int, int]
    ra_interpolation: str
    jitter: tvt.ColorJitter | None
    mean: torch.Tensor  # per channel, of the 0..1 scale
    std: torch.Tensor
    erasing: RandomErasing | None


def recipe_of(data, aug) -> Recipe:
    """The augmentation recipe of ``build_transform(data, aug, is_training=True)``; a transform the GPU
    path does not implement is a ``ValueError`` naming it (and the config key)."""
    tf = build_transform(_without_reduced_decode(data), aug, is_training=True)
    out = dict(hflip=0.0, vflip=0.0, ra_ops=[], ra_layers=0, ra_weights=None, ra_fill=(128, 128, 128),
               ra_interpolation="bicubic", jitter=None, erasing=None)
    for t in tf.transforms:
        if isinstance(t, RandomResizedCropAndInterpolation):
            if isinstance(t.interpolation, (tuple, list)) or t.interpolation not in _INTERPOLATIONS:
                raise ValueError(
                    f"data.pipeline=gpu implements aug.train_interpolation bicubic or bilinear; "
                    f"got {aug.train_interpolation!r}"
                )
            out.update(size=tuple(t.size), scale=tuple(t.scale), ratio=tuple(t.ratio),
                       interpolation=_INTERPOLATIONS[t.interpolation])
        elif isinstance(t, tvt.RandomHorizontalFlip):
            out["hflip"] = float(t.p)
        elif isinstance(t, tvt.RandomVerticalFlip):
            out["vflip"] = float(t.p)
        elif isinstance(t, RandAugment):
            out["ra_layers"] = t.num_layers
            out["ra_weights"] = None if t.choice_weights is None else list(t.choice_weights)
            for op in t.ops:
                if op.name not in RA_OPS:
                    raise ValueError(
                        f"data.pipeline=gpu does not implement RandAugment op {op.name!r} "
                        f"(aug.auto_augment={aug.auto_augment!r}); it implements {', '.join(RA_OPS)}"
                    )
                out["ra_ops"].append(RaOp(op.name, op.prob, op.magnitude, op.magnitude_std,
                                          op.magnitude_max, op.hparams))
                resample = op.kwargs["resample"]
                if isinstance(resample, (tuple, list)) or resample not in _PIL_INTERPOLATIONS:
                    raise ValueError(
                        f"data.pipeline=gpu: RandAugment interpolation {resample!r} is not implemented"
                    )
                out["ra_interpolation"] = _PIL_INTERPOLATIONS[resample]
                out["ra_fill"] = tuple(int(v) for v in op.kwargs["fillcolor"])
        elif isinstance(t, tvt.ColorJitter):
            if t.hue is not None:
                raise ValueError("data.pipeline=gpu does not implement colour jitter of hue")
            out["jitter"] = t
        elif isinstance(t, ToNormalizedTensor):
            out["mean"] = t.shift.flatten() / (255.0 * t.scale.flatten())
            out["std"] = 1.0 / (255.0 * t.scale.flatten())
        elif isinstance(t, RandomErasing):
            if t.num_splits > 1:
                raise ValueError("data.pipeline=gpu does not implement random erasing with num_splits")
            out["erasing"] = t
        else:
            raise ValueError(
                f"data.pipeline=gpu does not implement the training transform {type(t).__name__} "
                f"(aug.no_aug={aug.no_aug}); use data.pipeline=cpu"
            )
    if "size" not in out:
        raise ValueError("data.pipeline=gpu needs the RandomResizedCrop recipe (aug.no_aug=false)")
    return Recipe(**out)


def _without_reduced_decode(data):
    """``data`` with reduced decoding off: the recipe is read off timm's own crop transform."""
    if isinstance(data, DictConfig):
        data = OmegaConf.to_container(data, resolve=True)
    fields = dict(data) if isinstance(data, dict) else dict(vars(data))
    return SimpleNamespace(**{**fields, "reduced_decode": False})


# ------------------------------------------------------------------------------------- parameter draws


class RecipeSampler:
    """Draws one sample's augmentation parameters with the random calls timm's transforms make, in their
    order: the crop box (``random``, via timm's ``get_params``), the flips (``torch.rand``), RandAugment's
    ops (``np.random.choice``), their application, magnitudes and signs (``random``), colour jitter
    (torchvision's ``get_params``, torch), erasing boxes (``random``). A final draw seeds the erasing noise.
    """

    def __init__(self, recipe: Recipe):
        self.r = recipe
        er = recipe.erasing
        self.max_boxes = er.max_count if er is not None else 0

    def __call__(self, size: tuple[int, int]) -> dict:
        r = self.r
        w, h = size
        # timm's draw reads only the size: a stride-0 tensor of that shape stands in for the image
        crop = RandomResizedCropAndInterpolation.get_params(torch.empty(1).expand(h, w), r.scale, r.ratio)
        hflip = bool(torch.rand(1) < r.hflip) if r.hflip > 0 else False
        vflip = bool(torch.rand(1) < r.vflip) if r.vflip > 0 else False
        ra_op = [-1] * r.ra_layers
        ra_arg = [0.0] * r.ra_layers
        if r.ra_layers:
            chosen = np.random.choice(
                len(r.ra_ops), r.ra_layers, replace=r.ra_weights is None, p=r.ra_weights
            )
            for layer, k in enumerate(chosen.tolist()):
                op = r.ra_ops[k]
                if op.prob < 1.0 and random.random() > op.prob:
                    continue
                magnitude = op.magnitude
                if op.magnitude_std == float("inf"):
                    magnitude = random.uniform(0, magnitude)
                elif op.magnitude_std > 0:
                    magnitude = random.gauss(magnitude, op.magnitude_std)
                magnitude = max(0.0, min(magnitude, op.magnitude_max or 10.0))
                level_fn = LEVEL_TO_ARG[op.name]
                args = level_fn(magnitude, op.hparams) if level_fn is not None else ()
                ra_op[layer] = k
                ra_arg[layer] = float(args[0]) if args else 0.0
        order = [0, 1, 2, 3]
        factors = [math.nan] * 4
        if r.jitter is not None:
            j = r.jitter
            fn_idx, b, c, s, hue = tvt.ColorJitter.get_params(j.brightness, j.contrast, j.saturation, j.hue)
            order = fn_idx.tolist()
            factors = [math.nan if v is None else float(v) for v in (b, c, s, hue)]
        boxes = [[0, 0, 0, 0] for _ in range(self.max_boxes)]
        if r.erasing is not None:
            boxes = self._erasing_boxes(*r.size)
        return {
            "crop": torch.tensor(crop, dtype=torch.int64),
            "flip": torch.tensor([hflip, vflip]),
            "ra_op": torch.tensor(ra_op, dtype=torch.int64),
            "ra_arg": torch.tensor(ra_arg, dtype=torch.float64),
            "jitter_order": torch.tensor(order, dtype=torch.int64),
            "jitter_factor": torch.tensor(factors, dtype=torch.float64),
            "erase": torch.tensor(boxes, dtype=torch.int64).view(self.max_boxes, 4),
            "noise_seed": torch.tensor(random.getrandbits(62), dtype=torch.int64),
        }

    def _erasing_boxes(self, img_h: int, img_w: int) -> list[list[int]]:
        """``(top, left, h, w)`` per box, ``h = 0`` for none: timm's ``RandomErasing._erase`` draws."""
        er = self.r.erasing
        boxes = [[0, 0, 0, 0] for _ in range(self.max_boxes)]
        if random.random() > er.probability:
            return boxes
        area = img_h * img_w
        count = er.min_count if er.min_count == er.max_count else random.randint(er.min_count, er.max_count)
        for n in range(count):
            for _ in range(10):
                target = random.uniform(er.min_area, er.max_area) * area / count
                aspect = math.exp(random.uniform(*er.log_aspect_ratio))
                h = int(round(math.sqrt(target * aspect)))
                w = int(round(math.sqrt(target / aspect)))
                if w < img_w and h < img_h:
                    top = random.randint(0, img_h - h)
                    left = random.randint(0, img_w - w)
                    boxes[n] = [top, left, h, w]
                    break
        return boxes


# ------------------------------------------------------------------------------------------ the workers


def _rgb_pixels(img: Image.Image) -> torch.Tensor:
    """A PIL image as an RGB ``CHW`` uint8 tensor."""
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


def _is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() > 2 and int(data[0]) == 0xFF and int(data[1]) == 0xD8  # the SOI marker


def decode_pixels(data: torch.Tensor, path, device="cpu") -> torch.Tensor:
    """A file's bytes (a 1-d uint8 tensor) decoded to an RGB ``CHW`` uint8 tensor on ``device``:
    ``torchvision.io.decode_jpeg`` (libjpeg-turbo on the CPU, nvJPEG on a GPU), Pillow for other formats
    and for the JPEGs the decoder refuses. :class:`ImageError` names a file that neither reads."""
    if _is_jpeg(data):
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            pass  # a JPEG variant or damage the decoder refuses: Pillow reads it or names the error
    try:
        img = Image.open(io.BytesIO(data.numpy().tobytes()))
        img.load()
        return _rgb_pixels(img).to(device)
    except _DECODE_ERRORS as e:
        raise ImageError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e


def read_encoded(path: str):
    """A file's bytes and size. JPEGs in RGB or grey stay encoded (``(bytes, False, size)``); other files
    (PNG, CMYK JPEG, ...) are decoded here to an RGB ``CHW`` uint8 tensor (``(pixels, True, size)``), the
    GPU decoder taking baseline and progressive JPEGs only. :class:`ImageError` names an unreadable file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        img = Image.open(io.BytesIO(raw))
        size = img.size
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8), False, size, path
        img.load()
        return _rgb_pixels(img), True, size, path
    except _DECODE_ERRORS as e:
        raise ImageError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e


def read_decoded(path: str):
    """A file decoded on the CPU (:func:`decode_pixels`): ``(pixels, path)``; :class:`ImageError` names an
    unreadable file, so :class:`~gspn2.train.data.CheckedImageFolder` applies ``data.bad_images``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ImageError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e
    return decode_pixels(torch.frombuffer(bytearray(raw), dtype=torch.uint8), path), path


class _DrawParams:
    """The dataset transform of nvJPEG decoding: keeps the data, adds the sample's parameters."""

    def __init__(self, sampler: RecipeSampler):
        self.sampler = sampler

    def __call__(self, item):
        data, decoded, size, path = item
        return data, decoded, self.sampler(size), path


class _DrawAndCrop:
    """The dataset transform of worker decoding: the sample's parameters, drawn from the decoded size,
    and its crop box resized to the recipe size (``(3, H, W)`` uint8)."""

    def __init__(self, sampler: RecipeSampler):
        self.sampler = sampler

    def __call__(self, item):
        pixels, path = item
        params = self.sampler((pixels.shape[-1], pixels.shape[-2]))  # (w, h), as PIL's size
        r = self.sampler.r
        return crop_resize_uint8(pixels, params["crop"].tolist(), r.size, r.interpolation), params, path


def _view(dataset: Dataset, loader, transform) -> Dataset:
    """``dataset`` (from :func:`~gspn2.train.data.build_dataset`) reading its files with ``loader`` and
    ``transform``; it shares the files, the subset and the skipped-image flags (so
    :func:`~gspn2.train.data.skipped_images` of ``dataset`` reports what this one skipped)."""
    if isinstance(dataset, Subset):
        view = Subset(_view(dataset.dataset, loader, transform), dataset.indices)
        view.classes = getattr(dataset, "classes", None)  # type: ignore[attr-defined]
        return view
    if not isinstance(dataset, CheckedImageFolder):
        raise TypeError(f"expected a dataset of build_dataset, got {type(dataset).__name__}")
    view = copy.copy(dataset)  # same samples list, same shared-memory skipped flags
    view.loader = loader
    view.transform = transform
    return view


def raw_dataset(dataset: Dataset, sampler: RecipeSampler) -> Dataset:
    """A view of ``dataset`` for nvJPEG decoding (``data.gpu_decode=true``) that yields
    ``((data, decoded, params, path), label)`` (see :func:`_view`)."""
    return _view(dataset, read_encoded, _DrawParams(sampler))


def decoded_dataset(dataset: Dataset, sampler: RecipeSampler) -> Dataset:
    """A view of ``dataset`` for worker decoding (``data.gpu_decode=false``) that yields
    ``((crop, params, path), label)``, ``crop`` a ``(3, H, W)`` uint8 tensor (see :func:`_view`)."""
    return _view(dataset, read_decoded, _DrawAndCrop(sampler))


def collate_raw(batch):
    """Variable-size data stay a list; parameters are stacked per key."""
    items, labels = zip(*batch)
    datas, decoded, params, paths = zip(*items)
    stacked = {k: torch.stack([p[k] for p in params]) for k in params[0]}
    return list(datas), torch.tensor(decoded), stacked, list(paths), torch.tensor(labels, dtype=torch.int64)


def collate_decoded(batch):
    """The crops stacked into one ``(B, 3, H, W)`` uint8 tensor, the parameters per key."""
    items, labels = zip(*batch)
    crops, params, paths = zip(*items)
    stacked = {k: torch.stack([p[k] for p in params]) for k in params[0]}
    # default_collate stacks straight into shared memory in a worker: the batch is not copied again
    # on its way to the main process
    return default_collate(list(crops)), stacked, list(paths), torch.tensor(labels, dtype=torch.int64)


# ------------------------------------------------------------------------------------ the pixel operations
# Images are float (B, 3, H, W) tensors of 0..255 values; every op returns rounded, clamped values.


def _q(x: torch.Tensor) -> torch.Tensor:
    return x.round_().clamp_(0, 255)


def _blend(degenerate: torch.Tensor, img: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.blend(degenerate, img, factor)``: ``deg + factor (img - deg)``, truncated to 0..255."""
    out = degenerate + factor.view(-1, 1, 1, 1) * (img - degenerate)
    return out.clamp_(0, 255).floor_()


def grey(x: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L: ``(19595 R + 38470 G + 7471 B + 2**15) >> 16`` (ITU-R 601-2 luma)."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    return torch.floor((r * 19595 + g * 38470 + b * 7471 + 32768) / 65536)


def op_invert(x, arg):
    return 255 - x


def op_posterize(x, bits):
    shift = (8 - bits.clamp(0, 8)).view(-1, 1, 1, 1)
    step = torch.pow(2.0, shift)
    return torch.floor(x / step) * step


def op_solarize(x, thresh):
    return torch.where(x < thresh.view(-1, 1, 1, 1), x, 255 - x)


def op_solarize_add(x, add, thresh=128):
    return torch.where(x < thresh, (x + add.view(-1, 1, 1, 1)).clamp(max=255), x)


def op_brightness(x, factor):
    return _blend(torch.zeros_like(x), x, factor)


def op_color(x, factor):
    return _blend(grey(x).expand_as(x), x, factor)


def op_contrast(x, factor):
    mean = torch.floor(grey(x).mean(dim=(1, 2, 3), keepdim=True) + 0.5)
    return _blend(mean.expand_as(x), x, factor)


def op_sharpness(x, factor):
    """PIL's Sharpness: blend with ``filter(SMOOTH)`` (3x3 kernel 1 1 1 / 1 5 1 / 1 1 1, / 13, rounded;
    border pixels kept)."""
    kernel = torch.ones(3, 1, 3, 3, dtype=x.dtype, device=x.device)
    kernel[:, :, 1, 1] = 5
    smooth = F.conv2d(x, kernel / 13, groups=3)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = _q(smooth)
    return _blend(degenerate, x, factor)


def op_autocontrast(x, arg):
    """PIL's ``ImageOps.autocontrast`` (no cutoff): per channel, ``lo..hi`` stretched to ``0..255`` and
    truncated; a flat channel stays as it is."""
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    flat = hi <= lo
    scale = 255.0 / torch.where(flat, torch.ones_like(hi), hi - lo)
    out = torch.floor(x * scale - lo * scale).clamp_(0, 255)
    return torch.where(flat, x, out)


def op_equalize(x, arg):
    """PIL's ``ImageOps.equalize``: per channel, ``lut[i] = (step // 2 + #pixels below i) // step`` with
    ``step = (#pixels - #pixels at the top value) // 255``; identity when ``step`` is 0."""
    b, c, h, w = x.shape
    flat = x.reshape(b * c, h * w).long()
    hist = torch.zeros(b * c, 256, dtype=torch.int64, device=x.device)
    hist.scatter_add_(1, flat, torch.ones_like(flat))
    top = flat.amax(dim=1, keepdim=True)
    step = (h * w - hist.gather(1, top)) // 255  # (b*c, 1)
    below = torch.cumsum(hist, dim=1) - hist
    lut = torch.div(step // 2 + below, step.clamp(min=1), rounding_mode="floor").clamp(max=255)
    identity = torch.arange(256, device=x.device).expand(b * c, 256)
    lut = torch.where(step > 0, lut, identity)
    return lut.gather(1, flat).view(b, c, h, w).to(x.dtype)


# Device constants are made once per (value, dtype, device): a fresh host-to-device copy of pageable memory
# per batch would make the host thread wait for the GPU.


@functools.cache
def _fill_tensor(fill: tuple, dtype, device) -> torch.Tensor:
    """``fill`` as a (1, 3, 1, 1) tensor on ``device``."""
    return torch.tensor(fill, dtype=dtype).view(1, 3, 1, 1).to(device)


@functools.cache
def _centres(h: int, w: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output pixel centres ``gx, gy`` (each ``(h, w)``) and ``(w, h)`` as a (1, 2, 1, 1) tensor."""
    ys = torch.arange(h, dtype=dtype, device=device) + 0.5
    xs = torch.arange(w, dtype=dtype, device=device) + 0.5
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    size = torch.stack((torch.full((), w, dtype=dtype, device=device),
                        torch.full((), h, dtype=dtype, device=device))).view(1, 2, 1, 1)
    return gx, gy, size


def _affine(x, matrix, fill, mode):
    """PIL's ``transform(AFFINE)``: output pixel centre ``(x + .5, y + .5)`` samples the input at
    ``matrix @ (x + .5, y + .5, 1)``; centres that land outside the input get ``fill``.

    ``matrix``: (B, 2, 3) in pixels."""
    b, _, h, w = x.shape
    gx, gy, size = _centres(h, w, x.dtype, x.device)
    m = matrix.to(x.dtype).view(b, 2, 3, 1, 1)
    uv = m[:, :, 0] * gx + m[:, :, 1] * gy + m[:, :, 2]  # (B, 2, h, w): u (input x), v (input y)
    inside = ((uv >= 0) & (uv < size)).all(dim=1, keepdim=True)
    grid = (2 * uv / size - 1).permute(0, 2, 3, 1)
    out = F.grid_sample(x, grid, mode=mode, padding_mode="border", align_corners=False)
    return _q(torch.where(inside, out, _fill_tensor(tuple(fill), x.dtype, x.device)))


def _affine_matrix(name, arg, w, h):
    """The (B, 2, 3) output-to-input matrices timm's geometric ops pass to PIL (float64)."""
    a = arg.double()
    one, zero = torch.ones_like(a), torch.zeros_like(a)
    if name == "ShearX":
        rows = (one, a, zero, zero, one, zero)
    elif name == "ShearY":
        rows = (one, zero, zero, a, one, zero)
    elif name == "TranslateXRel":
        rows = (one, zero, a * w, zero, one, zero)
    elif name == "TranslateYRel":
        rows = (one, zero, zero, zero, one, a * h)
    elif name == "Rotate":  # PIL's rotate about the centre, counter-clockwise by `arg` degrees
        angle = -torch.deg2rad(a % 360.0)
        cos, sin = torch.cos(angle), torch.sin(angle)
        cx, cy = w / 2.0, h / 2.0
        rows = (cos, sin, cos * -cx + sin * -cy + cx, -sin, cos, -sin * -cx + cos * -cy + cy)
    else:
        raise ValueError(f"not a geometric op: {name}")
    return torch.stack(rows, dim=-1).view(-1, 2, 3)


_PIXEL_OPS = {
    "AutoContrast": op_autocontrast,
    "Equalize": op_equalize,
    "Invert": op_invert,
    "Posterize": op_posterize,
    "PosterizeIncreasing": op_posterize,
    "PosterizeOriginal": op_posterize,
    "Solarize": op_solarize,
    "SolarizeIncreasing": op_solarize,
    "SolarizeAdd": op_solarize_add,
    "Color": op_color,
    "ColorIncreasing": op_color,
    "Contrast": op_contrast,
    "ContrastIncreasing": op_contrast,
    "Brightness": op_brightness,
    "BrightnessIncreasing": op_brightness,
    "Sharpness": op_sharpness,
    "SharpnessIncreasing": op_sharpness,
}
_GEOMETRIC_OPS = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")


#: torchvision's ColorJitter functions timm's recipe can draw, by their index in ``get_params``' order
_JITTER_OPS = {0: op_brightness, 1: op_contrast, 2: op_color}


def apply_ra_op(name: str, x: torch.Tensor, arg: torch.Tensor, fill=(128, 128, 128), mode="bicubic"):
    """timm's RandAugment op ``name`` on a batch ``x`` (0..255 floats), one argument per image."""
    if name in _GEOMETRIC_OPS:
        return _affine(x, _affine_matrix(name, arg, x.shape[-1], x.shape[-2]), fill, mode)
    return _PIXEL_OPS[name](x, arg.to(x.dtype))


def _box(img: torch.Tensor, box) -> torch.Tensor:
    i, j, h, w = box
    return img[None, :, i : i + h, j : j + w]


def resized_crop(img: torch.Tensor, box, size, mode: str) -> torch.Tensor:
    """One ``(3, H, W)`` uint8 image cropped to ``box = (i, j, h, w)`` and resized to ``size`` like PIL's
    resize (antialiased when shrinking); ``(1, 3, *size)`` of 0..255 float values, rounded."""
    out = F.interpolate(_box(img, box).float(), size=size, mode=mode, antialias=True, align_corners=False)
    return _q(out)


def crop_resize_uint8(img: torch.Tensor, box, size, mode: str) -> torch.Tensor:
    """:func:`resized_crop` kept in uint8 (torch's uint8 kernels, CPU tensors): ``(3, *size)`` uint8."""
    return F.interpolate(_box(img, box), size=size, mode=mode, antialias=True, align_corners=False)[0]


def erase_mask(boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``(B, 1, h, w)`` bool: inside any of each image's ``(top, left, bh, bw)`` boxes."""
    ys = torch.arange(h, device=boxes.device).view(1, 1, h, 1)
    xs = torch.arange(w, device=boxes.device).view(1, 1, 1, w)
    top, left = boxes[..., 0, None, None], boxes[..., 1, None, None]
    bh, bw = boxes[..., 2, None, None], boxes[..., 3, None, None]
    inside = (ys >= top) & (ys < top + bh) & (xs >= left) & (xs < left + bw)
    return inside.any(dim=1, keepdim=True)


# ------------------------------------------------------------------------------------------ the batch


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait (pinned, non-blocking on CUDA)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class GpuAugment:
    """Applies the recipe to a batch of the workers on ``device``: ``(images, targets)`` on ``device``,
    images normalised float32 ``(B, 3, H, W)``.

    ``gpu_decode=False``: the batch holds the workers' uint8 crops (:func:`collate_decoded`), copied to the
    device in one transfer; ``True``: it holds encoded JPEGs (:func:`collate_raw`), decoded with nvJPEG and
    cropped here first."""

    def __init__(self, recipe: Recipe, device, bad_images: str = "skip", on_skip=None,
                 gpu_decode: bool = False):
        self.r = recipe
        self.device = torch.device(device)
        self.bad_images = bad_images
        self.on_skip = on_skip  # called with the path of an image the decoders could not read
        self.gpu_decode = gpu_decode
        self.mean = recipe.mean.to(self.device).view(1, 3, 1, 1)
        self.std = recipe.std.to(self.device).view(1, 3, 1, 1)

    def decode(self, datas, decoded, paths) -> list[torch.Tensor | None]:
        """``(3, h, w)`` uint8 images on the device; ``None`` for an image neither nvJPEG nor PIL reads."""
        out: list[torch.Tensor | None] = [None] * len(datas)
        jpegs = [k for k in range(len(datas)) if not decoded[k]]
        for k in range(len(datas)):
            if decoded[k]:
                out[k] = datas[k].to(self.device, non_blocking=True)
        if jpegs:
            try:
                images = decode_jpeg([datas[k] for k in jpegs], mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError:
                images = [self._decode_one(datas[k], paths[k]) for k in jpegs]
            for k, img in zip(jpegs, images):
                out[k] = img
        return out

    def _decode_one(self, data, path):
        try:
            return decode_pixels(data, path, self.device)
        except ImageError:
            if self.bad_images == "fail":
                raise
            if self.on_skip is not None:
                self.on_skip(path)
            return None

    def crop(self, images: list[torch.Tensor | None], crops: list, paths) -> torch.Tensor:
        """The decoded images' boxes resized to the recipe size: ``(B, 3, H, W)`` 0..255 floats."""
        readable = [k for k, img in enumerate(images) if img is not None]
        if not readable:
            raise ImageError(f"no image of the batch can be decoded: {paths}")
        r = self.r
        # an image no decoder reads (data.bad_images=skip) takes the pixels of a readable one of its batch
        return torch.cat([
            resized_crop(images[k] if images[k] is not None else images[readable[0]],
                         crops[k] if images[k] is not None else crops[readable[0]], r.size, r.interpolation)
            for k in range(len(images))
        ])  # fmt: skip

    def __call__(self, batch, mark=None):
        """The batch's images and targets on the device. ``mark``, if given, is called with the name of
        each stage once its work is queued ("decode", "crop" with nvJPEG; "upload", "augment"): the
        loader benchmark times the stages with it."""
        if self.gpu_decode:
            datas, decoded, params, paths, labels = batch
            images = self.decode(datas, decoded, paths)
            if mark is not None:
                mark("decode")
            x = self.crop(images, params["crop"].tolist(), paths)
            if mark is not None:
                mark("crop")
        else:
            crops, params, paths, labels = batch
            x = crops.to(self.device, non_blocking=True).float()
        p = {k: v.to(self.device, non_blocking=True) for k, v in params.items()}
        y = labels.to(self.device, non_blocking=True)
        if mark is not None:
            mark("upload")
        x = self.augment(x, p, host=params)
        if mark is not None:
            mark("augment")
        return x, y

    def augment(self, x: torch.Tensor, p: dict, host: dict | None = None) -> torch.Tensor:
        """Everything after the crop, on a (B, 3, H, W) batch of 0..255 floats: flips, RandAugment,
        colour jitter, normalisation, erasing. ``p``: the parameters on ``x``'s device; ``host``: the
        same on the CPU, which decide which images each op takes (no device-to-host syncs)."""
        r = self.r
        host = p if host is None else host
        flip = p["flip"]
        x = torch.where(flip[:, 0].view(-1, 1, 1, 1), x.flip(-1), x)
        x = torch.where(flip[:, 1].view(-1, 1, 1, 1), x.flip(-2), x)
        for kind, layer, k, idx, matrix in self.steps(host, x.shape[-2], x.shape[-1], x.device):
            if kind == "ra":
                x[idx] = apply_ra_op(r.ra_ops[k].name, x[idx], p["ra_arg"][idx, layer],
                                     r.ra_fill, r.ra_interpolation)
            elif kind == "affine":  # every geometric op of the layer in one sampling pass
                x[idx] = _affine(x[idx], matrix, r.ra_fill, r.ra_interpolation)
            else:  # colour jitter, in each image's drawn order: brightness (0), contrast (1), saturation (2)
                x[idx] = _JITTER_OPS[k](x[idx], p["jitter_factor"][idx, k].to(x.dtype))
        x = (x / 255.0 - self.mean) / self.std
        if r.erasing is not None:
            x = self.erase(x, p["erase"], int(host["noise_seed"].sum()) % (2**62))
        return x

    def steps(self, host: dict, h: int, w: int, device) -> list:
        """The batch's RandAugment and colour-jitter steps in the order they run, as ``(kind, layer or
        position, op, image indices, affine matrices or None)``; kind ``ra`` (a pixel op), ``affine``
        (all of a layer's geometric ops: an image takes one op per layer, so they are disjoint) or
        ``jitter`` (torchvision's ColorJitter as timm applies it, to PIL images, hence PIL's
        ImageEnhance; hue is refused by :func:`recipe_of`).

        Everything is read off the host copy of the parameters and sent in one non-blocking transfer
        per dtype (from pinned memory on CUDA), so that queueing the batch's work never waits for the GPU."""
        r = self.r
        keys, parts, matrices = [], [], []
        for layer in range(r.ra_layers):
            ops = host["ra_op"][:, layer]
            geometric = []
            for k in torch.unique(ops).tolist():
                if k < 0:
                    continue
                idx = (ops == k).nonzero().flatten()
                name = r.ra_ops[k].name
                if name in _GEOMETRIC_OPS:
                    geometric.append(idx)
                    matrices.append(_affine_matrix(name, host["ra_arg"][idx, layer], w, h))
                else:
                    keys.append(("ra", layer, k))
                    parts.append(idx)
            if geometric:
                keys.append(("affine", layer, -1))
                parts.append(torch.cat(geometric))
        if r.jitter is not None:
            order, factor = host["jitter_order"], host["jitter_factor"]
            for pos in range(order.shape[1]):
                for k in _JITTER_OPS:
                    idx = ((order[:, pos] == k) & ~torch.isnan(factor[:, k])).nonzero().flatten()
                    if idx.numel():
                        keys.append(("jitter", pos, k))
                        parts.append(idx)
        if not parts:
            return []
        flat = _to_device(torch.cat(parts), device)
        mats = _to_device(torch.cat(matrices), device) if matrices else None
        out, start, m_start = [], 0, 0
        for (kind, layer, k), part in zip(keys, parts):
            n = part.numel()
            matrix = None
            if kind == "affine":
                matrix, m_start = mats[m_start : m_start + n], m_start + n
            out.append((kind, layer, k, flat[start : start + n], matrix))
            start += n
        return out

    def erase(self, x, boxes, noise_seed):
        """timm's RandomErasing on normalised images: the boxes get standard-normal noise per pixel
        (``pixel``), per channel (``rand``) or zeros (``const``)."""
        er = self.r.erasing
        b, c, h, w = x.shape
        masks = [erase_mask(boxes[:, n : n + 1], h, w) for n in range(boxes.shape[1])]
        if not masks:
            return x
        g = torch.Generator(device=x.device)
        g.manual_seed(noise_seed)
        for n, mask in enumerate(masks):
            if er.per_pixel:
                fill = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
            elif er.rand_color:
                fill = torch.randn((b, c, 1, 1), generator=g, device=x.device, dtype=x.dtype)
            else:
                fill = torch.zeros((1, 1, 1, 1), device=x.device, dtype=x.dtype)
            x = torch.where(mask, fill, x)
        return x


# ------------------------------------------------------------------------------------------ the loader


class GpuTrainLoader:
    """The training loader of the GPU path: iterating yields ``(images, targets)`` already on the device.

    Keeps the DataLoader interface the trainer uses: ``len()`` (batches per epoch), ``.sampler``
    (``set_epoch``), ``.generator`` and ``.dataset``.

    With ``ahead > 0`` a background thread decodes and augments up to ``ahead`` batches ahead of the
    consumer, on its own CUDA stream (on a CUDA device), so that work overlaps the training step; the
    consumer's stream waits for each batch's work before using it. The batches are the same either way.
    """

    def __init__(self, loader: DataLoader, augment: GpuAugment, ahead: int = 0):
        if ahead < 0:
            raise ValueError(f"data.gpu_prefetch must be >= 0, got {ahead!r}")
        self.loader = loader
        self.augment = augment
        self.ahead = ahead

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def generator(self):
        return self.loader.generator

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self):
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        if self.ahead == 0:
            for batch in self.loader:
                yield self.augment(batch)
            return
        yield from _Ahead(self.loader, self.augment, self.ahead)


class _Ahead:
    """One epoch of :class:`GpuTrainLoader` prepared by a background thread (see there)."""

    _END = object()

    def __init__(self, loader, augment: GpuAugment, ahead: int):
        device = augment.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(loader, augment), daemon=True,
                                       name="gpu-data-ahead")
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, loader, augment):
        try:
            ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
            with ctx:
                for batch in loader:
                    x, y = augment(batch)
                    event = None
                    if self.stream is not None:
                        event = torch.cuda.Event()
                        event.record(self.stream)
                    if not self._put((x, y, event)):
                        return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer, which raises it in the training loop
            self._put(e)

    def __iter__(self):
        try:
            while True:
                item = self.queue.get()
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                x, y, event = item
                if event is not None:
                    current = torch.cuda.current_stream(x.device)
                    current.wait_event(event)
                    x.record_stream(current)  # allocated on the side stream, used on this one
                    y.record_stream(current)
                yield x, y
        finally:  # an epoch left early (a step limit, an error) stops the thread
            self.stop.set()
            self.thread.join()


def build_gpu_train_loader(dataset: Dataset, data, aug, batch_size: int, device, world_size: int, rank: int,
                           seed: int, num_workers: int, pin_memory: bool, repeats: int = 1,
                           persistent_workers: bool = True, prefetch_factor: int = 2,
                           ahead: int = 0) -> GpuTrainLoader:
    """The GPU-path loader over ``dataset`` (from :func:`~gspn2.train.data.build_dataset`): same order,
    same per-sample seeds as :func:`~gspn2.train.data.build_train_loader`; ``data.gpu_decode`` chooses
    where the images are decoded (the workers, or nvJPEG on the device); ``ahead``: batches a
    background thread prepares in advance (``data.gpu_prefetch``)."""
    gpu_decode = getattr(data, "gpu_decode", False)
    if not isinstance(gpu_decode, bool):
        raise TypeError(f"data.gpu_decode must be true or false, got {gpu_decode!r}")
    if ahead > 0 and num_workers == 0:
        # the thread would run the samples' seeded draws (SeededSamples saves, reseeds and restores the
        # process-wide random state) while the training loop draws from that state too
        raise ValueError("data.gpu_prefetch > 0 needs data.num_workers >= 1")
    recipe = recipe_of(data, aug)
    sampler = RecipeSampler(recipe)
    view = raw_dataset(dataset, sampler) if gpu_decode else decoded_dataset(dataset, sampler)
    base = view
    while isinstance(base, Subset):
        base = base.dataset
    loader = build_train_loader(
        view, batch_size, world_size, rank, seed, num_workers, pin_memory, repeats=repeats,
        persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
        collate_fn=collate_raw if gpu_decode else collate_decoded,
    )

    def on_skip(path):  # rare: a search over the file list beats holding a path -> index map for ImageNet
        base.skipped[next(i for i, (p, _) in enumerate(base.samples) if p == path)] = True

    augment = GpuAugment(recipe, device, base.bad_images, on_skip, gpu_decode=gpu_decode)
    return GpuTrainLoader(loader, augment, ahead=ahead)
