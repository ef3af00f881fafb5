"""Train an image classifier from timm's parts -- GSPN-2 by default -- configured by Hydra.

Run from the repository root:

    python train.py                    # embedded default: gspn2_micro on scikit-learn's digits (CPU, ~2 min)
    python train.py trainer.epochs=5 data.batch_size=32            # any key of configs/ can be overridden
    python train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet
    torchrun --nproc_per_node=8 train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 \
        train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet run_dir=runs/in1k_tiny
    python train.py -m hydra/launcher=slurm experiment=in1k_gspn2_tiny data.root=/path/to/imagenet \
        run_dir=runs/in1k_tiny                                     # the same job on a SLURM cluster
    python train.py run_dir=runs/mine        # re-running this after a crash resumes from runs/mine/last.pt
    python train.py resume=runs/mine/last.pt # continue that state in a new run directory

The run directory (default runs/<name>/<time>) receives config.yaml, last.pt, best.pt, results.json,
curves.png and wandb/ (offline by default; logger.mode=online to stream). The last printed line is the
run directory. Configuration: configs/ (schema: gspn2/train/config.py); docs: docs/training.md.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import random
import time
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.nn as nn
import wandb
from omegaconf import DictConfig, OmegaConf
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import gspn2  # noqa: F401  (registers the gspn2_* models with timm)
from gspn2.counting import count_model
from gspn2.train.build import (
    build_mixup_and_loss,
    build_model,
    build_optimizer,
    build_scheduler,
    compile_model,
)
from gspn2.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_write_bytes,
    load_model_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from gspn2.train.config import COMPILE_MODES, TrainConfig, register_configs, validate
from gspn2.train.data import (
    ImageError,
    build_dataset,
    build_eval_loader,
    build_train_loader,
    build_transform,
    check_classes,
    check_image_folder,
    reset_skipped,
    skipped_images,
    steps_per_epoch,
    verify_images,
    write_digits,
)
from gspn2.train.distributed import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    configure_torch,
    destroy,
    init_distributed,
)
from gspn2.train.evaluate import autocast, evaluate
from gspn2.train.plotting import plot_curves
from gspn2.train.rundir import RunDirError, RunDirLock, publish, recover, resume_point, set_aside

register_configs()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def new_run_dir(runs_root: str, name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(runs_root) / name / stamp
    suffix = 1
    while run_dir.exists():  # two runs started in the same second
        run_dir = Path(runs_root) / name / f"{stamp}-{suffix}"
        suffix += 1
    return run_dir


def train(cfg: DictConfig) -> Path:
    """Train as ``cfg`` (a composed ``configs/train.yaml``) says; returns the run directory."""
    with contextlib.ExitStack() as cleanup:  # releases the run directory's lock on any exit
        return _train(cfg, cleanup)


def _train(cfg: DictConfig, cleanup: contextlib.ExitStack) -> Path:
    validate(cfg, TrainConfig)  # also rejects keys forced in with +key=...
    # ------------------------------------------------------------------------------------------ setup
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend)
    device, master = info.device, info.is_main
    log = print if master else (lambda *a, **k: None)
    configure_torch(device, tf32=cfg.trainer.tf32, cpu_threads=cfg.trainer.cpu_threads)
    precision = cfg.trainer.precision
    accum = cfg.trainer.accum_steps
    if cfg.trainer.compile_mode not in COMPILE_MODES:
        raise ValueError(f"trainer.compile_mode must be one of {COMPILE_MODES}, got {cfg.trainer.compile_mode!r}")
    if cfg.trainer.compile_lean_memory and not cfg.trainer.compile:
        raise ValueError("trainer.compile_lean_memory=true needs trainer.compile=true")

    # decided once on rank 0 and broadcast: every rank writes to and resumes from the same place
    run_dir = Path(cfg.run_dir) if cfg.run_dir else None
    run_dir = broadcast_object(run_dir or (new_run_dir(cfg.runs_root, cfg.name) if master else None), info)
    # one trainer per run directory (rank 0 holds the lock); then repair what a crash left behind
    refused = None
    if master:
        lock = cleanup.enter_context(RunDirLock(run_dir))
        try:
            stale = lock.acquire()
            notes = ([stale] if stale else []) + recover(run_dir)
        except (RunDirError, OSError) as e:
            refused = e
        else:
            for note in notes:
                log(f"note: {note}")
    refused = broadcast_object(refused, info)  # every rank stops, none waits for rank 0 forever
    if refused is not None:
        raise refused
    own_last = run_dir / "last.pt"
    start_point = resume_point(run_dir, cfg.resume)  # verified; a damaged last.pt stops here
    ckpt_path = start_point.path

    # ------------------------------------------------------------------------------------------- data
    root = Path(cfg.data.root)
    if cfg.data.prepare == "digits":
        if master:
            write_digits(root)
        barrier(info)
    elif cfg.data.prepare is not None:
        raise ValueError(f"data.prepare must be null or 'digits', got {cfg.data.prepare!r}")
    check_image_folder(root, [cfg.data.train_split, cfg.data.val_split])
    train_tf = build_transform(cfg.data, cfg.aug, is_training=True)
    val_tf = build_transform(cfg.data, cfg.aug, is_training=False)
    train_set = build_dataset(
        root, cfg.data.train_split, train_tf, cfg.data.train_subset, cfg.data.bad_images, replace=True
    )
    val_set = build_dataset(
        root, cfg.data.val_split, val_tf, cfg.data.val_subset, cfg.data.bad_images, replace=False
    )
    check_classes(train_set, val_set, cfg.data.num_classes)
    if cfg.data.verify:
        t_verify = time.perf_counter()
        mine = verify_images([train_set, val_set], info.rank, info.world_size)  # this rank's share
        bad = sum(all_gather_object(mine, info), [])
        listing = "".join(f"\n  {msg}" for msg in sorted(bad))
        if bad and cfg.data.bad_images == "fail":
            raise ImageError(f"data.verify: {len(bad)} unreadable images (data.bad_images=fail):{listing}")
        log(
            f"data.verify: decoded {len(train_set) + len(val_set)} images in "
            f"{time.perf_counter() - t_verify:.1f} s, {len(bad)} unreadable"
            + (f" (skipped and counted, data.bad_images=skip):{listing}" if bad else "")
        )
    loader_args = dict(
        world_size=info.world_size,
        rank=info.rank,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory,
    )
    train_loader = build_train_loader(train_set, cfg.data.batch_size, seed=cfg.seed, **loader_args)
    val_loader = build_eval_loader(val_set, cfg.data.eval_batch_size, **loader_args)
    updates_per_epoch = steps_per_epoch(train_loader, accum, cfg.trainer.limit_train_steps)

    # ------------------------------------------------------------------------------------------ model
    seed_everything(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, cfg.data.num_classes)
    count = None
    if master:  # one traced forward pass at batch 1 (fvcore)
        count = count_model(model, input_size=(3, cfg.data.img_size, cfg.data.img_size))
        log(
            f"model {cfg.model.name}: {count.params / 1e6:.3f} M params, "
            f"{count.macs / 1e9:.4f} G MACs at {cfg.data.img_size}x{cfg.data.img_size}"
        )
    seed_everything(cfg.seed + info.rank)  # from here on: per-rank streams (augmentation, dropout, mixup)
    model.to(device)
    if cfg.trainer.channels_last:
        model.to(memory_format=torch.channels_last)
    if cfg.trainer.grad_checkpointing:
        model.set_grad_checkpointing(True)

    # ------------------------------------------------------- optimizer, schedule, EMA, loss functions
    global_batch = cfg.data.batch_size * info.world_size * accum
    lr_scale = global_batch / cfg.optim.lr_base_size
    optimizer = build_optimizer(cfg.optim, model, lr_scale)  # AdamW, no decay on norms/biases/1-D
    scheduler, num_epochs = build_scheduler(
        cfg.sched, optimizer, cfg.trainer.epochs, lr_scale, updates_per_epoch
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None
    if cfg.ema.mesa_weight > 0 and ema is None:
        raise ValueError("MESA (ema.mesa_weight > 0) distils from the EMA model: set ema.enabled=true")
    mixup_fn, train_loss_fn = build_mixup_and_loss(cfg.aug, cfg.data.num_classes)
    distill_loss_fn = SoftTargetCrossEntropy()  # MESA: cross-entropy to the EMA teacher's probabilities

    # ------------------------------------------------------------------------------------------ resume
    start_epoch, step, best_top1, best_epoch, history, wandb_id = 0, 0, -math.inf, 0, [], None
    if ckpt_path is not None:
        ckpt, start_point.state = start_point.state, None
        load_model_state(model, ckpt["model"], ckpt_path)
        if ema is not None:
            if ckpt.get("ema") is None:
                raise CheckpointError(
                    f"checkpoint {str(ckpt_path)!r} has no EMA weights; resume with "
                    f"ema.enabled=false or start a new run"
                )
            load_model_state(ema.module, ckpt["ema"], ckpt_path, what="EMA")
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"the optimizer state in {str(ckpt_path)!r} does not fit optim={cfg.optim.name}: {e}"
            ) from e
        scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step = ckpt["epoch"], ckpt["step"]
        best_top1, best_epoch, history = ckpt["best_top1"], ckpt["best_epoch"], ckpt["history"]
        if len(ckpt["rng"]) == info.world_size:
            set_rng_state(ckpt["rng"][info.rank], device)
        else:
            log(
                f"note: {ckpt_path} was written by {len(ckpt['rng'])} processes, this run has "
                f"{info.world_size}: random streams restart from seed {cfg.seed} + rank"
            )
        if ckpt_path == own_last:
            wandb_id = ckpt["wandb_id"]  # the same run continues: append to its W&B run
        log(f"resumed from {ckpt_path}: epoch {start_epoch}, step {step}")
        del ckpt

    if start_epoch >= num_epochs:
        log(f"{ckpt_path} already holds all {num_epochs} epochs: nothing to train, nothing rewritten")
        destroy(info)
        log(run_dir)
        return run_dir

    train_model: nn.Module = model
    if cfg.trainer.compile:
        train_model = compile_model(train_model, cfg.trainer.compile_mode, cfg.trainer.compile_lean_memory)
    if info.enabled:
        train_model = DistributedDataParallel(
            train_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )

    # ------------------------------------------------------------------------------ logging, run dir
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    run = None
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_point.damaged_last is not None:
            kept = set_aside(start_point.damaged_last)
            log(f"note: the damaged {start_point.damaged_last} is kept as {kept}; resuming {ckpt_path}")
        atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())
        run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group,
            name=cfg.logger.name or f"{cfg.name}/{run_dir.name}",
            tags=list(cfg.logger.tags),
            mode=cfg.logger.mode,
            dir=str(run_dir),
            id=wandb_id,
            resume="allow",
            config=config_dict,
        )
        wandb_id = run.id
        log(
            f"run directory {run_dir} | {info.world_size} process(es) on {device.type} | global batch "
            f"{global_batch} | lr {cfg.optim.lr * lr_scale:.3g} | {updates_per_epoch} steps/epoch | "
            f"{precision}"
        )

    # ------------------------------------------------------------------------------------------- loop
    results: dict = {}
    for epoch in range(start_epoch, num_epochs):
        t_epoch = time.perf_counter()
        train_model.train()
        train_loader.sampler.set_epoch(epoch)
        train_loader.generator.manual_seed(cfg.seed + 100_003 * info.rank + epoch)  # DataLoader workers
        reset_skipped(train_set)
        reset_skipped(val_set)
        mesa_on = ema is not None and cfg.ema.mesa_weight > 0 and epoch >= cfg.ema.mesa_start_epoch
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        batches = iter(train_loader)
        bar = tqdm(
            total=updates_per_epoch,
            desc=f"epoch {epoch + 1}/{num_epochs}",
            leave=False,
            disable=not (master and cfg.trainer.progress),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        for _ in range(updates_per_epoch):
            for micro in range(accum):
                images, targets = next(batches)
                images = images.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                if mixup_fn is not None:
                    images, targets = mixup_fn(images, targets)
                if cfg.trainer.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                last_micro = micro == accum - 1
                no_sync = (
                    train_model.no_sync() if info.enabled and not last_micro else contextlib.nullcontext()
                )
                with no_sync:
                    with autocast(device, precision):
                        logits = train_model(images)
                        loss = train_loss_fn(logits, targets)
                        if mesa_on:
                            with torch.no_grad():
                                teacher = ema.module(images).float().softmax(dim=-1)
                            loss = loss + cfg.ema.mesa_weight * distill_loss_fn(logits.float(), teacher)
                    scaler.scale(loss / accum).backward()
                loss_sum += loss.detach().double() / accum
            if cfg.optim.clip_grad is not None:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            scheduler.step_update(num_updates=step)
            if ema is not None:
                ema.update(model, step=step)
            lr = optimizer.param_groups[0]["lr"]
            bar.update(1)
            if master and step % cfg.trainer.log_interval == 0:
                loss_now = loss.item()
                bar.set_postfix(loss=f"{loss_now:.4f}", lr=f"{lr:.2e}")
                stats = {"train/loss": loss_now, "train/lr": lr, "epoch": step / updates_per_epoch}
                if cfg.optim.clip_grad is not None:
                    stats["train/grad_norm"] = grad_norm.item()
                run.log(stats, step=step)
            if cfg.trainer.stop_after_steps is not None and step >= cfg.trainer.stop_after_steps:
                # crash simulation (resume tests): leave without saving anything of this epoch
                bar.close()
                log(f"stopped after {step} steps (trainer.stop_after_steps); last saved: epoch {epoch}")
                if run is not None:
                    run.finish(exit_code=1)
                destroy(info)
                log(run_dir)
                return run_dir
        bar.close()
        train_loss = all_reduce_sum(loss_sum, info).item() / (updates_per_epoch * info.world_size)
        if not math.isfinite(train_loss):  # keep the last good checkpoint rather than overwrite it
            raise FloatingPointError(
                f"training diverged in epoch {epoch + 1} (mean loss {train_loss}); "
                f"{run_dir / 'last.pt'} holds the last finished epoch"
            )

        # ------------------------------------------------------------------------------------- eval
        val = evaluate(model, val_loader, info, precision, cfg.trainer.channels_last)
        ema_val = (
            evaluate(ema.module, val_loader, info, precision, cfg.trainer.channels_last) if ema else None
        )
        record = {
            "epoch": epoch + 1,
            "step": step,
            "lr": lr,
            "train_loss": train_loss,
            "val_top1": val["top1"],
            "val_top5": val["top5"],
            "val_loss": val["loss"],
            "epoch_s": time.perf_counter() - t_epoch,
        }
        if ema_val is not None:
            record.update(
                ema_val_top1=ema_val["top1"], ema_val_top5=ema_val["top5"], ema_val_loss=ema_val["loss"]
            )
        skipped = {  # unreadable images this epoch left out (data.bad_images=skip), over all ranks
            split: sorted(set(sum(all_gather_object(skipped_images(ds), info), [])))
            for split, ds in (("train", train_set), ("val", val_set))
        }
        record.update(skipped_train_images=len(skipped["train"]), skipped_val_images=len(skipped["val"]))
        for split, files in skipped.items():
            if files:
                log(
                    f"epoch {epoch + 1}: skipped {len(files)} unreadable {split} image(s) "
                    f"(data.bad_images=skip): {', '.join(files)}"
                )
        history.append(record)
        is_best = val["top1"] > best_top1
        if is_best:
            best_top1, best_epoch = val["top1"], epoch + 1

        # ------------------------------------------------------------------------------- checkpoint
        rng = all_gather_object(rng_state(device), info)  # every rank's streams, for an exact resume
        if master:
            state = {
                "format": CHECKPOINT_FORMAT,
                "model": model.state_dict(),
                "model_name": cfg.model.name,
                "ema": ema.module.state_dict() if ema is not None else None,
                "ema_updates": step if ema is not None else 0,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "epoch": epoch + 1,
                "step": step,
                "best_top1": best_top1,
                "best_epoch": best_epoch,
                "history": history,
                "rng": rng,
                "config": config_dict,
                "wandb_id": wandb_id,
            }
            results = {
                **{k: v for k, v in record.items() if k != "epoch_s"},
                "best_top1": best_top1,
                "best_epoch": best_epoch,
                "model": cfg.model.name,
                "params": count.params,
                "macs": count.macs,
                "img_size": cfg.data.img_size,
                "global_batch": global_batch,
                "world_size": info.world_size,
                "train_s": sum(h["epoch_s"] for h in history),
                "run_dir": str(run_dir),
                "checkpoint": str(run_dir / "last.pt"),
                "history": history,
            }
            # the epoch's files are published as one set: a crash leaves this set or the previous one
            epoch_files = {
                "last.pt": lambda path: save_checkpoint(state, path),
                "results.json": lambda path: atomic_write_bytes(path, json.dumps(results, indent=2).encode()),
                "curves.png": lambda path: plot_curves(history, path),
            }
            if is_best:
                epoch_files["best.pt"] = "last.pt"  # a copy of the staged last.pt
            publish(run_dir, epoch_files, label=f"epoch {epoch + 1}")
            run.log(
                {"epoch": epoch + 1, "train/epoch_loss": train_loss}
                | {f"val/{k[len('val_') :]}": v for k, v in record.items() if k.startswith("val_")}
                | {
                    f"val/ema_{k[len('ema_val_') :]}": v
                    for k, v in record.items()
                    if k.startswith("ema_val_")
                },
                step=step,
            )
            ema_msg = f" | EMA top1 {ema_val['top1']:6.2f} loss {ema_val['loss']:.4f}" if ema_val else ""
            log(
                f"epoch {epoch + 1:3d}/{num_epochs} | train loss {train_loss:.4f} | "
                f"val top1 {val['top1']:6.2f} top5 {val['top5']:6.2f} loss {val['loss']:.4f}{ema_msg} | "
                f"lr {lr:.2e} | "
                f"{record['epoch_s']:.1f} s"
            )

    # ------------------------------------------------------------------------------------------ finish
    if master:
        log(
            f"done: val top1 {results['val_top1']:.2f} (best {best_top1:.2f} at epoch {best_epoch}), "
            f"{results['train_s']:.0f} s of training"
        )
        run.finish()
    destroy(info)
    log(run_dir)
    return run_dir


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
