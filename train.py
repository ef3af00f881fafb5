"""Train an image classifier from timm's parts -- GSPN-2 by default -- configured by Hydra.

Run from the repository root:

    python train.py                    # embedded default: gspn2_micro on scikit-learn's digits (CPU, ~2 min)
    python train.py trainer.epochs=5 data.batch_size=32            # any key of configs/ can be overridden
    python train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet
    python train.py experiment=none model=gspn2_tiny data=imagenet aug=imagenet data.root=...  # by group
    torchrun --nproc_per_node=8 train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 \
        train.py experiment=in1k_gspn2_tiny data.root=/path/to/imagenet run_dir=runs/in1k_tiny
    python train.py -m hydra/launcher=slurm experiment=in1k_gspn2_tiny data.root=/path/to/imagenet \
        run_dir=runs/in1k_tiny                                     # the same job on a SLURM cluster
    python train.py run_dir=runs/mine        # re-running this after a crash resumes from runs/mine/last.pt
    python train.py resume=runs/mine/last.pt # continue that state in a new run directory
    python train.py initial_checkpoint=weights.pth   # fine-tune from other weights (head re-initialised)

The run directory (default runs/<name>/<time>) receives config.yaml, last.pt, best.pt, results.json,
summary.csv, curves.png and wandb/ (offline by default; logger.mode=online to stream). The last printed
line is the run directory. A wrong value, a missing file or folder is one line on stderr and a non-zero
exit, before anything is written. Configuration: configs/ (schema: gspn2/train/config.py); docs: docs/training.md.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import gspn2  # noqa: F401  (registers the gspn2_* models with timm)
from gspn2.counting import count_model
from gspn2.train.build import (
    TrainParts,
    build_mixup_and_loss,
    build_model,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    compile_model,
    lr_scale as lr_scale_of,
)
from gspn2.train.checkpoint import (
    CheckpointError,
    Progress,
    atomic_write_bytes,
    load_checkpoint,
    restore_training_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    training_state,
)
from gspn2.train.config import ConfigError, TrainConfig, check_train_config, register_configs, validate
from gspn2.train.data import (
    DataError,
    ImageError,
    build_dataset,
    build_eval_loader,
    build_transform,
    check_classes,
    check_image_folder,
    reset_skipped,
    resolve_num_workers,
    skipped_images,
    steps_per_epoch,
    train_loader_from_config,
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
from gspn2.train.finetune import load_initial_weights
from gspn2.train.history import append_sweep_row, keep_top_k, summary_csv
from gspn2.train.plotting import plot_curves
from gspn2.train.rundir import (
    InterruptsDeferred,
    ResumePoint,
    RunDirError,
    RunDirLock,
    publish,
    recover,
    resume_point,
    set_aside,
)
from gspn2.train.runinfo import backend_info, describe, require_extension
from gspn2.train.throughput import ThroughputMeter, format_duration, format_interval, run_figures

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


def class_names(dataset) -> list[str]:
    # Not inline in train(): submitit pickles train() by value, and cloudpickle would then take the
    # attribute name "classes" next to the global torch for the module torch.classes, which cannot be pickled.
    return list(dataset.classes)


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two resolved configs."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a} -> {b}")
    return changes


def resume_command(overrides: list[str], run_dir: Path) -> str:
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("run_dir=", "resume="))]
    return " ".join(["python train.py", *kept, f"run_dir={run_dir}"])


def worker_count_note(num_workers: int) -> str | None:
    """One note if ``num_workers`` exceeds this process's CPU cores, in place of DataLoader's warning,
    which it repeats at every epoch's iterator (libraries that touch the warning filters reset the
    registry that would show it once); that warning is silenced."""
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_workers <= cores:
        return None
    return f"note: data.num_workers={num_workers} loader processes share {cores} CPU core(s): expect contention"


class NoRun:
    """The W&B run under ``logger.mode=disabled`` (``logger=none``): does nothing, needs no wandb."""

    id = None

    def log(self, data: dict, step: int | None = None) -> None:
        pass

    def finish(self, exit_code: int | None = None) -> None:
        pass


def open_run(logger_cfg, name: str, run_dir: Path, run_id: str | None, config: dict):
    """The W&B run ``name`` of ``logger.*`` (continuing ``run_id`` when given), files under ``run_dir``;
    a :class:`NoRun` when the logger is disabled.

    wandb is imported here, not at the top: a run with ``logger=none`` needs no wandb installed.
    """
    if logger_cfg.mode == "disabled":
        return NoRun()
    import wandb

    return wandb.init(
        project=logger_cfg.project,
        entity=logger_cfg.entity,
        group=logger_cfg.group,
        name=name,
        tags=list(logger_cfg.tags),
        mode=logger_cfg.mode,
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        config=config,
        # silent: W&B's own start and end messages are some 35 lines a run; wandb_line() is one
        settings=wandb.Settings(silent=True),
    )


def wandb_line(run, mode: str) -> str:
    """The one line said about the W&B run at the end."""
    if mode == "disabled":
        return "wandb: disabled"
    where = run.settings.sync_dir
    if mode == "offline":
        return f"wandb: offline run {run.id} in {where} (upload: wandb sync {where})"
    return f"wandb: run {run.id} at {run.url}, local files in {where}"


def train_one_epoch(
    parts: TrainParts,
    loader,
    cfg: DictConfig,
    info,
    epoch: int,
    updates: int,
    progress: Progress,
    run,
    bar,
    meter: ThroughputMeter,
    num_epochs: int,
    eval_s: float,
    start: int,
    loss_sum: torch.Tensor,
    save_recovery,
) -> bool:
    """One epoch of optimisation: ``updates`` optimizer steps of ``trainer.accum_steps`` micro-batches.

    Runs steps ``start`` .. ``updates - 1`` (``start > 0``: resumed inside the epoch, the loader set to
    skip what was consumed). Advances ``progress.step`` and ``progress.lr_steps`` and adds each step's
    mean loss to ``loss_sum`` (this rank's, float64 on the device, not synchronised); ``meter`` counts the
    steps and the time spent waiting for data. Every ``trainer.log_interval`` steps rank 0 prints a line
    (loss, lr, speed, memory, ETA of the epoch and of the run, with ``eval_s`` per remaining evaluation)
    and logs it to ``run``. Every ``trainer.checkpoint_every_steps`` steps but the epoch's last,
    ``save_recovery(steps done in the epoch)`` writes the state. Returns False when
    ``trainer.stop_after_steps`` ends the run inside the epoch, True when the epoch is complete.
    """
    device, accum, precision = info.device, cfg.trainer.accum_steps, cfg.trainer.precision
    model, train_model, optimizer, ema = parts.model, parts.train_model, parts.optimizer, parts.ema
    scaler, mixup_fn = parts.scaler, parts.mixup_fn
    mesa_on = ema is not None and cfg.ema.mesa_weight > 0 and epoch >= cfg.ema.mesa_start_epoch
    every = cfg.trainer.checkpoint_every_steps
    train_model.train()
    meter.start_epoch()
    t_wait = time.perf_counter()
    batches = iter(loader)  # starts the workers: loader time too
    meter.waited(time.perf_counter() - t_wait)
    for done in range(start, updates):
        for micro in range(accum):
            t_wait = time.perf_counter()
            images, targets = next(batches)
            meter.waited(time.perf_counter() - t_wait)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if mixup_fn is not None:
                images, targets = mixup_fn(images, targets)
            if cfg.trainer.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            last_micro = micro == accum - 1
            no_sync = train_model.no_sync() if info.enabled and not last_micro else contextlib.nullcontext()
            with no_sync:
                with autocast(device, precision):
                    logits = train_model(images)
                    loss = parts.loss_fn(logits, targets)
                    if mesa_on:
                        with torch.no_grad():
                            teacher = ema.module(images).float().softmax(dim=-1)
                        loss = loss + cfg.ema.mesa_weight * parts.distill_loss_fn(logits.float(), teacher)
                scaler.scale(loss / accum).backward()
            loss_sum += loss.detach().double() / accum
        grad_norm = None
        if cfg.optim.clip_grad is not None:
            scaler.unscale_(optimizer)
            grad_norm = clip_gradients(model, cfg.optim.clip_grad, cfg.optim.clip_mode)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        step = progress.step
        parts.scheduler.step_update(num_updates=step)
        if ema is not None:
            ema.update(model, step=step)
        lr = optimizer.param_groups[0]["lr"]
        meter.step()
        bar.update(1)
        progress.lr_steps.append(lr)
        if info.is_main and step % cfg.trainer.log_interval == 0:
            speed = meter.interval()  # synchronises the device: once per log interval
            loss_now = loss.item()
            left = updates - done - 1
            eta_epoch = left * speed["step_s"]
            later = num_epochs - epoch - 1  # epochs after this one; each evaluation costs about eval_s
            eta_run = eta_epoch + later * updates * speed["step_s"] + (later + 1) * eval_s
            bar.set_postfix(loss=f"{loss_now:.4f}", lr=f"{lr:.2e}")
            tqdm.write(  # above the progress bar when there is one
                f"epoch {epoch + 1}/{num_epochs} step {done + 1}/{updates} | loss {loss_now:.4f} | "
                f"lr {lr:.2e} | {format_interval(speed, device.type == 'cuda')} | "
                f"ETA epoch {format_duration(eta_epoch)}, run {format_duration(eta_run)}"
            )
            stats = {"train/loss": loss_now, "train/lr": lr, "epoch": step / updates}
            stats |= {f"train/{k}": v for k, v in speed.items() if v is not None}
            if grad_norm is not None:
                stats["train/grad_norm"] = grad_norm.item()
            run.log(stats, step=step)
        if every and step % every == 0 and done + 1 < updates:  # the epoch's end writes last.pt instead
            save_recovery(done + 1)
        if cfg.trainer.stop_after_steps is not None and step >= cfg.trainer.stop_after_steps:
            return False  # crash simulation (resume tests)
    return True


def publish_epoch(
    run_dir: Path, state: dict, results: dict, is_best: bool, title: str, train_label: str
) -> None:
    """Write the epoch's files as one set (:func:`gspn2.train.rundir.publish`): a crash leaves this set
    or the previous one. ``best.pt`` is a copy of the staged ``last.pt`` when the epoch is the best; the
    epoch's ``recovery.pt``, older than the new ``last.pt``, goes in the same unit."""
    history = results["history"]
    epoch_files = {
        "last.pt": lambda path: save_checkpoint(state, path),
        "results.json": lambda path: atomic_write_bytes(path, json.dumps(results, indent=2).encode()),
        "summary.csv": lambda path: atomic_write_bytes(path, summary_csv(history)),
        "curves.png": lambda path: plot_curves(
            history, path, title=title, train_label=train_label, lr_steps=state["lr_steps"].tolist()
        ),
    }
    if is_best:
        epoch_files["best.pt"] = "last.pt"
    publish(run_dir, epoch_files, remove=[RECOVERY_NAME], label=f"epoch {state['epoch']}")


#: The mid-epoch recovery state in the run directory (trainer.checkpoint_every_steps).
RECOVERY_NAME = "recovery.pt"


def recovery_point(run_dir: Path, start: ResumePoint, log) -> tuple[ResumePoint, Path | None]:
    """``run_dir/recovery.pt`` in place of ``start`` when it is further on (it always is, unless a run
    directory was assembled by hand: the epoch's publication removes it), and a damaged recovery state
    to set aside (the run then continues from ``start``, the last whole epoch)."""
    path = run_dir / RECOVERY_NAME
    if not path.exists():
        return start, None
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:
        log(f"note: {e}; continuing from {start.path or 'scratch'} instead")
        return start, path
    if start.state is not None and state["step"] <= start.state["step"]:
        return start, None
    return ResumePoint(path, state, damaged_last=start.damaged_last), None


def train(cfg: DictConfig, overrides: list[str] | None = None) -> Path:
    """Train as ``cfg`` (a composed ``configs/train.yaml``) says; returns the run directory.

    ``overrides`` (the command line's ``key=value`` arguments) are recorded in ``config.yaml`` and
    ``results.json`` and make up the resume command printed on Ctrl-C.
    """
    with contextlib.ExitStack() as cleanup:  # releases the run directory's lock on any exit
        return _train(cfg, overrides, cleanup)


def _train(cfg: DictConfig, overrides: list[str] | None, cleanup: contextlib.ExitStack) -> Path:
    validate(cfg, TrainConfig)  # also rejects keys forced in with +key=...
    check_train_config(cfg)  # every value, before anything exists (ConfigError names the key)
    overrides = list(overrides or [])
    # ------------------------------------------------------------------------------------------ setup
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend)
    device, master = info.device, info.is_main
    log = print if master else (lambda *a, **k: None)
    require_extension(device)  # a GPU run without gspn2's CUDA extension stops here, with the build hint
    backend = backend_info(device)
    configure_torch(device, tf32=cfg.trainer.tf32, cpu_threads=cfg.trainer.cpu_threads)
    precision = cfg.trainer.precision
    accum = cfg.trainer.accum_steps

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
    start_point, damaged_recovery = recovery_point(run_dir, start_point, log)
    ckpt_path = start_point.path

    # ------------------------------------------------------------------------------------------- data
    root = Path(cfg.data.root)
    if cfg.data.prepare == "digits":
        if master:
            write_digits(root)
        barrier(info)
    check_image_folder(root, [cfg.data.train_split, cfg.data.val_split])
    num_workers = resolve_num_workers(cfg.data.num_workers)
    note = worker_count_note(num_workers)
    if note:
        log(note)
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
        num_workers=num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",  # pinning serves host-to-GPU copies only
    )
    train_loader = train_loader_from_config(train_set, cfg, device, **loader_args)
    val_loader = build_eval_loader(val_set, cfg.data.eval_batch_size, **loader_args)
    updates_per_epoch = steps_per_epoch(train_loader, accum, cfg.trainer.limit_train_steps)

    # ------------------------------------------------------------------------------------------ model
    seed_everything(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, cfg.data.num_classes)
    if cfg.initial_checkpoint is not None and ckpt_path is None:  # a resume brings its own weights
        loaded = load_initial_weights(model, cfg.initial_checkpoint, cfg.initial_checkpoint_ema)
        log(
            f"initial weights: {loaded['source']}: {len(loaded['loaded'])} tensors loaded; "
            f"re-initialised (classifier of another size): {loaded['reinitialised'] or 'none'}; "
            f"missing: {loaded['missing'] or 'none'}; unexpected (ignored): {loaded['unexpected'] or 'none'}"
        )
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
    lr_scale = lr_scale_of(cfg.optim, global_batch)
    optimizer = build_optimizer(cfg.optim, model, lr_scale)  # AdamW, no decay on norms/biases/1-D
    scheduler, num_epochs = build_scheduler(
        cfg.sched, optimizer, cfg.trainer.epochs, lr_scale, updates_per_epoch
    )
    mixup_fn, train_loss_fn = build_mixup_and_loss(cfg.aug, cfg.data.num_classes)
    parts = TrainParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        ema=ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None,
        mixup_fn=mixup_fn,
        loss_fn=train_loss_fn,
        distill_loss_fn=SoftTargetCrossEntropy(),
    )

    # ------------------------------------------------------------------------------------------ resume
    progress = Progress()
    mid_epoch = None  # where inside its epoch a recovery state stopped
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    if ckpt_path is not None:
        ckpt, start_point.state = start_point.state, None
        progress = restore_training_state(
            ckpt,
            ckpt_path,
            parts,
            optim_name=cfg.optim.name,
            fresh_optimizer=cfg.trainer.no_resume_opt,
            step_on_epochs=cfg.sched.step_on_epochs,
        )
        changes = config_changes(
            {k: v for k, v in ckpt["config"].items() if k not in ("run_dir", "resume")},
            {k: v for k, v in config_dict.items() if k not in ("run_dir", "resume")},
        )
        if changes:
            log(f"config changes against {ckpt_path}: " + "; ".join(changes))
        if len(ckpt["rng"]) == info.world_size:
            set_rng_state(ckpt["rng"][info.rank], device)
        else:
            log(
                f"note: {ckpt_path} was written by {len(ckpt['rng'])} processes, this run has "
                f"{info.world_size}: random streams restart from seed {cfg.seed} + rank"
            )
        if ckpt_path not in (own_last, run_dir / RECOVERY_NAME):
            progress.wandb_id = None  # another run's checkpoint: a new W&B run
        mid_epoch = ckpt.get("mid_epoch")
        if mid_epoch is not None and len(mid_epoch["loss_sums"]) != info.world_size:
            raise CheckpointError(
                f"{ckpt_path} stopped inside epoch {progress.epoch + 1} with {len(mid_epoch['loss_sums'])} "
                f"processes; resume it with as many, or continue from the last whole epoch: resume={own_last}"
            )
        log(
            f"resumed from {ckpt_path}: epoch {progress.epoch}"
            + (f" + {mid_epoch['step']} steps" if mid_epoch is not None else "")
            + f", step {progress.step}"
            + (" (fresh optimizer state: trainer.no_resume_opt)" if cfg.trainer.no_resume_opt else "")
        )
        del ckpt

    if progress.epoch >= num_epochs:
        log(f"{ckpt_path} already holds all {num_epochs} epochs: nothing to train, nothing rewritten")
        destroy(info)
        log(run_dir)
        return run_dir

    if cfg.trainer.compile:
        parts.train_model = compile_model(model, cfg.trainer.compile_mode, cfg.trainer.compile_lean_memory)
    if info.enabled:
        parts.train_model = DistributedDataParallel(
            parts.train_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )

    # ------------------------------------------------------------------------------ logging, run dir
    run = None
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_point.damaged_last is not None:
            kept = set_aside(start_point.damaged_last)
            log(f"note: the damaged {start_point.damaged_last} is kept as {kept}; resuming {ckpt_path}")
        if damaged_recovery is not None:
            log(f"note: the damaged {damaged_recovery} is kept as {set_aside(damaged_recovery)}")
        recorded = OmegaConf.create(config_dict)
        recorded.run_dir = str(run_dir)  # the resolved run directory: re-running this config resumes it
        header = f"# python train.py {' '.join(overrides)}\n# overrides: {json.dumps(overrides)}\n"
        atomic_write_bytes(run_dir / "config.yaml", (header + OmegaConf.to_yaml(recorded)).encode())
        run = open_run(
            cfg.logger,
            name=cfg.logger.name or f"{cfg.name}/{run_dir.name}",
            run_dir=run_dir,
            run_id=progress.wandb_id,
            config={**config_dict, "backend": backend, "overrides": overrides},
        )
        progress.wandb_id = run.id
        log(describe(backend))
        log(
            f"run directory {run_dir} | {info.world_size} process(es) on {device.type} | global batch "
            f"{global_batch} | lr {cfg.optim.lr * lr_scale:.3g} | {updates_per_epoch} steps/epoch | "
            f"{precision}"
        )

    # ------------------------------------------------------------------------------------------- loop
    results: dict = {}
    # a progress bar only on a terminal: in a log file its carriage returns pile up into one huge line
    show_bar = master and cfg.trainer.progress and sys.stderr.isatty()
    # the train loss is computed against mixed or smoothed targets: say so next to the val loss
    train_loss_label = (
        "train (mixup/cutmix targets)" if mixup_fn is not None
        else f"train (label smoothing {cfg.aug.smoothing:g})" if cfg.aug.smoothing > 0
        else "train"
    )  # fmt: skip
    meter = ThroughputMeter(device, global_batch, info.world_size)
    eval_s = 0.0  # the last evaluation's time, for the ETA of the run
    if cfg.trainer.compile:
        log(
            f"compiling the model with torch.compile(mode={cfg.trainer.compile_mode}): "
            f"the first step can take minutes"
        )
    try:
        for epoch in range(progress.epoch, num_epochs):
            t_epoch = time.perf_counter()
            start = mid_epoch["step"] if mid_epoch is not None else 0  # steps done before a resume
            train_loader.sampler.set_epoch(epoch, start_step=start * accum)
            train_loader.generator.manual_seed(cfg.seed + 100_003 * info.rank + epoch)  # DataLoader workers
            reset_skipped(train_set)
            reset_skipped(val_set)
            bar = tqdm(
                initial=start,
                total=updates_per_epoch,
                desc=f"epoch {epoch + 1}/{num_epochs}",
                leave=False,
                disable=not show_bar,
                dynamic_ncols=True,
                mininterval=1.0,
            )
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            elapsed_before = 0.0  # of this epoch, before a resume inside it
            if mid_epoch is not None:
                loss_sum += mid_epoch["loss_sums"][info.rank]
                elapsed_before = mid_epoch["elapsed_s"]
                mid_epoch = None

            def save_recovery(steps_done: int) -> None:
                """recovery.pt: the whole state after ``steps_done`` steps of this epoch (atomic write)."""
                rng = all_gather_object(rng_state(device), info)
                sums = all_gather_object(loss_sum.item(), info)
                if master:
                    position = {
                        "step": steps_done,
                        "loss_sums": torch.tensor(sums, dtype=torch.float64),
                        "elapsed_s": elapsed_before + time.perf_counter() - t_epoch,
                    }
                    state = training_state(
                        parts, progress, model_name=cfg.model.name, classes=class_names(train_set),
                        rng=rng, config=config_dict, mid_epoch=position,
                    )  # fmt: skip
                    with InterruptsDeferred(str(run_dir / RECOVERY_NAME)):
                        save_checkpoint(state, run_dir / RECOVERY_NAME)

            finished = train_one_epoch(
                parts, train_loader, cfg, info, epoch, updates_per_epoch, progress, run, bar,
                meter=meter, num_epochs=num_epochs, eval_s=eval_s, start=start, loss_sum=loss_sum,
                save_recovery=save_recovery,
            )  # fmt: skip
            bar.close()
            if not finished:  # trainer.stop_after_steps: leave as a crash would, saving nothing more
                recovery = run_dir / RECOVERY_NAME
                log(
                    f"stopped after {progress.step} steps (trainer.stop_after_steps); "
                    f"last saved: epoch {progress.epoch}"
                    + (f", and {recovery} inside epoch {progress.epoch + 1}" if recovery.exists() else "")
                )
                if run is not None:
                    run.finish(exit_code=1)
                destroy(info)
                log(run_dir)
                return run_dir
            if cfg.sched.step_on_epochs:  # per-epoch schedules move at epoch ends only (timm's train.py)
                scheduler.step(epoch + 1)
            train_loss = all_reduce_sum(loss_sum, info).item() / (updates_per_epoch * info.world_size)
            if not math.isfinite(train_loss):  # keep the last good checkpoint rather than overwrite it
                raise FloatingPointError(
                    f"training diverged in epoch {epoch + 1} (mean loss {train_loss}); "
                    f"{run_dir / 'last.pt'} holds the last finished epoch"
                )

            speed = meter.epoch()

            # ------------------------------------------------------------------------------------- eval
            t_eval = time.perf_counter()
            ema = parts.ema
            val = evaluate(model, val_loader, info, precision, cfg.trainer.channels_last)
            ema_val = (
                evaluate(ema.module, val_loader, info, precision, cfg.trainer.channels_last) if ema else None
            )
            eval_s = time.perf_counter() - t_eval
            lr = progress.lr_steps[-1]  # the last step's (an epoch schedule has moved on since)
            record = {
                "epoch": epoch + 1,
                "step": progress.step,
                "lr": lr,
                "train_loss": train_loss,
                "val_top1": val["top1"],
                "val_top5": val["top5"],
                "val_loss": val["loss"],
                "epoch_s": elapsed_before + time.perf_counter() - t_epoch,
                **speed,  # the training steps' speed (gspn2.train.throughput.TIMING_KEYS)
                "eval_s": eval_s,
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
            progress.epoch = epoch + 1
            progress.history.append(record)
            is_best = val["top1"] > progress.best_top1
            if is_best:
                progress.best_top1, progress.best_epoch = val["top1"], epoch + 1

            # ------------------------------------------------------------------------------- checkpoint
            rng = all_gather_object(rng_state(device), info)  # every rank's streams, for an exact resume
            if master:
                state = training_state(
                    parts,
                    progress,
                    model_name=cfg.model.name,
                    classes=class_names(train_set),
                    rng=rng,
                    config=config_dict,
                )
                with InterruptsDeferred(f"the epoch's files in {run_dir}"):  # a Ctrl-C waits for them
                    kept = keep_top_k(run_dir, progress.history, state, cfg.trainer.checkpoint_hist)
                    results = {
                        **{k: v for k, v in record.items() if k != "epoch_s"},
                        "best_top1": progress.best_top1,
                        "best_epoch": progress.best_epoch,
                        "model": cfg.model.name,
                        "params": count.params,
                        "macs": count.macs,
                        "img_size": cfg.data.img_size,
                        "global_batch": global_batch,
                        "world_size": info.world_size,
                        "train_s": sum(h["epoch_s"] for h in progress.history),
                        "speed": run_figures(progress.history),  # the training steps over all epochs
                        "run_dir": str(run_dir),
                        "checkpoint": str(run_dir / "last.pt"),
                        "top_k_epochs": kept,
                        "backend": backend,
                        "overrides": overrides,
                        "history": progress.history,
                    }
                    publish_epoch(
                        run_dir,
                        state,
                        results,
                        is_best,
                        title=f"{cfg.name} / {run_dir.name}: {cfg.model.name}",
                        train_label=train_loss_label,
                    )
                run.log(
                    {"epoch": epoch + 1, "train/epoch_loss": train_loss}
                    | {f"epoch/{k}": v for k, v in speed.items() if v is not None}
                    | {"epoch/eval_s": eval_s}
                    | {f"val/{k[len('val_') :]}": v for k, v in record.items() if k.startswith("val_")}
                    | {
                        f"val/ema_{k[len('ema_val_') :]}": v
                        for k, v in record.items()
                        if k.startswith("ema_val_")
                    },
                    step=progress.step,
                )
                ema_msg = f" | EMA top1 {ema_val['top1']:6.2f} loss {ema_val['loss']:.4f}" if ema_val else ""
                log(
                    f"epoch {epoch + 1:3d}/{num_epochs} | train loss {train_loss:.4f} | "
                    f"val top1 {val['top1']:6.2f} top5 {val['top5']:6.2f} loss {val['loss']:.4f}{ema_msg} | "
                    f"lr {lr:.2e} | {format_interval(speed, device.type == 'cuda')} | "
                    f"{record['epoch_s']:.1f} s"
                )
    except KeyboardInterrupt:
        last = run_dir / "last.pt"
        if master:
            saved = f"the last checkpoint is {last}" if last.exists() else "no epoch finished, nothing saved"
            if (run_dir / RECOVERY_NAME).exists():
                saved += f", and {run_dir / RECOVERY_NAME} holds the state inside the epoch after it"
            print(f"\ninterrupted: {saved}; resume with: {resume_command(overrides, run_dir)}", file=sys.stderr)
            if run is not None:
                run.finish(exit_code=130)
        destroy(info)
        raise

    # ------------------------------------------------------------------------------------------ finish
    if master:
        log(
            f"done: val top1 {results['val_top1']:.2f} (best {progress.best_top1:.2f} at epoch "
            f"{progress.best_epoch}), {results['train_s']:.0f} s of training"
        )
        if results["speed"] is not None:
            log(f"speed over the run's epochs: {format_interval(results['speed'], device.type == 'cuda')}")
        run.finish()
        log(wandb_line(run, cfg.logger.mode))
    destroy(info)
    log(run_dir)
    return run_dir


#: Errors of the user's making: one line on stderr, no traceback, exit status 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, RunDirError)


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    row = {"job": hydra_cfg.job.num if sweep else 0, "overrides": " ".join(overrides), "status": "failed"}
    try:
        run_dir = train(cfg, overrides)
        results_file = run_dir / "results.json"
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
        row.update({k: results.get(k, "") for k in ("best_top1", "best_epoch", "val_top1", "epoch")})
        row.update(run_dir=str(run_dir), status="done")
    except USER_ERRORS as e:
        row["status"] = f"error: {e}"
        if sweep:
            raise  # Hydra reports the failed job and goes on with the sweep
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        row["status"] = "interrupted"
        sys.exit(130)  # train() printed where the last checkpoint is and how to resume
    finally:
        if sweep and int(os.environ.get("RANK", "0")) == 0:
            # one line per job of the sweep, linking its number to its run directory
            append_sweep_row(Path(hydra_cfg.sweep.dir), row)


if __name__ == "__main__":
    main()
