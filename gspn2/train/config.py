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
from pathlib import Path
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
    name: Optional[str] = None  # what the data is ("digits", "imagenet"); experiment=digits requires "digits"
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
    num_workers: Optional[int] = None  # loader processes per trainer process; null: the CPUs per process
    pin_memory: bool = True
    persistent_workers: bool = True  # training loader workers live across epochs
    prefetch_factor: int = 2  # batches in flight per training loader worker (each in shared memory)
    pipeline: str = "cpu"  # training input: cpu (timm transforms in workers) | gpu (GPU augmentation)
    gpu_decode: bool = False  # gpu pipeline: false: workers decode + crop (uint8) | true: nvJPEG on the GPU
    reduced_decode: bool = True  # cpu pipeline: decode JPEGs at 1/2, 1/4, 1/8 size when the crop allows
    gpu_prefetch: int = 2  # gpu pipeline: batches a background thread prepares on the GPU ahead (0: inline)
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
    repeats: int = 1  # repeated augmentation: each image this many times per epoch, augmented anew
    bce_loss: bool = False  # binary cross-entropy on the (mixed, smoothed) targets instead of soft-target CE
    bce_target_thresh: Optional[float] = None  # BCE: binarise targets above this value (null: keep soft)


@dataclass
class OptimConfig:
    name: str = "adamw"  # timm.optim.create_optimizer_v2 name
    lr: float = 5e-4  # at a global batch of lr_base_size; scaled linearly with the real global batch
    lr_base_size: int = 512
    weight_decay: float = 0.05  # never applied to norms, biases, 1-D params and model.no_weight_decay()
    clip_grad: Optional[float] = 5.0  # clipping threshold (see clip_mode); null disables clipping
    clip_mode: str = "norm"  # norm (global grad norm) | value (each element) | agc (adaptive, per unit)
    lr_base_scale: str = "linear"  # lr x (global_batch / lr_base_size), or its square root: linear | sqrt
    layer_decay: Optional[float] = None  # layer-wise lr decay: the head at lr, each earlier layer x this
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


#: ``trainer.compile_mode`` and eval's ``compile_mode`` values: torch.compile's modes.
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
    log_interval: int = 50  # optimizer steps between the log's speed lines (and W&B train logs)
    limit_train_steps: Optional[int] = None  # cap optimizer steps per epoch (smoke tests)
    stop_after_steps: Optional[int] = None  # stop abruptly after this many steps in total (crash test)
    progress: bool = True  # tqdm progress bar on rank 0 (shown only when stderr is a terminal)
    no_resume_opt: bool = False  # resume weights, EMA, epoch and history, but start a fresh optimizer state
    checkpoint_hist: int = 0  # keep the k best epochs as checkpoint-<epoch>.pt (0: only last.pt and best.pt)
    # every this many optimizer steps inside an epoch, write recovery.pt (resumable mid-epoch); 0: off
    checkpoint_every_steps: int = 0


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
    name: str = "${model.name}"  # run name; run directories go to <runs_root>/<name>/<timestamp>
    recipe: Optional[str] = None  # the experiment whose hyperparameters apply (set by configs/experiment/)
    seed: int = 0
    runs_root: str = "runs"
    run_dir: Optional[str] = None  # fixed run directory; re-running with it resumes from its last.pt
    resume: Optional[str] = None  # checkpoint to continue from (its full training state)
    # fine-tuning: start from these weights (a train.py checkpoint or a timm/HF-style weight file); a
    # classifier of another size is re-initialised, everything else must fit
    initial_checkpoint: Optional[str] = None
    initial_checkpoint_ema: bool = False  # a train.py checkpoint: take its EMA weights
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
    # channels_last memory format for the model and its inputs; null: on for a CUDA device (its 1x1 convs
    # and gspn2's depthwise kernels have their fast paths there), off (contiguous) on the CPU
    channels_last: Optional[bool] = None
    # torch.compile the model (the trainer's compile_model), compiled before the timed forward on zeros of
    # the loader's batch sizes (tens of seconds on a GPU): for one pass over a validation set eager is the
    # faster end to end, compiling pays off on long inference (docs/training.md, "Evaluation")
    compile: bool = False
    # torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    out: Optional[str] = None  # results JSON; default next to the checkpoint (or under runs/eval)
    # a folder of unlabelled images (searched recursively): write the top-k predictions per image to
    # <out stem>_predictions.csv instead of evaluating on data.root
    predict: Optional[str] = None
    topk: int = 5
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


# ------------------------------------------------------------------------------------- value checks
class ConfigError(ValueError):
    """A configuration value is out of its range, not one of its choices, or names a missing file."""


#: Choice-valued keys of the training config and their allowed values.
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")
TRAIN_CHOICES: dict[str, tuple] = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.precision": ("bf16", "fp16", "fp32"),
    "trainer.compile_mode": COMPILE_MODES,
    "trainer.dist_backend": ("auto", "nccl", "gloo", "mpi", "ucc"),
    "logger.mode": ("offline", "online", "disabled"),
    "data.prepare": (None, "digits"),
    "data.pipeline": ("cpu", "gpu"),
    "data.interpolation": INTERPOLATIONS,
    "aug.train_interpolation": (*INTERPOLATIONS, "random"),
    "aug.remode": ("pixel", "rand", "const"),
    "aug.mixup_mode": ("batch", "pair", "elem"),
    "optim.clip_mode": ("norm", "value", "agc"),
    "optim.lr_base_scale": ("linear", "sqrt"),
    "sched.name": ("cosine", "tanh", "step", "multistep", "plateau", "poly"),
}
#: Integer keys that must be >= 1 (``None`` allowed where the schema is Optional) ...
TRAIN_POSITIVE = (
    "trainer.epochs", "trainer.accum_steps", "trainer.log_interval", "trainer.cpu_threads",
    "trainer.limit_train_steps", "trainer.stop_after_steps", "data.batch_size", "data.eval_batch_size",
    "data.img_size", "data.num_classes", "data.train_subset", "data.val_subset", "optim.lr_base_size",
    "aug.recount", "aug.repeats", "data.prefetch_factor",
)  # fmt: skip
#: ... and those that must be >= 0.
TRAIN_NON_NEGATIVE = (
    "data.num_workers", "sched.warmup_epochs", "sched.cooldown_epochs", "ema.mesa_start_epoch",
    "trainer.checkpoint_hist", "trainer.checkpoint_every_steps", "optim.weight_decay", "sched.warmup_lr",
    "sched.min_lr", "ema.mesa_weight", "aug.mixup", "aug.cutmix", "data.gpu_prefetch",
)  # fmt: skip
#: Probabilities and fractions: ``key -> (low, high, high_inclusive)``, low always inclusive.
TRAIN_RANGES: dict[str, tuple[float, float, bool]] = {
    "aug.hflip": (0.0, 1.0, True),
    "aug.vflip": (0.0, 1.0, True),
    "aug.reprob": (0.0, 1.0, True),
    "aug.mixup_prob": (0.0, 1.0, True),
    "aug.mixup_switch_prob": (0.0, 1.0, True),
    "aug.smoothing": (0.0, 1.0, False),
    "ema.decay": (0.0, 1.0, True),
}


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_choice(cfg, key: str, choices: tuple) -> None:
    value = _get(cfg, key)
    if value not in choices:
        shown = " | ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{key} must be one of {shown}; got {value!r}")


def _check_int(cfg, key: str, minimum: int) -> None:
    value = _get(cfg, key)
    if value is not None and value < minimum:
        raise ConfigError(f"{key} must be {'>= 1' if minimum == 1 else '>= 0'}; got {value!r}")


def _check_file(key: str, value) -> None:
    if value is not None and not Path(value).is_file():
        raise ConfigError(f"{key}={value}: no such file")


def check_train_config(cfg, check_paths: bool = True) -> None:
    """Check every value of a composed training config; raise :class:`ConfigError` naming the key.

    Run at start-up, before a process group, a run directory, ``config.yaml`` or a W&B run exists, so a
    mistyped value costs nothing. Composition already checked the keys and their types
    (:func:`validate`); this checks what a type cannot say: choices, ranges, files that must exist, and
    combinations that do not work together. ``check_paths=False`` skips what depends on this machine:
    files and folders, and the wandb package an enabled logger needs (for composing documented commands
    whose paths are placeholders).
    """
    for key, choices in TRAIN_CHOICES.items():
        _check_choice(cfg, key, choices)
    for key in TRAIN_POSITIVE:
        _check_int(cfg, key, 1)
    for key in TRAIN_NON_NEGATIVE:
        _check_int(cfg, key, 0)
    for key, (low, high, inclusive) in TRAIN_RANGES.items():
        value = _get(cfg, key)
        if not (low <= value <= high if inclusive else low <= value < high):
            raise ConfigError(f"{key} must be in [{low}, {high}{']' if inclusive else ')'}; got {value!r}")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr must be > 0; got {cfg.optim.lr!r}")
    if cfg.optim.clip_grad is not None and not cfg.optim.clip_grad > 0:
        raise ConfigError(f"optim.clip_grad must be > 0 or null; got {cfg.optim.clip_grad!r}")
    if cfg.optim.layer_decay is not None and not 0 < cfg.optim.layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay must be in (0, 1] or null; got {cfg.optim.layer_decay!r}")
    if not 0 < cfg.data.crop_pct <= 1:
        raise ConfigError(f"data.crop_pct must be in (0, 1]; got {cfg.data.crop_pct!r}")
    if not isinstance(cfg.data.gpu_decode, bool):
        raise ConfigError(f"data.gpu_decode must be true or false; got {cfg.data.gpu_decode!r}")
    if cfg.data.pipeline == "gpu" and cfg.data.gpu_prefetch > 0 and cfg.data.num_workers == 0:
        raise ConfigError(
            "data.gpu_prefetch > 0 needs data.num_workers >= 1 (or null): without worker processes its thread "
            "would draw the augmentations from the random state the training loop uses; set one of them"
        )
    for key in ("data.mean", "data.std"):
        value = list(_get(cfg, key))
        if len(value) != 3 or (key == "data.std" and min(value) <= 0):
            raise ConfigError(f"{key} must be 3 values (RGB){', all > 0' if key == 'data.std' else ''}; got {value}")
    scale, ratio = list(cfg.aug.scale), list(cfg.aug.ratio)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        raise ConfigError(f"aug.scale must be [low, high] with 0 < low <= high <= 1; got {scale}")
    if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
        raise ConfigError(f"aug.ratio must be [low, high] with 0 < low <= high; got {ratio}")
    if cfg.aug.bce_target_thresh is not None and not cfg.aug.bce_loss:
        raise ConfigError("aug.bce_target_thresh needs aug.bce_loss=true")
    if cfg.trainer.compile_lean_memory and not cfg.trainer.compile:
        raise ConfigError("trainer.compile_lean_memory=true needs trainer.compile=true")
    if cfg.ema.mesa_weight > 0 and not cfg.ema.enabled:
        raise ConfigError("MESA (ema.mesa_weight > 0) distils from the EMA model: set ema.enabled=true")
    if cfg.recipe == "digits" and cfg.data.name != "digits":
        # experiment=digits is the default: without this, choosing data=imagenet would silently train
        # ImageNet with the digits learning rate, schedule, EMA and precision
        raise ConfigError(
            f"experiment=digits (the default) holds the digits recipe (lr per 64 images, 20 epochs, fp32, "
            f"EMA 0.99) but data={cfg.data.name or 'custom'}: choose a recipe for it "
            f"(experiment=in1k_gspn2_tiny, _small, _base) or experiment=none to use the groups' own "
            f"defaults (the ImageNet recipe)"
        )
    if cfg.initial_checkpoint_ema and cfg.initial_checkpoint is None:
        raise ConfigError("initial_checkpoint_ema=true needs initial_checkpoint=<file>")
    if not check_paths:
        return
    if cfg.data.prepare is None and not Path(cfg.data.root).is_dir():
        raise ConfigError(f"data.root={cfg.data.root}: no such directory")
    _check_file("resume", cfg.resume)
    _check_file("initial_checkpoint", cfg.initial_checkpoint)
    if cfg.logger.mode != "disabled":
        try:
            import wandb  # noqa: F401  (only an enabled logger needs it; train.py imports it lazily)
        except ImportError as e:
            raise ConfigError(
                f"logger.mode={cfg.logger.mode} needs the wandb package, which does not import here ({e}): "
                f"install it (pip install wandb) or train without W&B: logger=none"
            ) from e


def check_eval_config(cfg, check_paths: bool = True) -> None:
    """The evaluation config's counterpart of :func:`check_train_config`."""
    if (cfg.checkpoint is None) == (cfg.model_name is None):
        raise ConfigError("give exactly one of checkpoint=<train.py checkpoint> or model_name=<timm model name>")
    _check_choice(cfg, "device", ("auto", "cpu", "cuda"))
    _check_choice(cfg, "precision", (None, "bf16", "fp16", "fp32"))
    _check_choice(cfg, "compile_mode", COMPILE_MODES)
    for key in ("img_size", "num_classes", "data.batch_size", "data.val_subset", "topk"):
        _check_int(cfg, key, 1)
    _check_int(cfg, "data.num_workers", 0)
    if not check_paths:
        return
    if cfg.data.root is not None and not Path(cfg.data.root).is_dir():
        raise ConfigError(f"data.root={cfg.data.root}: no such directory")
    if cfg.predict is not None and not Path(cfg.predict).is_dir():
        raise ConfigError(f"predict={cfg.predict}: no such directory")
