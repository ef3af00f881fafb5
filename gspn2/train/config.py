"""Structured schema of the training and evaluation configs.

The YAML files under ``configs/`` are merged onto these dataclasses (registered in Hydra's ConfigStore as
``train_schema`` and ``eval_schema`` and listed first in the primary configs' defaults), so a key that is
not declared here -- a typo on the command line or in a YAML file -- is an error at composition time,
and a value of the wrong type is rejected. Free-form dictionaries exist only where the keys belong to
someone else: ``model.args`` (the model constructor's keyword arguments, which the constructor itself
checks) and ``optim.args`` (the optimizer's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


@dataclass
class ModelConfig:
    name: str = MISSING  # any timm-registered model name
    pretrained: bool = False
    drop_rate: Optional[float] = None  # null: the model's default
    drop_path_rate: Optional[float] = None
    # architecture, passed verbatim as keyword arguments to timm.create_model
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    root: str = MISSING  # folder holding <train_split>/ and <val_split>/ class subfolders
    prepare: Optional[str] = None  # "digits": write the scikit-learn digits to root if it is missing
    train_split: str = "train"
    val_split: str = "val"
    num_classes: int = MISSING
    img_size: int = 224
    crop_pct: float = 0.875  # eval: resize to img_size / crop_pct, then centre crop img_size
    interpolation: str = "bicubic"  # eval resize
    mean: List[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: List[float] = field(default_factory=lambda: list(IMAGENET_STD))
    batch_size: int = 128  # per process
    eval_batch_size: int = 256  # per process
    num_workers: int = 8
    pin_memory: bool = True
    train_subset: Optional[int] = None  # use a fixed random subset of this many training images
    val_subset: Optional[int] = None
    # an unreadable image: "skip" leaves it out and counts it (logged per epoch, in results.json),
    # "fail" stops with an error naming the file
    bad_images: str = "skip"
    verify: bool = False  # decode every train and val file once at start-up and list the unreadable ones


@dataclass
class AugConfig:
    no_aug: bool = False  # training images get the eval transform (deterministic)
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: List[float] = field(default_factory=lambda: [3.0 / 4.0, 4.0 / 3.0])
    hflip: float = 0.5
    vflip: float = 0.0
    color_jitter: Optional[float] = 0.4
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    train_interpolation: str = "bicubic"
    reprob: float = 0.25
    remode: str = "pixel"
    recount: int = 1
    mixup: float = 0.8
    cutmix: float = 1.0
    cutmix_minmax: Optional[List[float]] = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    smoothing: float = 0.1


@dataclass
class OptimConfig:
    name: str = "adamw"  # timm.optim.create_optimizer_v2 name
    lr: float = 5e-4  # at a global batch of lr_base_size; scaled linearly with the real global batch
    lr_base_size: int = 512
    weight_decay: float = 0.05  # never applied to norms, biases, 1-D params and model.no_weight_decay()
    clip_grad: Optional[float] = 5.0  # max global grad norm; null disables clipping
    args: Dict[str, Any] = field(default_factory=dict)  # extra optimizer kwargs (betas, eps, momentum)


@dataclass
class SchedConfig:
    name: str = "cosine"  # timm.scheduler.create_scheduler_v2 name
    warmup_epochs: int = 20
    warmup_lr: float = 5e-7  # scaled like optim.lr
    min_lr: float = 5e-6  # scaled like optim.lr
    cooldown_epochs: int = 0
    step_on_epochs: bool = False  # false: update the lr every optimizer step


@dataclass
class EmaConfig:
    enabled: bool = True
    decay: float = 0.9999
    warmup: bool = False  # timm ModelEmaV3 use_warmup: decay ramps up over the first steps
    # MESA: extra soft cross-entropy to the EMA model's predictions (EMA-teacher self-distillation)
    mesa_weight: float = 0.0  # 0 disables MESA
    mesa_start_epoch: int = 0


#: ``trainer.compile_mode`` values: torch.compile's modes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainerConfig:
    epochs: int = 300
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "bf16"  # bf16 | fp16 | fp32 (autocast dtype; fp16 adds a GradScaler)
    accum_steps: int = 1  # micro-batches per optimizer step
    channels_last: bool = True
    compile: bool = False  # torch.compile the model
    # torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    # compile: let AOTAutograd recompute pointwise chains that feed the backward's GEMMs instead of saving
    # them (torch._functorch.config.ban_recompute_materialized_backward = False); less memory, a little slower
    compile_lean_memory: bool = False
    grad_checkpointing: bool = False  # model.set_grad_checkpointing(True)
    tf32: bool = True
    cpu_threads: Optional[int] = None  # torch intra-op threads on CPU runs (null: torch's default)
    dist_backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    log_interval: int = 50  # optimizer steps between W&B train logs
    limit_train_steps: Optional[int] = None  # cap optimizer steps per epoch (smoke tests)
    stop_after_steps: Optional[int] = None  # stop abruptly after this many steps in total (crash test)
    progress: bool = True  # tqdm progress bar on rank 0


@dataclass
class LoggerConfig:
    mode: str = "offline"  # offline | online | disabled  (wandb.init mode)
    project: str = "gspn2"
    entity: Optional[str] = None
    name: Optional[str] = None  # default: the run directory's name
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    name: str = "digits"  # experiment name; run directories go to <runs_root>/<name>/<timestamp>
    seed: int = 0
    runs_root: str = "runs"
    run_dir: Optional[str] = None  # fixed run directory; re-running with it resumes from its last.pt
    resume: Optional[str] = None  # checkpoint to continue from (its full training state)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


@dataclass
class EvalDataConfig:
    """Evaluation data; every null field is taken from the checkpoint's training config."""

    root: Optional[str] = None
    val_split: Optional[str] = None
    crop_pct: Optional[float] = None
    interpolation: Optional[str] = None
    mean: Optional[List[float]] = None
    std: Optional[List[float]] = None
    batch_size: Optional[int] = None
    num_workers: int = 2
    val_subset: Optional[int] = None
    bad_images: str = "skip"  # an unreadable image: skip and count it, or fail naming it


@dataclass
class EvalConfig:
    checkpoint: Optional[str] = None  # a train.py checkpoint ...
    model_name: Optional[str] = None  # ... or any timm model by name
    pretrained: bool = False  # model_name only: load timm's pretrained weights
    num_classes: Optional[int] = None  # model_name only: classifier size (default: the model's)
    ema: bool = False  # evaluate the checkpoint's EMA weights
    img_size: Optional[int] = None
    device: str = "auto"
    precision: Optional[str] = None  # default: the checkpoint's trainer.precision (fp32 for model_name)
    channels_last: bool = False
    out: Optional[str] = None  # results JSON; default next to the checkpoint (or under runs/eval)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)


def register_configs() -> None:
    """Register the schemas; the primary configs list them first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)


def validate(cfg, schema: type) -> None:
    """Re-check a composed config against its schema.

    Composition already rejects unknown keys, except those forced in with Hydra's ``+key=`` /
    ``++key=`` syntax (which opens the struct flag); this catches those too. Raises
    ``omegaconf.errors.ConfigKeyError`` naming the key, or a validation error naming a mistyped value.
    """
    from omegaconf import OmegaConf

    # merge a plain copy: a DictConfig would carry its relaxed flags into the merge
    OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(cfg, resolve=False))
