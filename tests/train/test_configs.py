"""Every config composes against the schema and instantiates what train.py builds from it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError
from PIL import Image

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.train.build import build_mixup_and_loss, build_model, build_optimizer, build_scheduler
from gspn2.train.config import (
    ConfigError,
    EvalConfig,
    TrainConfig,
    check_eval_config,
    check_train_config,
    validate,
)
from gspn2.train.data import build_transform
from tests.train._helpers import CONFIGS, REPO, compose_cfg

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
GROUPS = ["model", "data", "aug", "optim", "sched", "ema", "trainer", "logger"]
GROUP_OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))]


_MODELS: dict[str, torch.nn.Module] = {}


def _model(cfg) -> torch.nn.Module:
    """``build_model`` of a config, built once per architecture (the ImageNet sizes take seconds)."""
    key = OmegaConf.to_yaml(cfg.model) + f"num_classes: {cfg.data.num_classes}"
    if key not in _MODELS:
        _MODELS[key] = build_model(cfg.model, cfg.data.num_classes)
    return _MODELS[key]


def _build_all(cfg, updates_per_epoch: int = 10):
    """Instantiate model, optimizer, schedule, mixup/loss and both transforms, exactly as train.py does."""
    model = _model(cfg)
    optimizer = build_optimizer(cfg.optim, model, lr_scale=2.0)
    scheduler, num_epochs = build_scheduler(cfg.sched, optimizer, cfg.trainer.epochs, 2.0, updates_per_epoch)
    mixup, loss_fn = build_mixup_and_loss(cfg.aug, cfg.data.num_classes)
    image = Image.new("RGB", (cfg.data.img_size + 13, cfg.data.img_size + 5), (120, 30, 200))
    for is_training in (True, False):
        x = build_transform(cfg.data, cfg.aug, is_training=is_training)(image)
        assert x.shape == (3, cfg.data.img_size, cfg.data.img_size)
    return model, optimizer, scheduler, num_epochs, mixup, loss_fn


def test_expected_experiments_exist():
    assert {"digits", "in1k_gspn2_tiny", "in1k_gspn2_small", "in1k_gspn2_base"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_instantiates(experiment):
    cfg = compose_cfg([f"experiment={experiment}", "data.root=/nonexistent/imagenet"])
    validate(cfg, TrainConfig)
    assert cfg.name == (cfg.model.name if experiment == "none" else experiment)
    assert cfg.recipe == (None if experiment == "none" else experiment)
    model, optimizer, scheduler, num_epochs, mixup, loss_fn = _build_all(cfg)
    assert type(model).__name__ == "GSPN2"
    assert num_epochs == cfg.trainer.epochs + cfg.sched.cooldown_epochs
    # lr scaled by the global batch; no weight decay on 1-D params (norms, biases, skips)
    for group in optimizer.param_groups:
        assert group["initial_lr"] == pytest.approx(cfg.optim.lr * 2.0, rel=1e-9)
        if cfg.sched.warmup_epochs > 0:  # the schedule starts at the (scaled) warm-up lr
            assert group["lr"] == pytest.approx(cfg.sched.warmup_lr * 2.0, rel=1e-9)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed, "some parameters must be decayed"
    for name, p in model.named_parameters():
        if p.ndim <= 1 or name in model.no_weight_decay():
            assert id(p) not in decayed, name


@pytest.mark.parametrize(
    "size,lr,drop_path", [("tiny", 5e-4, 0.2), ("small", 3e-4, 0.4), ("base", 5e-4, 0.5)]
)
def test_imagenet_recipe(size, lr, drop_path):
    """docs/spec.md, section 3, as the configs spell it."""
    cfg = compose_cfg([f"experiment=in1k_gspn2_{size}", "data.root=/x"])
    assert cfg.model.name == f"gspn2_{size}" and cfg.model.drop_path_rate == drop_path
    assert (cfg.trainer.epochs, cfg.sched.warmup_epochs, cfg.sched.name, cfg.sched.step_on_epochs) == (
        300,
        20,
        "cosine",
        False,
    )
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.lr_base_size, cfg.optim.weight_decay) == (
        "adamw",
        lr,
        512,
        0.05,
    )
    assert list(cfg.optim.args.betas) == [0.9, 0.999] and cfg.optim.clip_grad == 5.0
    assert (cfg.sched.min_lr, cfg.sched.warmup_lr) == (5e-6, 5e-7)
    assert (cfg.data.img_size, cfg.data.crop_pct, cfg.data.interpolation) == (224, 0.875, "bicubic")
    aug = cfg.aug
    assert (aug.color_jitter, aug.auto_augment, aug.reprob, aug.hflip) == (
        0.4,
        "rand-m9-mstd0.5-inc1",
        0.25,
        0.5,
    )
    assert (aug.mixup, aug.cutmix, aug.mixup_switch_prob, aug.smoothing) == (0.8, 1.0, 0.5, 0.1)
    assert (cfg.ema.enabled, cfg.ema.decay, cfg.ema.mesa_weight) == (True, 0.9999, 0.0)
    assert cfg.trainer.precision == "bf16"
    # compiled with CUDA graphs: the eager and default-mode steps are host-bound on an H200 (docs/training.md)
    assert cfg.trainer.compile and cfg.trainer.compile_mode == "reduce-overhead" and cfg.trainer.channels_last


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_group_option_composes(group, option):
    overrides = [f"{group}={option}", "data.root=/nonexistent"]
    if group == "model":  # an ImageNet-sized model: the build is shared with the experiment tests
        overrides.append("data=imagenet")
    if (group, option) == ("model", "timm"):
        overrides.append("model.name=resnet10t")
    cfg = compose_cfg(overrides)
    validate(cfg, TrainConfig)
    _build_all(cfg)


@pytest.mark.parametrize("variant", ["gspn2_micro", "gspn2_tiny", "gspn2_small", "gspn2_base"])
def test_model_config_builds_the_registered_variant(variant):
    """configs/model/<variant>.yaml names the registered model and overrides nothing of its architecture:
    it builds what ``timm.create_model(variant)`` builds (same modules, same parameter count and shapes).
    Both are built on the meta device: structure and shapes without the seconds of initialising GSPN-2-B."""
    cfg = compose_cfg([f"model={variant}", "data=imagenet", "data.root=/nonexistent"])
    assert cfg.model.name == variant and dict(cfg.model.args) == {}
    with torch.device("meta"):
        from_config = build_model(cfg.model, cfg.data.num_classes)
        registered = timm.create_model(
            variant, num_classes=cfg.data.num_classes, drop_path_rate=cfg.model.drop_path_rate
        )
    assert next(from_config.parameters()).device.type == "meta"
    assert repr(from_config) == repr(registered)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(from_config) == count(registered) > 0
    shapes = {k: tuple(v.shape) for k, v in from_config.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in registered.state_dict().items()}


def test_model_args_override_reaches_the_constructor():
    """``+model.args.<name>=<value>`` adds a constructor argument to the registered architecture."""
    cfg = compose_cfg(["model=gspn2_micro", "+model.args.dims=[16,32,64,96]"])
    model = build_model(cfg.model, cfg.data.num_classes)
    assert model.num_features == 96 and model.get_classifier().in_features == 96
    assert build_model(compose_cfg(["model=gspn2_micro"]).model, 10).num_features == 128


def test_eval_config_composes():
    cfg = compose_cfg(
        ["checkpoint=/x.pt", "ema=true", "img_size=48", "data.root=/d"],
        config_name="eval",
        config_dir=CONFIGS / "eval",
    )
    validate(cfg, EvalConfig)
    assert (cfg.checkpoint, cfg.ema, cfg.img_size, cfg.data.root) == ("/x.pt", True, 48, "/d")


def test_slurm_launcher_config():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node  # one task (rank) per GPU
    assert cfg.hydra.job.chdir is False


@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.epochz=3", "epochz"),  # misspelt key
        ("+trainer.epochz=3", "epochz"),  # forced in with +, caught by the schema check
        ("++model.namee=resnet18", "namee"),
        ("optimm.lr=1", "optimm"),
    ],
)
def test_unknown_key_is_an_error(override, key):
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match=key):
        validate(compose_cfg([override]), TrainConfig)


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigCompositionException, match="trainer.epochs"):
        compose_cfg(["trainer.epochs=many"])


def test_misspelt_key_in_a_yaml_file_is_an_error(tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    (configs / "trainer" / "typo.yaml").write_text("epochs: 3\nprecison: fp32\n")
    with pytest.raises(ConfigCompositionException, match="precison"):
        compose_cfg(["trainer=typo"], config_dir=configs)


# ------------------------------------------------------------------- composition of the documented commands
def _documented_commands() -> list[tuple[str, str, list[str], str | None]]:
    """``(file, script, overrides, error)`` of every train.py / eval.py command in the code blocks of
    README.md and docs/training.md (fenced or indented; backslash continuations joined, comments
    dropped); ``error`` is the ``error: ...`` line shown right after the command, if any."""
    commands = []
    for doc in (REPO / "README.md", REPO / "docs" / "training.md"):
        lines, fenced = [], False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced or line.startswith("    "):
                lines.append(line.strip())
        text = "\n".join(lines).replace("\\\n", " ").splitlines()
        for n, line in enumerate(text):
            line = line.split(" #")[0]
            words = line.split()
            script = next((w for w in words if w.endswith(("train.py", "eval.py"))), None)
            if script is None:
                continue
            at = words.index(script)
            if not (words[at - 1].endswith("python") or any(w.endswith("torchrun") for w in words[:at])):
                continue  # prose about the scripts, not a command
            # placeholders such as <time> are for the reader to fill in
            overrides = [re.sub(r"<([^>]*)>", r"\1", w) for w in words[at + 1 :] if w != "-m"]
            after = text[n + 1] if n + 1 < len(text) else ""
            error = after[len("error: ") :] if after.startswith("error: ") else None
            commands.append((doc.name, Path(script).stem, overrides, error))
    return commands


DOCUMENTED = _documented_commands()


def test_the_docs_have_commands_to_check():
    scripts = {script for _, script, _, _ in DOCUMENTED}
    assert scripts == {"train", "eval"} and len(DOCUMENTED) >= 15, DOCUMENTED


@pytest.mark.parametrize(
    "doc,script,overrides,error", DOCUMENTED, ids=[" ".join(c[2]) or c[1] for c in DOCUMENTED]
)
def test_documented_command_composes_and_passes_the_checks(doc, script, overrides, error):
    """Every documented command composes, and its values pass the start-up checks (paths aside: they
    are placeholders here), or fail with exactly the error the docs show. A command that picks ImageNet
    data must not carry the digits recipe."""
    if script == "eval":
        cfg = compose_cfg(overrides, config_name="eval", config_dir=CONFIGS / "eval")
        validate(cfg, EvalConfig)
        check_eval_config(cfg, check_paths=False)
        return
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    del cfg.hydra
    validate(cfg, TrainConfig)
    if error is not None:
        with pytest.raises(ConfigError) as raised:
            check_train_config(cfg, check_paths=False)
        assert str(raised.value) == error
        return
    check_train_config(cfg, check_paths=False)
    if cfg.data.name == "imagenet":
        assert cfg.recipe != "digits"
        assert (cfg.optim.lr_base_size, cfg.sched.warmup_epochs, cfg.ema.decay) == (512, 20, 0.9999)
        assert (cfg.trainer.precision, cfg.trainer.channels_last, cfg.trainer.cpu_threads) == ("bf16", True, None)


def test_composing_groups_never_inherits_the_digits_recipe():
    """`model=gspn2_tiny data=imagenet aug=imagenet` under the default experiment=digits is refused, with
    the way out in the message; under experiment=none it is the groups' ImageNet recipe."""
    groups = ["model=gspn2_tiny", "data=imagenet", "aug=imagenet", "data.root=/x", "trainer.epochs=100"]
    with pytest.raises(ConfigError, match=r"experiment=digits .*data=imagenet.*experiment=none"):
        check_train_config(compose_cfg(groups), check_paths=False)
    cfg = compose_cfg(["experiment=none", *groups])
    check_train_config(cfg, check_paths=False)
    assert (cfg.name, cfg.recipe, cfg.trainer.epochs) == ("gspn2_tiny", None, 100)
    assert (cfg.optim.lr, cfg.optim.lr_base_size, cfg.sched.warmup_epochs) == (5e-4, 512, 20)
    assert (cfg.ema.decay, cfg.ema.warmup, cfg.trainer.precision) == (0.9999, False, "bf16")
    assert cfg.trainer.channels_last and cfg.trainer.cpu_threads is None
    assert cfg.aug.auto_augment == "rand-m9-mstd0.5-inc1"  # aug's default is ImageNet's too


def test_the_default_is_still_the_digits_recipe():
    cfg = compose_cfg([])
    check_train_config(cfg, check_paths=False)
    assert (cfg.name, cfg.recipe, cfg.data.name, cfg.model.name) == ("digits", "digits", "digits", "gspn2_micro")
    assert (cfg.optim.lr_base_size, cfg.trainer.precision, cfg.aug.hflip) == (64, "fp32", 0.0)
