"""Image-folder data: the embedded digits set, transforms, datasets, samplers and loaders.

Training and evaluation read ``<root>/<split>/<class>/<image>`` folders through torchvision's
``ImageFolder`` and timm's ``create_transform``, for ImageNet and for the embedded digits alike.

An image that can not be decoded raises :class:`ImageError` naming the file. Under the ``skip`` policy
(``data.bad_images``) it is left out instead and counted: a training sample is replaced by the next
readable image of the folder (batches keep their size), a validation sample is dropped from the batch
(the metrics cover the readable images). :func:`skipped_images` lists what an epoch skipped and
:func:`verify_images` decodes every file once, up front.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from timm.data.auto_augment import RandAugment
from timm.data.transforms import MaybeToTensor, RandomResizedCropAndInterpolation
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate, get_worker_info
from torchvision import transforms as tvt
from torchvision.datasets import ImageFolder

from gspn2.train.checkpoint import umask_mode

__all__ = [
    "DataError",
    "ImageError",
    "BAD_IMAGE_POLICIES",
    "read_image",
    "CheckedImageFolder",
    "skipped_images",
    "reset_skipped",
    "verify_images",
    "write_digits",
    "check_classes",
    "check_image_folder",
    "build_transform",
    "build_dataset",
    "ShardedBatchSampler",
    "SeededSamples",
    "ReducedDecodeRandomResizedCrop",
    "default_num_workers",
    "resolve_num_workers",
    "build_train_loader",
    "train_loader_from_config",
    "build_eval_loader",
    "steps_per_epoch",
]

DIGITS_SIZE = 32  # the 8x8 digits are upscaled to this size on disk
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
_SUBSET_SEED = 0


#: ``data.bad_images`` values: stop at the first unreadable image, or leave it out and count it.
BAD_IMAGE_POLICIES = ("fail", "skip")


class DataError(RuntimeError):
    """The data folder is missing or malformed."""


class ImageError(DataError):
    """An image file can not be read or decoded; the message names the file."""


# what PIL's decoders raise on damaged, truncated or foreign files (besides OSError for unreadable ones)
_DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    Image.DecompressionBombError,
)


def read_image(path: str | os.PathLike) -> Image.Image:
    """Decode ``path`` completely into an RGB image; :class:`ImageError` names the file on any failure."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            img.load()  # decode now: a truncated file fails here, at its name, not in a later transform
            return img.convert("RGB")
    except _DECODE_ERRORS as e:
        raise ImageError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e


def _path_of(path: str) -> str:
    return path


def _collate_readable(batch):
    """Collate the samples of a batch that were readable (``None`` marks a skipped one); a batch with
    none left becomes two empty tensors, which :func:`~gspn2.train.evaluate.evaluate` passes over."""
    kept = [sample for sample in batch if sample is not None]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return default_collate(kept)


class CheckedImageFolder(ImageFolder):
    """``ImageFolder`` whose unreadable images follow a policy instead of crashing anonymously.

    Args:
        bad_images: ``"fail"`` raises :class:`ImageError` naming the file; ``"skip"`` flags it and
            returns the next readable image of the folder (``replace=True``, training) or ``None``
            (``replace=False``, evaluation, for :func:`_collate_readable`).

    The flags live in shared memory, so DataLoader worker processes report into the main process.
    """

    def __init__(self, root: str, transform, bad_images: str = "skip", replace: bool = True):
        if bad_images not in BAD_IMAGE_POLICIES:
            raise ValueError(f"data.bad_images must be one of {BAD_IMAGE_POLICIES}, got {bad_images!r}")
        # a transform that decodes by itself (reduced-size JPEG decoding) is given the file's path
        loader = _path_of if getattr(transform, "reads_paths", False) else read_image
        super().__init__(root, transform=transform, loader=loader)
        self.bad_images = bad_images
        self.replace = replace
        self.skipped = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()

    def __getitem__(self, index: int):
        try:
            return super().__getitem__(index)
        except ImageError:
            if self.bad_images == "fail":
                raise
            self.skipped[index] = True
        if not self.replace:
            return None
        n = len(self.samples)
        for k in range(1, n):
            j = (index + k) % n
            if self.skipped[j]:
                continue
            try:
                return super().__getitem__(j)
            except ImageError:
                self.skipped[j] = True
        raise ImageError(f"no image under {self.root!r} can be read (data.bad_images=skip has nothing left)")


def _base_folder(dataset: Dataset) -> CheckedImageFolder:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if not isinstance(dataset, CheckedImageFolder):
        raise TypeError(f"expected a dataset of build_dataset, got {type(dataset).__name__}")
    return dataset


def skipped_images(dataset: Dataset) -> list[str]:
    """The files that ``dataset`` (from :func:`build_dataset`) skipped since the last reset."""
    base = _base_folder(dataset)
    return [base.samples[i][0] for i in base.skipped.nonzero().flatten().tolist()]


def reset_skipped(dataset: Dataset) -> None:
    _base_folder(dataset).skipped.zero_()


def _files_of(dataset: Dataset) -> list[str]:
    indices = None
    while isinstance(dataset, Subset):
        indices = list(dataset.indices) if indices is None else [dataset.indices[i] for i in indices]
        dataset = dataset.dataset
    paths = [path for path, _ in dataset.samples]
    return paths if indices is None else [paths[i] for i in indices]


def _decode_error(path: str) -> str | None:
    try:
        read_image(path)
    except ImageError as e:
        return str(e)
    return None


def verify_images(
    datasets: Sequence[Dataset], rank: int = 0, world_size: int = 1, threads: int | None = None
) -> list[str]:
    """Decode every file the ``datasets`` read (this rank's share: every ``world_size``-th file) once,
    on ``threads`` threads (default: the CPU cores of this process's share of the node; Pillow decodes
    without holding the GIL). Returns one :class:`ImageError` message per unreadable file."""
    files = sorted({path for dataset in datasets for path in _files_of(dataset)})[rank::world_size]
    if threads is None:
        cores = len(os.sched_getaffinity(0))
        threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [msg for msg in pool.map(_decode_error, files) if msg is not None]


def write_digits(root: str | os.PathLike, size: int = DIGITS_SIZE) -> Path:
    """Write scikit-learn's UCI handwritten digits to ``root`` as a PNG image folder, once.

    1797 8x8 grey images (values 0..16) become ``size x size`` RGB PNGs, white strokes on black, in
    ``root/train/<digit>/`` and ``root/val/<digit>/`` (a stratified 80/20 split with a fixed seed, so
    every machine writes the same files). The folder is assembled next to ``root`` and renamed into
    place, so concurrent writers (DDP ranks, parallel tests) never see a half-written set.

    Returns:
        ``Path(root)``; an existing ``root`` is left untouched.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = Path(root)
    if root.exists():
        return root
    digits = load_digits()
    images = digits.images  # (1797, 8, 8) float in [0, 16]
    labels = digits.target
    idx_train, idx_val = train_test_split(
        np.arange(len(labels)),
        test_size=DIGITS_VAL_FRACTION,
        random_state=DIGITS_SPLIT_SEED,
        stratify=labels,
    )
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    os.chmod(tmp, umask_mode(0o777))  # mkdtemp's 0700 would hide the data from the user's group
    try:
        for split, indices in (("train", idx_train), ("val", idx_val)):
            for i in sorted(indices):
                folder = tmp / split / str(labels[i])
                folder.mkdir(parents=True, exist_ok=True)
                grey = np.clip(images[i] * (255.0 / 16.0), 0, 255).astype(np.uint8)
                img = Image.fromarray(grey, mode="L").resize((size, size), Image.Resampling.BICUBIC)
                img.convert("RGB").save(folder / f"{i:04d}.png")
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():  # not a lost race against another writer: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return root


def check_image_folder(root: str | os.PathLike, splits: Sequence[str]) -> None:
    """Raise :class:`DataError` naming the path unless every ``root/<split>`` has class folders."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root {str(root)!r} does not exist or is not a directory")
    for split in splits:
        folder = root / split
        if not folder.is_dir():
            raise DataError(
                f"data.root {str(root)!r} has no {split!r} folder: expected {str(folder)!r} "
                f"with one subfolder of images per class"
            )
        if not any(p.is_dir() for p in folder.iterdir()):
            raise DataError(f"{str(folder)!r} has no class subfolders")


def build_transform(data, aug, is_training: bool, img_size: int | None = None):
    """The timm transform of the training recipe (``is_training``) or of evaluation.

    ``data`` is a :class:`~gspn2.train.config.DataConfig`-like object (img_size, crop_pct,
    interpolation, mean, std, reduced_decode), ``aug`` an :class:`~gspn2.train.config.AugConfig`
    (training only). timm's pipeline, with three changes that keep its function:

    * ToTensor + Normalize become one fused conversion (:class:`ToNormalizedTensor`, same values to
      float rounding, a quarter of the time);
    * RandAugment's posterize ops keep 0 bits as a black image instead of the error Pillow >= 13 raises
      (magnitude 10, 2.3% of the draws at ``mstd0.5``, would otherwise stop a training run);
    * with ``data.reduced_decode`` the training crop decodes the JPEG at 1/2, 1/4 or 1/8 size when the
      crop allows (:class:`ReducedDecodeRandomResizedCrop`); the transform then takes the file's path.
    """
    size = img_size or data.img_size
    if not is_training:
        tf = create_transform(
            input_size=size,
            is_training=False,
            interpolation=data.interpolation,
            crop_pct=data.crop_pct,
            mean=tuple(data.mean),
            std=tuple(data.std),
        )
        return _fuse_to_tensor(tf)
    tf = create_transform(
        input_size=size,
        is_training=True,
        no_aug=aug.no_aug,
        scale=tuple(aug.scale),
        ratio=tuple(aug.ratio),
        hflip=aug.hflip,
        vflip=aug.vflip,
        color_jitter=aug.color_jitter,
        auto_augment=aug.auto_augment,
        interpolation=aug.train_interpolation,
        mean=tuple(data.mean),
        std=tuple(data.std),
        re_prob=aug.reprob,
        re_mode=aug.remode,
        re_count=aug.recount,
        crop_pct=data.crop_pct,  # used by no_aug only
    )
    tf = _fuse_to_tensor(tf)
    for t in tf.transforms:
        if isinstance(t, RandAugment):
            for op in t.ops:
                if op.name.startswith("Posterize"):
                    op.aug_fn = posterize_any_bits
    first = tf.transforms[0]
    if getattr(data, "reduced_decode", False) and isinstance(first, RandomResizedCropAndInterpolation):
        tf.transforms[0] = ReducedDecodeRandomResizedCrop(
            first.size, first.scale, first.ratio, first.interpolation
        )
        tf.reads_paths = True  # CheckedImageFolder hands it the path instead of a decoded image
    return tf


def posterize_any_bits(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """``ImageOps.posterize`` for 0..8 bits: 0 keeps no bit (a black image), 8 all of them."""
    if not 0 <= bits_to_keep <= 8:
        raise ValueError(f"bits_to_keep must be in 0..8, got {bits_to_keep}")
    mask = (0xFF << (8 - bits_to_keep)) & 0xFF
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


class ToNormalizedTensor:
    """A PIL image (or a CHW uint8 tensor) to a normalised float CHW tensor in one pass:
    ``(x / 255 - mean) / std`` computed as ``x * (1 / (255 std)) - mean / std``."""

    def __init__(self, mean, std):
        std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
        mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = mean / std

    def __call__(self, img):
        if isinstance(img, Image.Image):
            if img.mode != "RGB":
                img = img.convert("RGB")
            x = torch.from_numpy(np.array(img)).permute(2, 0, 1)  # a writable copy, as torch requires
        else:
            x = img
        return torch.addcmul(-self.shift, x.float(), self.scale)

    def __repr__(self):
        return f"{type(self).__name__}()"


def _fuse_to_tensor(tf: tvt.Compose) -> tvt.Compose:
    """Replace timm's ``MaybeToTensor(), Normalize(mean, std)`` pair by :class:`ToNormalizedTensor`."""
    ts = tf.transforms
    for k in range(len(ts) - 1):
        if isinstance(ts[k], MaybeToTensor) and isinstance(ts[k + 1], tvt.Normalize):
            norm = ts[k + 1]
            ts[k : k + 2] = [ToNormalizedTensor(norm.mean, norm.std)]
            break
    return tf


def _pil_mode(mode):
    return tvt.functional.pil_modes_mapping[mode] if isinstance(mode, tvt.InterpolationMode) else mode


#: JPEG decoding scales that libjpeg's scaled IDCT offers (and Pillow's ``Image.draft`` selects)
DRAFT_FACTORS = (8, 4, 2)


def reduction_factor(crop_h: int, crop_w: int, out_h: int, out_w: int) -> int:
    """The largest JPEG reduction (8, 4, 2 or 1) after which a ``crop_h x crop_w`` crop still has at least
    ``out_h x out_w`` pixels: the resize to the output size stays a downscale, as it was from full size."""
    for f in DRAFT_FACTORS:
        if crop_h >= f * out_h and crop_w >= f * out_w:
            return f
    return 1


class ReducedDecodeRandomResizedCrop:
    """timm's ``RandomResizedCropAndInterpolation`` that decodes only as many pixels as the crop needs.

    Called with a file path (or an image already decoded, then cropped like timm). The crop box is
    drawn on the original size by timm's own
    ``RandomResizedCropAndInterpolation.get_params`` (the JPEG header gives the size without decoding),
    so the crop distribution and the random stream are timm's. Then, where
    :func:`reduction_factor` allows, Pillow's ``Image.draft`` decodes the JPEG at 1/2, 1/4 or 1/8 size
    and the box is mapped onto the reduced image (fractional coordinates, through ``resize(box=...)``);
    otherwise it decodes at full size. Decode failures raise :class:`ImageError` naming the file.
    """

    def __init__(self, size, scale, ratio, interpolation):
        self.size = tuple(size)  # (h, w)
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        # timm keeps torchvision's InterpolationMode (or a tuple of them for "random"); PIL wants its own
        if isinstance(interpolation, (tuple, list)):
            self.interpolation = tuple(_pil_mode(m) for m in interpolation)
        else:
            self.interpolation = _pil_mode(interpolation)
        self.last = None  # (factor, (i, j, h, w)) of the latest call, for tests and benchmarks

    def __call__(self, path: str | Image.Image) -> Image.Image:
        out_h, out_w = self.size
        if isinstance(path, Image.Image):  # already decoded (a caller other than CheckedImageFolder)
            img = path.convert("RGB")
            i, j, h, w = RandomResizedCropAndInterpolation.get_params(img, self.scale, self.ratio)
            interpolation = self.interpolation
            if isinstance(interpolation, (tuple, list)):
                interpolation = random.choice(interpolation)
            self.last = (1, (i, j, h, w))
            return img.resize((out_w, out_h), resample=interpolation, box=(j, i, j + w, i + h))
        try:
            with open(path, "rb") as f:
                img = Image.open(f)
                full_w, full_h = img.size
                i, j, h, w = RandomResizedCropAndInterpolation.get_params(img, self.scale, self.ratio)
                interpolation = self.interpolation
                if isinstance(interpolation, (tuple, list)):
                    interpolation = random.choice(interpolation)
                factor = reduction_factor(h, w, out_h, out_w) if img.format == "JPEG" else 1
                if factor > 1:
                    img.draft("RGB", (full_w // factor, full_h // factor))
                img.load()
                img = img.convert("RGB")
        except _DECODE_ERRORS as e:
            raise ImageError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e
        sx, sy = img.width / full_w, img.height / full_h
        self.last = (factor if img.size != (full_w, full_h) else 1, (i, j, h, w))
        box = (j * sx, i * sy, (j + w) * sx, (i + h) * sy)
        return img.resize((out_w, out_h), resample=interpolation, box=box)

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio})"


def build_dataset(
    root: str | os.PathLike,
    split: str,
    transform,
    subset: int | None = None,
    bad_images: str = "skip",
    replace: bool = True,
) -> Dataset:
    """``ImageFolder(root/split)``, optionally reduced to a fixed random subset of ``subset`` images;
    unreadable images follow ``bad_images`` (see :class:`CheckedImageFolder`; ``replace``: training)."""
    dataset = CheckedImageFolder(str(Path(root) / split), transform, bad_images=bad_images, replace=replace)
    if subset is not None and subset < len(dataset):
        g = torch.Generator().manual_seed(_SUBSET_SEED)
        keep = torch.randperm(len(dataset), generator=g)[:subset].sort().values.tolist()
        subset_ds = Subset(dataset, keep)
        subset_ds.classes = dataset.classes  # type: ignore[attr-defined]
        return subset_ds
    return dataset


def check_classes(train_set: Dataset, val_set: Dataset, num_classes: int) -> None:
    """The two splits must have the same class folders (ImageFolder numbers them in sorted order), and as
    many as the classifier has outputs."""
    train_root, val_root = _folder_of(train_set), _folder_of(val_set)
    if train_set.classes != val_set.classes:
        only_train = sorted(set(train_set.classes) - set(val_set.classes))[:5]
        only_val = sorted(set(val_set.classes) - set(train_set.classes))[:5]
        raise DataError(
            f"{train_root!r} and {val_root!r} have different class folders "
            f"(only in train: {only_train}, only in val: {only_val})"
        )
    if len(train_set.classes) != num_classes:
        raise DataError(
            f"{train_root!r} has {len(train_set.classes)} class folders but data.num_classes={num_classes}"
        )


def _folder_of(dataset: Dataset) -> str:
    return (dataset.dataset if isinstance(dataset, Subset) else dataset).root


class ShardedBatchSampler(Sampler[int]):
    """Shuffled training order that does not depend on the number of processes.

    Each epoch draws one permutation from ``seed + epoch`` (identical on every rank) and cuts it into
    global batches of ``world_size * batch_size`` samples; rank ``r`` takes the ``r``-th contiguous
    slice of each global batch. So ``N`` processes at batch ``b`` see exactly the samples one process
    sees at batch ``N * b``, step for step -- the property the DDP equivalence test checks. Incomplete
    global batches at the end of an epoch are dropped. With ``repeats > 1`` (repeated augmentation,
    timm's ``--aug-repeats``) each drawn image appears ``repeats`` times in a row, each copy augmented
    anew, and the epoch keeps its length: ``num_samples / repeats`` distinct images.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
        repeats: int = 1,
        with_seeds: bool = False,
    ):
        self.with_seeds = with_seeds
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.repeats = repeats
        self.epoch = 0
        self.start_step = 0
        self.num_steps = num_samples // (batch_size * world_size)
        if self.num_steps == 0:
            raise DataError(
                f"{num_samples} training images are fewer than one global batch "
                f"({world_size} x {batch_size}); lower data.batch_size"
            )

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Iterate epoch ``epoch`` from batch ``start_step`` on (a resume inside the epoch skips the
        batches it consumed before)."""
        if not 0 <= start_step < self.num_steps:
            raise ValueError(f"start_step must be in [0, {self.num_steps}); got {start_step}")
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return (self.num_steps - self.start_step) * self.batch_size

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)[: self.num_samples]
        # one augmentation seed per position of the epoch's global order: the same sample of the same
        # epoch is augmented alike for any process count, worker count or resume point
        seeds = torch.randint(0, 2**62, (self.num_samples,), generator=g) if self.with_seeds else None
        global_batch = self.batch_size * self.world_size
        for step in range(self.start_step, self.num_steps):
            start = step * global_batch + self.rank * self.batch_size
            indices = order[start : start + self.batch_size].tolist()
            if seeds is None:
                yield from indices
            else:
                yield from zip(indices, seeds[start : start + self.batch_size].tolist())


class SeededSamples(Dataset):
    """``dataset[index]`` under the random state of a seed, for ``(index, seed)`` keys of
    :class:`ShardedBatchSampler` (``with_seeds=True``).

    The transform's random draws (Python's ``random``, NumPy's global state and torch's CPU generator:
    timm and torchvision use all three) come from the sample's own seed, so augmentation does not depend
    on which worker process, or how many, read the sample, nor on whether workers persist across epochs.
    In the main process (``num_workers=0``) the three states are restored afterwards, so the trainer's
    own streams (dropout, mixup) are not disturbed.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"SeededSamples takes (index, seed) keys, got {key!r}")
        index, seed = key
        saved = None
        if get_worker_info() is None:
            saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.random.default_generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            if saved is not None:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])


def default_num_workers() -> int:
    """Loader processes per trainer process: the CPUs this process may run on, shared by the processes
    of this node (``LOCAL_WORLD_SIZE``, set by torchrun), at least one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cpus // max(1, local))


def resolve_num_workers(num_workers) -> int:
    """``data.num_workers``: a count >= 0, or ``None`` / ``"auto"`` for :func:`default_num_workers`."""
    if num_workers is None or num_workers == "auto":
        return default_num_workers()
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"data.num_workers must be an integer >= 0, null or 'auto'; got {num_workers!r}")
    return num_workers


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    repeats: int = 1,
    persistent_workers: bool = True,
    prefetch_factor: int = 2,
    collate_fn=None,
) -> DataLoader:
    """The training DataLoader: :class:`ShardedBatchSampler` order, each sample augmented under its own
    seed (:class:`SeededSamples`); worker processes (if any) persist across epochs and keep
    ``prefetch_factor`` batches each in flight."""
    if prefetch_factor < 1:
        raise ValueError(f"data.prefetch_factor must be >= 1, got {prefetch_factor!r}")
    sampler = ShardedBatchSampler(
        len(dataset), batch_size, world_size, rank, seed, repeats=repeats, with_seeds=True
    )
    workers = {}
    if num_workers:  # DataLoader refuses both options without worker processes
        workers = dict(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
    return DataLoader(
        SeededSamples(dataset),
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        # the trainer seeds it per epoch; augmentation draws come from the samples' seeds, not from it
        generator=torch.Generator(),
        **workers,
    )


def train_loader_from_config(dataset: Dataset, cfg, device: torch.device, world_size: int, rank: int,
                             num_workers: int, pin_memory: bool):
    """The training loader of ``cfg.data.pipeline``: ``cpu`` (timm's transforms in the workers) or
    ``gpu`` (the GPU augments; the workers or nvJPEG decode, as ``data.gpu_decode`` says:
    :mod:`gspn2.train.gpu_data`)."""
    data = cfg.data
    pipeline = getattr(data, "pipeline", "cpu")
    common = dict(
        world_size=world_size, rank=rank, seed=cfg.seed, num_workers=num_workers, pin_memory=pin_memory,
        repeats=cfg.aug.repeats, persistent_workers=getattr(data, "persistent_workers", True),
        prefetch_factor=getattr(data, "prefetch_factor", 2),
    )
    if pipeline == "cpu":
        return build_train_loader(dataset, data.batch_size, **common)
    if pipeline == "gpu":
        from gspn2.train.gpu_data import build_gpu_train_loader

        return build_gpu_train_loader(dataset, data, cfg.aug, data.batch_size, device=device,
                                      ahead=getattr(data, "gpu_prefetch", 0), **common)
    raise ValueError(f"data.pipeline must be 'cpu' or 'gpu', got {pipeline!r}")


def build_eval_loader(
    dataset: Dataset, batch_size: int, world_size: int, rank: int, num_workers: int, pin_memory: bool
) -> DataLoader:
    """Rank ``r`` evaluates samples ``r, r + N, ...``: no padding, so sums over ranks are exact."""
    shard = Subset(dataset, list(range(rank, len(dataset), world_size)))
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=_collate_readable,  # skipped (unreadable) images leave the batch
    )


def steps_per_epoch(loader: DataLoader, accum_steps: int, limit: int | None) -> int:
    """Optimizer steps per epoch: whole accumulation groups, capped by ``limit``."""
    steps = len(loader) // accum_steps
    if steps == 0:
        raise DataError(f"an epoch has {len(loader)} batches, fewer than trainer.accum_steps={accum_steps}")
    return steps if limit is None else min(steps, limit)
