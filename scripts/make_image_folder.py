"""Write an ImageNet-like JPEG image folder, to measure the data loader and the trainer without ImageNet.

``<root>/train/<class>/*.JPEG`` and ``<root>/val/<class>/*.JPEG``, read by ``train.py`` like ImageNet:

    python scripts/make_image_folder.py data/fake_in1k --classes 1000 --train-per-class 64 --val-per-class 8
    python train.py experiment=in1k_gspn2_tiny data.root=data/fake_in1k

What makes it ImageNet-like (the loader's cost is decoding and resizing, so sizes and bytes matter):

* **image sizes** (:func:`draw_size`): 81% have a long side of 500 px (ImageNet's Flickr downloads), 15%
  are smaller (long side 120-499 px), 4% larger (long side log-uniform in 501-1800 px); the long / short
  side ratio is 4:3 for half of them, 3:2, 1:1, 16:9 or 5:4 for 30%, uniform in 1-16/9 for the rest, in
  landscape four times out of five. The median image is 500x375, the mean 467x393 and 0.20 megapixels
  (ImageNet's train set: median 500x375, mean the commonly quoted 469x387).
* **file sizes**: JPEG quality ``--quality`` (default 92, 4:2:0 chroma, the most common layout of camera
  and Flickr JPEGs) gives 4.3 bits per pixel on this content, so an expected mean file of ~106 KB, near
  ImageNet's ~110 KB (its train set holds ~140 GB in 1.28 M files). The few large images make small sets
  vary: 240 images wrote a mean of 99 KB, another 300 rendered ones 112 KB. Quality 90 gives 3.8 bits
  per pixel, 93 gives 4.6. The summary prints what a run wrote.
* **content** (:func:`render`): a smooth random field summed over octaves (coarse to fine, each weaker,
  mostly luminance), a few class-specific shapes (kind, palette and count depend on the class, so a
  model can learn the classes) and per-pixel noise: not trivially compressible.

Every image depends only on ``(--seed, split, class, index)``: the same arguments write the same bytes
for any ``--workers``. A non-empty ``root`` is refused unless ``--force``, which replaces its ``train/``
and ``val/`` folders (and nothing else).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SPLITS = ("train", "val")
_SPLIT_ID = {"train": 0, "val": 1}
_CLASS_STREAM = 2  # rng stream tag of the per-class style, apart from the per-image streams

# (long / short side, probability) of the aspect ratios; the remainder is uniform in [1, 16/9]
_ASPECTS = ((4 / 3, 0.50), (3 / 2, 0.12), (1.0, 0.08), (16 / 9, 0.05), (5 / 4, 0.05))
_LANDSCAPE = 0.8
_SMALL, _LARGE = 0.15, 0.04  # shares of images with a long side below / above 500 px
_SMALL_RANGE, _LARGE_RANGE = (120, 499), (501, 1800)
_SHAPES = ("ellipse", "rectangle", "polygon", "lines", "ring")


def draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """One ImageNet-like ``(width, height)`` (see the module docstring)."""
    u = rng.random()
    if u < _SMALL:
        long_side = int(rng.integers(_SMALL_RANGE[0], _SMALL_RANGE[1] + 1))
    elif u < _SMALL + _LARGE:
        lo, hi = _LARGE_RANGE
        long_side = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    else:
        long_side = 500
    v, acc, aspect = rng.random(), 0.0, None
    for ratio, p in _ASPECTS:
        acc += p
        if v < acc:
            aspect = ratio
            break
    if aspect is None:
        aspect = rng.uniform(1.0, 16 / 9)
    short_side = max(1, int(round(long_side / aspect)))
    return (long_side, short_side) if rng.random() < _LANDSCAPE else (short_side, long_side)


@dataclass(frozen=True)
class ClassStyle:
    """What all images of a class share: a palette, a shape kind and count, a texture scale, a noise level."""

    palette: tuple[tuple[int, int, int], ...]
    shape: str
    num_shapes: tuple[int, int]  # inclusive range
    cells: int  # coarsest octave of the colour field: cells along the long side
    falloff: float  # amplitude ratio of one octave to the next coarser one
    noise: float  # per-pixel noise, standard deviation in 0..255 units


def class_style(seed: int, index: int) -> ClassStyle:
    rng = np.random.default_rng([seed, _CLASS_STREAM, index])
    palette = tuple(tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(3))
    lo = int(rng.integers(1, 5))
    return ClassStyle(
        palette=palette,
        shape=_SHAPES[index % len(_SHAPES)],
        num_shapes=(lo, lo + int(rng.integers(0, 4))),
        cells=int(rng.integers(2, 7)),
        falloff=float(rng.uniform(0.6, 0.8)),
        noise=float(rng.uniform(10.0, 18.0)),
    )


def _field(rng: np.random.Generator, size: tuple[int, int], style: ClassStyle) -> np.ndarray:
    """Smooth random colour field, float32 (H, W, 3): octaves of bicubically upsampled random grids, each
    three times finer and weaker than the one before (roughly the 1/f spectrum of photographs). Most of
    each octave is a grey (luminance) grid, a third of it colour, as in photographs."""
    w, h = size
    base = np.array(style.palette, dtype=np.float32)
    out = np.empty((h, w, 3), dtype=np.float32)
    out[...] = rng.dirichlet(np.ones(len(base))) @ base
    cells, amplitude = style.cells, 45.0
    while cells <= max(w, h) // 2:
        gw = max(2, round(cells * w / max(w, h)))
        gh = max(2, round(cells * h / max(w, h)))
        grid = rng.normal(0.0, 1.0, (gh, gw, 1)) + rng.normal(0.0, 1 / 3, (gh, gw, 3))
        grid = np.clip(127.5 + 40.0 * grid, 0, 255).astype(np.uint8)
        up = np.asarray(Image.fromarray(grid).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
        out += (up - 127.5) * (amplitude / 40.0)
        cells, amplitude = cells * 3, amplitude * style.falloff
    return out


def _shapes(rng: np.random.Generator, img: Image.Image, style: ClassStyle) -> None:
    w, h = img.size
    draw = ImageDraw.Draw(img)
    scale = min(w, h)
    for _ in range(int(rng.integers(style.num_shapes[0], style.num_shapes[1] + 1))):
        colour = np.array(style.palette[int(rng.integers(len(style.palette)))])
        colour = tuple(int(c) for c in np.clip(colour + rng.normal(0, 20, 3), 0, 255))
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.08, 0.3) * scale
        box = (cx - r, cy - r * rng.uniform(0.5, 1.0), cx + r, cy + r * rng.uniform(0.5, 1.0))
        if style.shape == "ellipse":
            draw.ellipse(box, fill=colour)
        elif style.shape == "rectangle":
            draw.rectangle(box, fill=colour)
        elif style.shape == "polygon":
            n = int(rng.integers(3, 7))
            angles = np.sort(rng.uniform(0, 2 * math.pi, n))
            draw.polygon([(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles], fill=colour)
        elif style.shape == "lines":
            for _ in range(int(rng.integers(3, 8))):
                x0, y0 = cx + rng.uniform(-r, r), cy + rng.uniform(-r, r)
                x1, y1 = cx + rng.uniform(-r, r), cy + rng.uniform(-r, r)
                draw.line((x0, y0, x1, y1), fill=colour, width=max(2, int(r / 8)))
        else:  # ring
            draw.ellipse(box, outline=colour, width=max(1, int(r / 5)))


def render(seed: int, split: str, cls: int, index: int) -> Image.Image:
    """The RGB image ``index`` of class ``cls`` in ``split``; a pure function of its arguments."""
    style = class_style(seed, cls)
    rng = np.random.default_rng([seed, _SPLIT_ID[split], cls, index])
    size = draw_size(rng)
    pixels = _field(rng, size, style)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    _shapes(rng, img, style)
    noise = style.noise * rng.standard_normal(pixels.shape, dtype=np.float32)
    noisy = np.asarray(img, dtype=np.float32) + noise
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def encode(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    # 4:2:0 chroma subsampling, baseline, no optimisation pass: what cameras and Flickr mostly wrote
    img.save(buf, format="JPEG", quality=quality, subsampling="4:2:0")
    return buf.getvalue()


def class_name(cls: int, classes: int) -> str:
    return f"c{cls:0{max(4, len(str(classes - 1)))}d}"


def _write_one(job: tuple[str, str, int, int, int, int, int]) -> tuple[int, int, int]:
    """Render, encode and write one image; returns (bytes, width, height)."""
    root, split, cls, index, classes, seed, quality = job
    img = render(seed, split, cls, index)
    data = encode(img, quality)
    name = class_name(cls, classes)
    path = Path(root) / split / name / f"{name}_{index:06d}.JPEG"
    path.write_bytes(data)
    return len(data), img.width, img.height


@dataclass
class Summary:
    root: str
    images: int
    train_images: int
    val_images: int
    classes: int
    total_bytes: int
    mean_file_bytes: float
    mean_width: float
    mean_height: float
    median_width: float
    median_height: float
    mean_megapixels: float
    quality: int
    seed: int
    seconds: float

    def lines(self) -> str:
        return (
            f"wrote {self.images} JPEGs ({self.train_images} train, {self.val_images} val, "
            f"{self.classes} classes) to {self.root}\n"
            f"total {self.total_bytes / 1e6:.1f} MB, mean file {self.mean_file_bytes / 1e3:.1f} KB, "
            f"mean size {self.mean_width:.0f}x{self.mean_height:.0f} "
            f"(median {self.median_width:.0f}x{self.median_height:.0f}, "
            f"{self.mean_megapixels:.3f} MP), quality {self.quality}, seed {self.seed}, "
            f"{self.seconds:.1f} s"
        )


def _check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def check_root(root: str | os.PathLike, force: bool) -> Path:
    """``root`` as a Path; ValueError if it is a file, or a non-empty folder without ``force``."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"root {str(root)!r} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not force:
        raise ValueError(f"root {str(root)!r} is not empty; pass --force to replace its train/ and val/")
    return root


def make_image_folder(
    root: str | os.PathLike,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    seed: int = 0,
    quality: int = 92,
    workers: int = 1,
    force: bool = False,
) -> Summary:
    """Write the folder (see the module docstring); every argument is checked before anything is written."""
    _check_int("--classes", classes, 1)
    _check_int("--train-per-class", train_per_class, 1)
    _check_int("--val-per-class", val_per_class, 1)  # train.py needs a val/ folder for every class
    _check_int("--seed", seed, 0)
    _check_int("--quality", quality, 1, 100)
    _check_int("--workers", workers, 1)
    if not isinstance(force, bool):
        raise TypeError(f"--force must be a bool, got {type(force).__name__}")
    root = check_root(root, force)

    start = time.perf_counter()
    for split in SPLITS:
        if (root / split).exists():
            shutil.rmtree(root / split)  # force: a smaller set must not keep files of a larger one
        for cls in range(classes):
            (root / split / class_name(cls, classes)).mkdir(parents=True)
    jobs = [
        (str(root), split, cls, i, classes, seed, quality)
        for split, per_class in (("train", train_per_class), ("val", val_per_class))
        for cls in range(classes)
        for i in range(per_class)
    ]
    if workers == 1:
        results = [_write_one(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_write_one, jobs, chunksize=max(1, min(64, len(jobs) // (4 * workers)))))
    nbytes = np.array([r[0] for r in results], dtype=np.int64)
    widths = np.array([r[1] for r in results], dtype=np.float64)
    heights = np.array([r[2] for r in results], dtype=np.float64)
    return Summary(
        root=str(root),
        images=len(results),
        train_images=classes * train_per_class,
        val_images=classes * val_per_class,
        classes=classes,
        total_bytes=int(nbytes.sum()),
        mean_file_bytes=float(nbytes.mean()),
        mean_width=float(widths.mean()),
        mean_height=float(heights.mean()),
        median_width=float(np.median(widths)),
        median_height=float(np.median(heights)),
        mean_megapixels=float((widths * heights).mean() / 1e6),
        quality=quality,
        seed=seed,
        seconds=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> Summary:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="output folder (train/ and val/ are written inside)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--val-per-class", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", type=int, default=92, help="JPEG quality, 1..100")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes")
    parser.add_argument("--force", action="store_true", help="replace train/ and val/ of a non-empty root")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)
    if args.json is not None and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):
        parser.error(f"--json {args.json!r} is a directory or its folder does not exist")
    try:
        summary = make_image_folder(
            args.root,
            classes=args.classes,
            train_per_class=args.train_per_class,
            val_per_class=args.val_per_class,
            seed=args.seed,
            quality=args.quality,
            workers=args.workers,
            force=args.force,
        )
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(summary.lines())
    if args.json is not None:
        Path(args.json).write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
