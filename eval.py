"""Evaluate a train.py checkpoint -- or any timm model by name -- on the val split of an image folder.

Run from the repository root:

    python eval.py checkpoint=runs/digits/<time>/best.pt              # data and sizes from the checkpoint
    python eval.py checkpoint=runs/digits/<time>/last.pt ema=true     # the EMA weights
    python eval.py checkpoint=<path> data.root=/path/to/imagenet img_size=288
    python eval.py model_name=resnet18 data.root=/path/to/imagenet [pretrained=true]
    python eval.py checkpoint=<path> predict=/folder/of/images [topk=5]  # predictions to a CSV file

Prints top-1, top-5, loss, params, MACs and forward throughput (img/s); the last printed line is the path
of the results JSON (default: next to the checkpoint, eval_<name>[_ema]_<size>.json; runs/eval/ for a
model by name). With ``predict=<folder>`` it writes the top-k classes and probabilities of every image
under the folder to a CSV instead (``<out>`` or ``predictions_<checkpoint>.csv`` next to the checkpoint).
Nothing is written unless the evaluation succeeds; a user error is one line on stderr and exit status 2.

The model runs in channels_last memory format on a CUDA device and contiguous on the CPU
(``channels_last=true|false`` overrides), eagerly unless ``compile=true`` [``compile_mode=reduce-overhead``].
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import hydra
import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.data import resolve_data_config

import gspn2  # noqa: F401  (registers the gspn2_* models with timm)
from gspn2.counting import count_model
from gspn2.train.build import build_model, compile_model
from gspn2.train.checkpoint import CheckpointError, atomic_write_bytes, load_checkpoint, load_model_state
from gspn2.train.config import ConfigError, EvalConfig, check_eval_config, register_configs, validate
from gspn2.train.data import (
    DataError,
    build_dataset,
    build_eval_loader,
    build_transform,
    check_image_folder,
    skipped_images,
)
from gspn2.train.distributed import all_gather_object, destroy, init_distributed
from gspn2.train.evaluate import batch_sizes, evaluate, resolve_channels_last, warm_up
from gspn2.train.predict import ImageFiles, predict_folder
from gspn2.train.runinfo import backend_info, describe, require_extension

register_configs()


def _pick(override, default):
    return default if override is None else override


def _prepare(model: torch.nn.Module, device: torch.device, channels_last: bool, cfg: DictConfig):
    """``model`` on ``device`` in its memory format, compiled if ``cfg.compile`` (the trainer's
    :func:`~gspn2.train.build.compile_model`, so eval compiles as train.py does: ``dynamic`` left at
    torch's default). The compiled graph is guarded on its input's shape: a batch of another size than
    the first -- the last, partial batch, or one that lost unreadable images -- is not run through a graph
    made for another size but recompiles once with a dynamic batch dimension, which then serves every
    later size (a batch of 1 compiles once more, as torch specialises size 1). The results are those of
    the eager model up to the rounding of fused kernels; only the time of the recompilation is added."""
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    model.eval()
    return compile_model(model, cfg.compile_mode) if cfg.compile else model


def _mode(channels_last: bool, cfg: DictConfig) -> str:
    """One phrase of how the model runs, for the log."""
    run = f"torch.compile(mode={cfg.compile_mode})" if cfg.compile else "eager"
    return f"{run}, {'channels_last' if channels_last else 'contiguous'}"


def run_eval(cfg: DictConfig) -> Path:
    """Evaluate as ``cfg`` (a composed ``configs/eval.yaml``) says; returns the results JSON path."""
    validate(cfg, EvalConfig)
    check_eval_config(cfg)  # ConfigError naming the key, before anything is loaded or written
    info = init_distributed(cfg.device)
    log = print if info.is_main else (lambda *a, **k: None)
    require_extension(info.device)
    backend = backend_info(info.device)
    channels_last = resolve_channels_last(cfg.channels_last, info.device)  # null: on for CUDA, off on CPU
    class_names = None

    # ------------------------------------------------------------------------- model and its data
    if cfg.checkpoint is not None:
        ckpt_path = Path(cfg.checkpoint)
        ckpt = load_checkpoint(ckpt_path)
        train_cfg = OmegaConf.create(ckpt["config"])
        train_cfg.model.pretrained = False  # the checkpoint supplies the weights
        model = build_model(train_cfg.model, train_cfg.data.num_classes)
        if cfg.ema and ckpt.get("ema") is None:
            raise CheckpointError(f"ema=true but checkpoint {str(ckpt_path)!r} holds no EMA weights")
        load_model_state(
            model, ckpt["ema"] if cfg.ema else ckpt["model"], ckpt_path, what="EMA" if cfg.ema else "model"
        )
        td = train_cfg.data
        data = SimpleNamespace(
            root=_pick(cfg.data.root, td.root),
            val_split=_pick(cfg.data.val_split, td.val_split),
            img_size=_pick(cfg.img_size, td.img_size),
            crop_pct=_pick(cfg.data.crop_pct, td.crop_pct),
            interpolation=_pick(cfg.data.interpolation, td.interpolation),
            mean=list(_pick(cfg.data.mean, td.mean)),
            std=list(_pick(cfg.data.std, td.std)),
            batch_size=_pick(cfg.data.batch_size, td.eval_batch_size),
            val_subset=_pick(cfg.data.val_subset, td.val_subset),
        )
        precision = _pick(cfg.precision, train_cfg.trainer.precision)
        class_names = ckpt.get("classes")
        name = train_cfg.model.name
        source = f"{ckpt_path} ({'EMA' if cfg.ema else 'model'} weights, epoch {ckpt['epoch']})"
        out = (
            Path(cfg.out)
            if cfg.out
            else ckpt_path.parent / (f"eval_{ckpt_path.stem}{'_ema' if cfg.ema else ''}_{data.img_size}.json")
        )
        if cfg.predict is not None and not cfg.out:
            out = ckpt_path.parent / f"predictions_{ckpt_path.stem}{'_ema' if cfg.ema else ''}.csv"
        del ckpt
    else:
        if cfg.ema:
            raise ConfigError("ema=true needs checkpoint=<path>: a timm model by name has no EMA weights")
        if cfg.data.root is None:
            raise DataError("model_name=... needs data.root=<folder with a val/ split of class folders>")
        extra = {"num_classes": cfg.num_classes} if cfg.num_classes is not None else {}
        model = timm.create_model(cfg.model_name, pretrained=cfg.pretrained, **extra)
        pre = resolve_data_config({}, model=model)
        data = SimpleNamespace(
            root=cfg.data.root,
            val_split=_pick(cfg.data.val_split, "val"),
            img_size=_pick(cfg.img_size, pre["input_size"][-1]),
            crop_pct=_pick(cfg.data.crop_pct, pre["crop_pct"]),
            interpolation=_pick(cfg.data.interpolation, pre["interpolation"]),
            mean=list(_pick(cfg.data.mean, pre["mean"])),
            std=list(_pick(cfg.data.std, pre["std"])),
            batch_size=_pick(cfg.data.batch_size, 256),
            val_subset=cfg.data.val_subset,
        )
        precision = _pick(cfg.precision, "fp32")
        name = cfg.model_name
        source = f"timm {cfg.model_name} ({'pretrained' if cfg.pretrained else 'random'} weights)"
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = (
            Path(cfg.out) if cfg.out else Path("runs/eval") / f"{cfg.model_name}_{data.img_size}_{stamp}.json"
        )
        if cfg.predict is not None and not cfg.out:
            out = Path("runs/eval") / f"predictions_{cfg.model_name}_{stamp}.csv"

    transform = build_transform(data, None, is_training=False)
    if cfg.predict is not None:  # unlabelled images: predictions, no metrics
        images = ImageFiles(cfg.predict, transform)
        model = _prepare(model, info.device, channels_last, cfg)
        log(f"{name}: {source}; {describe(backend)}; {_mode(channels_last, cfg)}")
        table = predict_folder(
            model,
            images,
            info.device,
            precision,
            data.batch_size,
            cfg.data.num_workers,
            cfg.topk,
            class_names,
            channels_last=channels_last,
        )
        if info.is_main:
            atomic_write_bytes(out, table)
        log(f"top-{cfg.topk} predictions of {len(images)} images of {cfg.predict}")
        destroy(info)
        log(out)
        return out

    check_image_folder(data.root, [data.val_split])
    val_set = build_dataset(
        data.root,
        data.val_split,
        transform,
        data.val_subset,
        bad_images=cfg.data.bad_images,
        replace=False,  # an unreadable image leaves the metrics, it is not replaced by another
    )
    num_outputs = model.num_classes
    if len(val_set.classes) > num_outputs:
        raise DataError(
            f"{Path(data.root) / data.val_split} has {len(val_set.classes)} classes, "
            f"more than the {num_outputs} outputs of {name}"
        )
    loader = build_eval_loader(
        val_set,
        data.batch_size,
        info.world_size,
        info.rank,
        cfg.data.num_workers,
        pin_memory=info.device.type == "cuda",
    )

    # ------------------------------------------------------------------------------------ evaluate
    count = count_model(model, input_size=(3, data.img_size, data.img_size))
    model = _prepare(model, info.device, channels_last, cfg)
    compile_s = None
    if cfg.compile:
        # compile for the batch sizes the loader yields before the timed forward of evaluate()
        log(f"compiling {name} with torch.compile(mode={cfg.compile_mode}) ...")
        compile_s = warm_up(model, batch_sizes(loader), data.img_size, info.device, precision, channels_last)
    metrics = evaluate(model, loader, info, precision, channels_last)
    skipped = sorted(set(sum(all_gather_object(skipped_images(val_set), info), [])))
    results = {
        "top1": metrics["top1"],
        "top5": metrics["top5"],
        "loss": metrics["loss"],
        "images": metrics["images"],
        "skipped_images": len(skipped),
        "img_per_s": metrics["img_per_s"],
        "params": count.params,
        "macs": count.macs,
        "model": name,
        "source": source,
        "checkpoint": cfg.checkpoint,
        "ema": cfg.ema,
        "img_size": data.img_size,
        "crop_pct": data.crop_pct,
        "interpolation": data.interpolation,
        "mean": data.mean,
        "std": data.std,
        "data_root": str(data.root),
        "val_split": data.val_split,
        "batch_size": data.batch_size,
        "precision": precision,
        "channels_last": channels_last,
        "compile_mode": cfg.compile_mode if cfg.compile else None,  # null: eager
        "compile_s": compile_s,  # compilation and warm-up, outside img_per_s; null: eager
        "device": str(info.device),
        "world_size": info.world_size,
        "backend": backend,
    }
    log(f"{name}: {source}")
    log(describe(backend))
    compiled = f" (compiled and warmed up in {compile_s:.1f} s, not timed)" if cfg.compile else ""
    log(f"model runs {_mode(channels_last, cfg)}{compiled}")
    size = f"{data.img_size}x{data.img_size}"
    log(f"params {count.params / 1e6:.3f} M | MACs {count.macs / 1e9:.4f} G at {size}")
    log(
        f"{metrics['images']} images of {Path(data.root) / data.val_split} | top1 {metrics['top1']:.2f} | "
        f"top5 {metrics['top5']:.2f} | loss {metrics['loss']:.4f} | "
        f"{metrics['img_per_s']:.1f} img/s "
        f"(forward, batch {data.batch_size}, {precision}, {info.device.type})"
    )
    if skipped:
        log(f"skipped {len(skipped)} unreadable image(s) (data.bad_images=skip): {', '.join(skipped)}")
    if info.is_main:
        atomic_write_bytes(out, json.dumps(results, indent=2).encode())
    destroy(info)
    log(out)
    return out


@hydra.main(version_base=None, config_path="configs/eval", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        run_eval(cfg)
    except (ConfigError, DataError, CheckpointError) as e:  # the user's to fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
