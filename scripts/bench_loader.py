"""Throughput of the training data loader alone, built exactly as ``train.py`` builds it.

The experiment's configuration is composed by Hydra from ``configs/`` (``experiment=<name>`` plus any
overrides), then the loader comes from the trainer's own functions (``build_transform``,
``build_dataset``, ``train_loader_from_config``), is seeded per epoch like the trainer's loop, and its
batches are copied to the device the trainer would use. No model runs: the figure is the rate at which
the loader can feed a training step. ``--pipeline`` names the input paths to measure, each one setting
``data.pipeline`` and ``data.gpu_decode``:

* ``cpu``: timm's transforms in the workers (``data.pipeline=cpu``);
* ``gpu``: the workers decode and crop, the GPU augments (``data.pipeline=gpu data.gpu_decode=false``);
* ``gpu-nvjpeg``: the workers read bytes, nvJPEG decodes, the GPU crops and augments
  (``data.pipeline=gpu data.gpu_decode=true``).

The GPU paths' images are on the device when the loader yields them; the GPU's work is waited for.

    python scripts/make_image_folder.py data/fake_in1k --classes 100 --train-per-class 300
    python scripts/bench_loader.py data/fake_in1k                                # the experiment's workers
    python scripts/bench_loader.py data/fake_in1k --pipeline cpu gpu gpu-nvjpeg --workers 16 --breakdown
    python scripts/bench_loader.py data/fake_in1k --pipeline cpu gpu --workers 4 8 16 --json runs/loader.json
    python scripts/bench_loader.py data/fake_in1k data.batch_size=64 --experiment in1k_gspn2_small

Per pipeline and worker count: the time to the first batch (worker start-up), then ``--warmup`` batches
untimed (by default two per worker and two more: every worker has delivered before the clock starts),
then img/s over ``--batches`` batches. An epoch that ends inside the run is followed by the next one, as
in training (the workers persist unless ``data.persistent_workers=false``). ``--workers`` overrides
``data.num_workers`` (default: the config's, ``null`` meaning the CPUs per process); ``--pipeline``
overrides ``data.pipeline`` and ``data.gpu_decode`` (default: the config's); ``--device`` sets
``trainer.device`` (``--device cpu`` runs the GPU paths' device work on the CPU). The loader is rebuilt for
each combination, in the order given.

``--breakdown`` adds, for the GPU paths, a second pass of ``--batches`` batches (after ``--warmup``
untimed ones) that shows where the trainer process's time goes: the batches are taken from the workers
and prepared inline, without the ``data.gpu_prefetch`` thread, and the device is synchronised after each
stage, so each batch's time splits into waiting for the workers' batch (pinning included), nvJPEG
decoding and cropping (``gpu-nvjpeg`` only), the host-to-device copies, and the augmentations. The
synchronisation makes this pass slower than the throughput pass; its img/s is reported beside it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import PIL
import torch
import torchvision
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from gspn2.train.config import TrainConfig, register_configs, validate
from gspn2.train.data import (
    build_dataset,
    build_transform,
    check_image_folder,
    resolve_num_workers,
    train_loader_from_config,
    write_digits,
)
from gspn2.train.distributed import configure_torch, destroy, init_distributed

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def compose_config(experiment: str, root: str, overrides: list[str]):
    """``configs/train.yaml`` composed with ``experiment=<experiment> data.root=<root> <overrides>``,
    checked against the schema like ``train.py`` checks it."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=[f"experiment={experiment}", f"data.root={root}", *overrides])
    validate(cfg, TrainConfig)
    return cfg


def build_train_data(cfg):
    """The training dataset, as ``train.py``'s data section builds it (data.prepare included)."""
    root = Path(cfg.data.root)
    if cfg.data.prepare == "digits":
        write_digits(root)
    elif cfg.data.prepare is not None:
        raise ValueError(f"data.prepare must be null or 'digits', got {cfg.data.prepare!r}")
    check_image_folder(root, [cfg.data.train_split, cfg.data.val_split])
    train_tf = build_transform(cfg.data, cfg.aug, is_training=True)
    return build_dataset(
        root, cfg.data.train_split, train_tf, cfg.data.train_subset, cfg.data.bad_images, replace=True
    )


#: ``--pipeline`` names: (data.pipeline, data.gpu_decode)
VARIANTS = {"cpu": ("cpu", None), "gpu": ("gpu", False), "gpu-nvjpeg": ("gpu", True)}
#: the stages of a GPU batch that ``--breakdown`` times, in their order
STAGES = ("wait", "decode", "crop", "upload", "augment")


def variant_of(data) -> str:
    """The ``--pipeline`` name of a data config."""
    if data.pipeline != "gpu":
        return data.pipeline
    return "gpu-nvjpeg" if data.gpu_decode else "gpu"


class _Epochs:
    """Batches of ``iterable`` epoch after epoch, each epoch seeded like the trainer's loop."""

    def __init__(self, loader, seed: int, rank: int):
        self.loader = loader  # the trainer's loader: its sampler and generator are seeded per epoch
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        self.started = 0
        self.it = None
        self.iterable = None

    def use(self, iterable) -> None:
        """Take the next batches from ``iterable`` (the loader itself, or a GPU loader's workers), from
        the next epoch on."""
        self.close()
        self.iterable = iterable

    def _start(self):
        # the trainer's per-epoch seeding (train.py's epoch loop)
        self.loader.sampler.set_epoch(self.epoch)
        self.loader.generator.manual_seed(self.seed + 100_003 * self.rank + self.epoch)
        self.epoch += 1
        self.started += 1
        self.it = iter(self.iterable)

    def next(self):
        if self.it is None:
            self._start()
        try:
            return next(self.it)
        except StopIteration:
            self._start()
            return next(self.it)

    def close(self) -> None:
        """Stop the current epoch (the GPU loader's prefetch thread with it)."""
        close = getattr(self.it, "close", None)
        if close is not None:
            close()
        self.it = None


def _breakdown(loader, epochs: _Epochs, device: torch.device, batches: int, warmup: int,
               batch_size: int) -> dict:
    """The ``--breakdown`` pass of a GPU loader (see the module docstring): mean ms per batch and stage."""
    epochs.use(loader.loader)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    totals = dict.fromkeys(STAGES, 0.0)
    seen: set[str] = set()
    elapsed = 0.0
    for n in range(warmup + batches):
        timed = n >= warmup
        sync()
        t = time.perf_counter()
        start = t
        batch = epochs.next()
        now = time.perf_counter()
        stage_times = {"wait": now - t}
        t = now

        def mark(stage):
            nonlocal t
            sync()
            now = time.perf_counter()
            stage_times[stage] = now - t
            t = now

        loader.augment(batch, mark=mark)
        if timed:
            elapsed += t - start
            for stage, seconds in stage_times.items():
                totals[stage] += seconds
                seen.add(stage)
    epochs.close()
    return {
        "batches": batches,
        "warmup_batches": warmup,
        "ms_per_batch": {k: 1000 * v / batches for k, v in totals.items() if k in seen},
        "img_per_s": batches * batch_size / elapsed,
    }


def measure(cfg, train_set, num_workers: int, device: torch.device, batches: int, warmup: int,
            rank: int = 0, world_size: int = 1, pipeline: str | None = None, breakdown: bool = False) -> dict:
    """One pipeline (a ``--pipeline`` name) and worker count: img/s of ``batches`` batches after
    ``warmup`` untimed ones; with ``breakdown``, a GPU path's stage times too."""
    if pipeline is not None:
        cfg = copy.deepcopy(cfg)
        cfg.data.pipeline, gpu_decode = VARIANTS[pipeline]
        if gpu_decode is not None:
            cfg.data.gpu_decode = gpu_decode
    loader = train_loader_from_config(
        train_set, cfg, device, world_size=world_size, rank=rank, num_workers=num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",  # as train.py: pinning serves GPU copies
    )
    epochs = _Epochs(loader, cfg.seed, rank)
    epochs.use(loader)

    def next_batch():
        images, targets = epochs.next()
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        return images

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    images = next_batch()
    sync()
    first_batch_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        images = next_batch()
    sync()
    shape = list(images.shape)
    epochs_before = epochs.started
    t1 = time.perf_counter()
    for _ in range(batches):
        images = next_batch()
    sync()
    seconds = time.perf_counter() - t1
    epochs_timed = epochs.started - epochs_before
    stages = None
    if breakdown and cfg.data.pipeline == "gpu":
        stages = _breakdown(loader, epochs, device, batches, warmup, cfg.data.batch_size)
    epochs.close()
    del epochs, loader  # ends this loader's workers before the next one starts its own
    gc.collect()
    images_timed = batches * cfg.data.batch_size
    return {
        "pipeline": cfg.data.pipeline,
        "gpu_decode": cfg.data.gpu_decode if cfg.data.pipeline == "gpu" else None,
        "variant": variant_of(cfg.data),
        "num_workers": num_workers,
        "img_per_s": images_timed / seconds,
        "img_per_s_per_worker": images_timed / seconds / num_workers if num_workers else None,
        "seconds": seconds,
        "batches": batches,
        "warmup_batches": warmup,
        "first_batch_s": first_batch_s,
        "epochs_started_while_timed": epochs_timed,
        "batch_shape": shape,
        "breakdown": stages,
    }


def _counts(values: list[int], flag: str, minimum: int) -> None:
    bad = [v for v in values if v < minimum]
    if bad:
        raise SystemExit(f"{flag} must be >= {minimum}, got {bad[0]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="image folder with train/ and val/ class folders (data.root)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. data.batch_size=64")
    parser.add_argument("--experiment", default="in1k_gspn2_tiny", help="configs/experiment/<name>.yaml")
    parser.add_argument("--workers", type=int, nargs="+",
                        help="data.num_workers values (default: the config's)")
    parser.add_argument("--pipeline", nargs="+", choices=tuple(VARIANTS),
                        help="input paths: cpu, gpu (workers decode), gpu-nvjpeg (default: the config's)")
    parser.add_argument("--batches", type=int, default=100, help="timed batches per worker count")
    parser.add_argument("--warmup", type=int, help="untimed batches first, the first included "
                        "(default: 2 per worker + 2, so every worker is past its start-up)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="trainer.device (default: the config's, auto)")
    parser.add_argument("--breakdown", action="store_true",
                        help="GPU paths: also time each batch's stages, synchronised (see the docstring)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    _counts([args.batches], "--batches", 1)
    if args.warmup is not None:
        _counts([args.warmup], "--warmup", 1)
    if args.workers is not None:
        _counts(args.workers, "--workers", 0)
    if args.json is not None and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):
        raise SystemExit(f"--json {args.json!r} is a directory or its folder does not exist")
    if not (CONFIGS / "experiment" / f"{args.experiment}.yaml").is_file():
        raise SystemExit(f"--experiment: no configs/experiment/{args.experiment}.yaml")

    overrides = [*args.overrides, *([f"trainer.device={args.device}"] if args.device else [])]
    cfg = compose_config(args.experiment, str(Path(args.root).resolve()), overrides)
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend)
    try:
        configure_torch(info.device, tf32=cfg.trainer.tf32, cpu_threads=cfg.trainer.cpu_threads)
        train_set = build_train_data(cfg)
        workers = args.workers if args.workers is not None else [resolve_num_workers(cfg.data.num_workers)]
        pipelines = args.pipeline if args.pipeline is not None else [variant_of(cfg.data)]
        cpus = len(os.sched_getaffinity(0))
        print(
            f"experiment {args.experiment}: {len(train_set)} training images under {cfg.data.root}, "
            f"batch {cfg.data.batch_size}, device {info.device}, {cpus} CPUs "
            f"(os.cpu_count {os.cpu_count()}), Pillow {PIL.__version__}",
            flush=True,
        )
        results = []
        for pipeline in pipelines:
            for w in workers:
                warmup = args.warmup if args.warmup is not None else 2 * w + 2
                r = measure(cfg, train_set, w, info.device, args.batches, warmup, info.rank, info.world_size,
                            pipeline=pipeline, breakdown=args.breakdown)
                results.append(r)
                per_worker = f", {r['img_per_s_per_worker']:.0f} per worker" if w else ""
                print(
                    f"pipeline {pipeline} workers {w:3d}: {r['img_per_s']:8.1f} img/s{per_worker} "
                    f"({args.batches} batches after {warmup} warm-up, first batch after "
                    f"{r['first_batch_s']:.1f} s)",
                    flush=True,
                )
                if r["breakdown"] is not None:
                    ms = r["breakdown"]["ms_per_batch"]
                    parts = " | ".join(f"{k} {v:.2f}" for k, v in ms.items())
                    print(
                        f"    breakdown, ms per batch (inline, synchronised): {parts} | total "
                        f"{sum(ms.values()):.2f} -> {r['breakdown']['img_per_s']:.1f} img/s",
                        flush=True,
                    )
    finally:
        destroy(info)
    report = {
        "experiment": args.experiment,
        "overrides": args.overrides,
        "root": cfg.data.root,
        "train_images": len(train_set),
        "batch_size": cfg.data.batch_size,
        "device": str(info.device),
        "cpus": cpus,
        "os_cpu_count": os.cpu_count(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "aug": OmegaConf.to_container(cfg.aug, resolve=True),
        "results": results,
    }
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
