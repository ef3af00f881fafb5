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

import hashlib
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
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate, get_worker_info
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
    "build_train_loader",
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
        super().__init__(root, transform=transform, loader=read_image)
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
    interpolation, mean, std), ``aug`` an :class:`~gspn2.train.config.AugConfig` (training only).
    """
    size = img_size or data.img_size
    if not is_training:
        return create_transform(
            input_size=size,
            is_training=False,
            interpolation=data.interpolation,
            crop_pct=data.crop_pct,
            mean=tuple(data.mean),
            std=tuple(data.std),
        )
    return create_transform(
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
    ):
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

    def positions(self) -> Iterator[tuple[int, int]]:
        """``(index, position)`` pairs: ``position`` is the sample's place in the epoch's global order,
        the same for any number of processes."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)[: self.num_samples]
        global_batch = self.batch_size * self.world_size
        for step in range(self.start_step, self.num_steps):
            start = step * global_batch + self.rank * self.batch_size
            indices = order[start : start + self.batch_size].tolist()
            yield from zip(indices, range(start, start + self.batch_size))

    def __iter__(self) -> Iterator[int]:
        return (index for index, _ in self.positions())


class _SeededOrder(Sampler):
    """:class:`ShardedBatchSampler`'s order as the ``(index, (seed, epoch, position))`` keys that
    :class:`SeededSamples` reads."""

    def __init__(self, sampler: ShardedBatchSampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        s = self.sampler
        return ((index, (s.seed, s.epoch, position)) for index, position in s.positions())


class SeededSamples(Dataset):
    """In DataLoader workers, draws each training sample's augmentation from its own seed,
    ``(seed, epoch, position in the epoch)``.

    A worker's random streams (python ``random``, numpy, torch's CPU generator: what timm's transforms
    use) are seeded before each sample, so a sample's augmentation does not depend on which worker loads
    it, on the number of workers or processes, or on the step the loader started from: a resume inside
    an epoch draws the same augmentations as the uninterrupted run. In the main process
    (``num_workers=0``) the transforms draw from the trainer's own streams, which every checkpoint holds,
    so a resume continues those instead.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, (seed, epoch, position) = key
        if get_worker_info() is not None:
            # a hash of the key, not the key itself: neighbouring positions get unrelated streams (a few µs;
            # numpy's SeedSequence takes ~50 µs and torch.manual_seed ~0.5 ms, as it also queues CUDA seeds)
            key_bytes = f"{seed},{epoch},{position}".encode()
            digest = int.from_bytes(hashlib.blake2b(key_bytes, digest_size=16).digest(), "little")
            random.seed(digest)
            np.random.seed(digest & 0xFFFFFFFF)  # numpy's legacy seed takes 32 bits
            torch.random.default_generator.manual_seed(digest >> 64)
        return self.dataset[index]


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    repeats: int = 1,
) -> DataLoader:
    sampler = ShardedBatchSampler(len(dataset), batch_size, world_size, rank, seed, repeats=repeats)
    return DataLoader(
        SeededSamples(dataset),  # augmentation seeded per sample: reproducible from any step of an epoch
        batch_size=batch_size,
        sampler=_SeededOrder(sampler),
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # the workers' base seeds, set per epoch by the trainer (their augmentations are seeded per sample)
        generator=torch.Generator(),
    )


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
