"""Config -> timm objects: the model, optimizer, lr schedule, mixup and training loss.

Thin on purpose: each function is one timm factory call with the config's keys spelled out, shared by
train.py, eval.py and the config tests (so the tests instantiate exactly what training does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import timm
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import dispatch_clip_grad

from gspn2 import inductor

__all__ = [
    "TrainParts",
    "build_model",
    "lr_scale",
    "build_optimizer",
    "build_scheduler",
    "build_mixup_and_loss",
    "clip_gradients",
    "compile_model",
]


@dataclass
class TrainParts:
    """What an optimizer step touches.

    ``model`` is the plain module (its state dict is what checkpoints hold); ``train_model`` runs the
    forward pass (``model`` itself, or wrapped by ``torch.compile`` and DistributedDataParallel).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    ema: Any  # timm ModelEmaV3 or None
    mixup_fn: Mixup | None
    loss_fn: nn.Module
    distill_loss_fn: nn.Module  # MESA: cross-entropy to the EMA teacher's probabilities
    train_model: nn.Module | None = None

    def __post_init__(self) -> None:
        if self.train_model is None:
            self.train_model = self.model


def build_model(model_cfg, num_classes: int) -> nn.Module:
    """``timm.create_model(name, num_classes=..., **model.args)``: the architecture lives in the config.

    ``drop_rate``/``drop_path_rate`` left null are not passed (timm drops ``None`` kwargs), so the model's
    own defaults apply. An argument the model does not know raises in the model's constructor.
    """
    args = OmegaConf.to_container(model_cfg.args, resolve=True)
    return timm.create_model(
        model_cfg.name,
        pretrained=model_cfg.pretrained,
        num_classes=num_classes,
        drop_rate=model_cfg.drop_rate,
        drop_path_rate=model_cfg.drop_path_rate,
        **args,
    )


def lr_scale(optim_cfg, global_batch: int) -> float:
    """The factor on ``optim.lr`` (and the warm-up and minimum lr): ``global_batch / optim.lr_base_size``,
    or its square root with ``optim.lr_base_scale=sqrt`` (timm's ``--lr-base-scale``)."""
    ratio = global_batch / optim_cfg.lr_base_size
    return math.sqrt(ratio) if optim_cfg.lr_base_scale == "sqrt" else ratio


def build_optimizer(optim_cfg, model: nn.Module, lr_scale: float) -> torch.optim.Optimizer:
    """timm optimizer at ``lr * lr_scale``; no weight decay on norms, biases, other 1-D params and the
    names in ``model.no_weight_decay()`` (timm's ``filter_bias_and_bn``). ``optim.layer_decay`` gives
    each layer group of ``model.group_matcher()`` the lr ``lr * layer_decay ** (layers after it)``."""
    args = OmegaConf.to_container(optim_cfg.args, resolve=True)
    if optim_cfg.layer_decay is not None:
        if "layer_decay" in args:
            raise ValueError("layer-wise lr decay is optim.layer_decay; remove optim.args.layer_decay")
        args["layer_decay"] = optim_cfg.layer_decay
    return create_optimizer_v2(
        model,
        opt=optim_cfg.name,
        lr=optim_cfg.lr * lr_scale,
        weight_decay=optim_cfg.weight_decay,
        filter_bias_and_bn=True,
        **args,
    )


def build_scheduler(
    sched_cfg, optimizer: torch.optim.Optimizer, epochs: int, lr_scale: float, updates_per_epoch: int
):
    """timm scheduler (per optimizer step unless ``step_on_epochs``); returns ``(scheduler, num_epochs)``
    with ``num_epochs`` including any cooldown."""
    return create_scheduler_v2(
        optimizer,
        sched=sched_cfg.name,
        num_epochs=epochs,
        warmup_epochs=sched_cfg.warmup_epochs,
        warmup_lr=sched_cfg.warmup_lr * lr_scale,
        min_lr=sched_cfg.min_lr * lr_scale,
        cooldown_epochs=sched_cfg.cooldown_epochs,
        step_on_epochs=sched_cfg.step_on_epochs,
        updates_per_epoch=updates_per_epoch,
    )


def build_mixup_and_loss(aug_cfg, num_classes: int) -> tuple[Mixup | None, nn.Module]:
    """timm Mixup/CutMix (None when both are off) and the matching training loss: soft-target CE with
    mixup (whose targets carry the label smoothing), label-smoothing CE, or plain CE; with
    ``aug.bce_loss`` timm's binary cross-entropy instead (on the mixed targets, or smoothing itself)."""
    mixup_on = aug_cfg.mixup > 0 or aug_cfg.cutmix > 0 or aug_cfg.cutmix_minmax is not None
    if mixup_on:
        mixup_fn = Mixup(
            mixup_alpha=aug_cfg.mixup,
            cutmix_alpha=aug_cfg.cutmix,
            cutmix_minmax=list(aug_cfg.cutmix_minmax) if aug_cfg.cutmix_minmax is not None else None,
            prob=aug_cfg.mixup_prob,
            switch_prob=aug_cfg.mixup_switch_prob,
            mode=aug_cfg.mixup_mode,
            label_smoothing=aug_cfg.smoothing,
            num_classes=num_classes,
        )
        if aug_cfg.bce_loss:
            return mixup_fn, BinaryCrossEntropy(target_threshold=aug_cfg.bce_target_thresh)
        return mixup_fn, SoftTargetCrossEntropy()
    if aug_cfg.bce_loss:
        return None, BinaryCrossEntropy(smoothing=aug_cfg.smoothing, target_threshold=aug_cfg.bce_target_thresh)
    if aug_cfg.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(smoothing=aug_cfg.smoothing)
    return None, nn.CrossEntropyLoss()


def clip_gradients(model: nn.Module, clip: float, mode: str) -> torch.Tensor | None:
    """Clip ``model``'s gradients at ``clip``: the global norm (``norm``, returns the norm before
    clipping), each element (``value``) or adaptively per unit (``agc``, timm's); ``None`` but for ``norm``."""
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    dispatch_clip_grad([p for p in model.parameters() if p.grad is not None], clip, mode=mode)
    return None


def compile_model(model: nn.Module, mode: str, lean_memory: bool = False) -> nn.Module:
    """``torch.compile(model, mode=mode)`` (:func:`gspn2.inductor.compile`: with gspn2's Inductor pass where
    the option ``addmm`` asks for it); with ``lean_memory`` AOTAutograd's partitioner may recompute the
    pointwise chains that feed the backward's GEMMs instead of keeping their outputs
    (``torch._functorch.config.ban_recompute_materialized_backward = False``, a process-wide setting: lower
    training peak, a few percent slower; docs/benchmarks.md, "Memory").

    Kept here rather than in train.py: submitit pickles train.py's functions by value, and a reference to
    ``torch._functorch.config`` (a module subclass) there cannot be pickled.
    """
    if lean_memory:
        import torch._functorch.config as aot_config

        aot_config.ban_recompute_materialized_backward = False
    return inductor.compile(model, mode=mode)
