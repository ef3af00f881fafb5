"""Receptive-field pictures: the exact dependency cones of the propagation op, and the effective
receptive field (ERF) of a model or a train.py checkpoint, side by side with any timm model.

    python scripts/receptive_field.py op --size 33 --out cones.png                 # global scan, centre pixel
    python scripts/receptive_field.py op --size 48x64 --pixel 10 40 --chunk 8 --gates random --out cones.png
    python scripts/receptive_field.py model --models gspn2_micro convnext_atto --img-size 64 --out erf.png
    python scripts/receptive_field.py model --checkpoints runs/digits/<time>/best.pt --models convnext_atto \\
        --data data/digits/val --img-size 48 --stage 2 --out erf.png
    python scripts/receptive_field.py model --models gspn2_tiny swin_tiny_patch4_window7_224 \\
        --img-size 224 --batch 64 --device cuda --out erf.png

Each run writes the PNG named by ``--out`` and its numbers next to it (same name, ``.json``). Every
argument is checked, and every model built and run once at the chosen size, before anything is written.

**op**: one channel through ``gspn2.ops.gspn_propagate`` in float64 with ``lam = 1``; for each direction
``d`` the map is ``|d h_d[pixel] / d x|``. The normalised gate weights are positive and the gradient is a
sum of products of weights along chains of neighbour steps, so it is nonzero exactly where an input
reaches the pixel: its support is the exact region. (The run refuses sizes and gates for which such a
product could underflow float64 and fake a zero.) The union panel counts, per input, how many of the
four directions reach the pixel.

**model**: the mean over a batch of images of ``sum_rgb |d s / d image|``, with ``s`` the sum over
channels of the chosen stage's feature at the centre of its map (row ``h // 2``, column ``w // 2``), the
model in eval mode. The images are a data folder (every image file below it, read with the evaluation
transform of each model's own data config) or standard-normal noise in the normalised input space, the
same for every model; ``--seed`` seeds the random-init weights, the noise and the choice of images. The
area fraction of ``p`` (50% and 90%) is the smallest share of the image's pixels that holds ``p`` of the
map's total, the pixels taken largest first.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gspn2.benchmark import parse_image_size as parse_size

DIRECTIONS = ("left->right", "right->left", "top->bottom", "bottom->top")
GATE_CHOICES = ("uniform", "random")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
MASS_LEVELS = (0.5, 0.9)
#: Smallest positive float64 product the op-mode support test trusts (well above the subnormals).
_FLOAT64_SAFE = 1e-290


# --------------------------------------------------------------------------------------- arguments


def _png_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--out must name a .png file (the JSON goes next to it), got {out!r}")
    for target in (path, path.with_suffix(".json")):
        if target.exists() and not target.is_file():
            raise ValueError(f"--out {out!r}: {str(target)!r} exists and is not a file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {out!r}: {str(parent)!r} is not a directory")
            break
    return path


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise ValueError(f"--device {text!r} is not a torch device ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    return device


# ---------------------------------------------------------------------------------------- op mode


@dataclass
class OpCones:
    """Gradient maps ``(4, H, W)`` of one output pixel of every direction with respect to ``x``."""

    grads: torch.Tensor
    pixel: tuple[int, int]
    chunk: int | None
    gates: str

    @property
    def regions(self) -> torch.Tensor:
        """``(4, H, W)`` bool: which inputs reach the pixel in each direction."""
        return self.grads != 0

    @property
    def union(self) -> torch.Tensor:
        """``(H, W)`` bool: inputs that reach the pixel in at least one direction."""
        return self.regions.any(dim=0)


def make_gates(kind: str, size: tuple[int, int], seed: int) -> torch.Tensor:
    """Gate logits ``(1, 4, 3, 1, H, W)`` in float64: ``uniform`` (all zero, so every row of the transition
    is flat), ``random`` (standard normal, seeded) or a path to a ``torch.save``'d tensor of shape
    ``(4, 3, H, W)`` or ``(1, 4, 3, 1, H, W)``."""
    H, W = size
    if kind == "uniform":
        return torch.zeros(1, 4, 3, 1, H, W, dtype=torch.float64)
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(1, 4, 3, 1, H, W, generator=g, dtype=torch.float64)
    path = Path(kind)
    if not path.is_file():
        raise ValueError(f"--gates must be one of {GATE_CHOICES} or an existing .pt file, got {kind!r}")
    try:
        gates = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"--gates {kind!r} could not be read as a tensor file ({type(e).__name__}: {first})"
        ) from e
    if not isinstance(gates, torch.Tensor) or not gates.is_floating_point():
        raise ValueError(f"--gates {kind!r} must hold one floating-point tensor, got {type(gates).__name__}")
    if tuple(gates.shape) == (4, 3, H, W):
        gates = gates[None, :, :, None]
    if tuple(gates.shape) != (1, 4, 3, 1, H, W):
        raise ValueError(
            f"--gates {kind!r} has shape {tuple(gates.shape)}; --size {H}x{W} needs (4, 3, {H}, {W}) "
            f"or (1, 4, 3, 1, {H}, {W})"
        )
    if not torch.isfinite(gates).all():
        raise ValueError(f"--gates {kind!r} holds non-finite values")
    return gates.to(torch.float64)


def _smallest_path_log10(gates: torch.Tensor, size: tuple[int, int], chunk: int | None) -> float:
    """log10 of a lower bound of every nonzero entry of the op-mode gradient: the smallest normalised weight
    of a neighbour inside the line, to the power of the longest run of steps without a restart."""
    from gspn2.ops.reference import normalize_gates

    smallest = math.inf
    # normalize_gates wants the line on dim -2: lines are columns for directions 0/1, rows for 2/3.
    for g in (gates[:, :2], gates[:, 2:].transpose(-1, -2)):
        w = normalize_gates(g)
        inside = normalize_gates(torch.zeros_like(g)) > 0  # offsets that lie inside the line
        smallest = min(smallest, w[inside].min().item())
    steps = max(size) if chunk is None else min(max(size), chunk)
    if steps == 1:
        return 0.0
    return -math.inf if smallest == 0 else (steps - 1) * math.log10(smallest)


def check_op_args(
    size: tuple[int, int], pixel: tuple[int, int], chunk: int | None, gates: str, seed: int
) -> torch.Tensor:
    """Validate an op-mode request; returns the gate logits (see :func:`make_gates`)."""
    H, W = size
    i, j = pixel
    if not (0 <= i < H and 0 <= j < W):
        raise ValueError(f"--pixel ({i}, {j}) lies outside the {H}x{W} image")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"--chunk must be an int >= 1, got {chunk!r}")
    g = make_gates(gates, size, seed)
    bound = _smallest_path_log10(g, size, chunk)
    if bound < math.log10(_FLOAT64_SAFE):
        raise ValueError(
            f"--size {H}x{W} with these --gates: a reaching product can be as small as 1e{bound:.0f}, "
            "below what float64 represents safely, so a zero gradient would not prove 'unreached'; "
            "use a smaller --size, a --chunk or flatter gates"
        )
    return g


def op_cones(
    size: tuple[int, int], pixel: tuple[int, int], chunk: int | None, gates: str = "uniform", seed: int = 0
) -> OpCones:
    """The exact dependency region of ``pixel`` per direction (see the module docstring)."""
    from gspn2.ops import gspn_propagate

    g = check_op_args(size, pixel, chunk, gates, seed)
    H, W = size
    i, j = pixel
    x = torch.zeros(1, 1, H, W, dtype=torch.float64, requires_grad=True)
    lam = torch.ones(1, 4, 1, H, W, dtype=torch.float64)
    h = gspn_propagate(x, lam, g, chunk=chunk)
    grads = []
    for d in range(4):
        (gx,) = torch.autograd.grad(h[0, d, 0, i, j], x, retain_graph=d < 3)
        grads.append(gx[0, 0].abs())
    return OpCones(torch.stack(grads), (i, j), chunk, gates)


def op_summary(cones: OpCones) -> dict[str, Any]:
    H, W = cones.grads.shape[-2:]
    per_dir = []
    for d, name in enumerate(DIRECTIONS):
        region = cones.regions[d]
        rows = region.any(dim=1).nonzero().flatten()
        cols = region.any(dim=0).nonzero().flatten()
        per_dir.append(
            {
                "direction": d,
                "scan": name,
                "pixels": int(region.sum()),
                "fraction": float(region.double().mean()),
                "rows": [int(rows.min()), int(rows.max())],
                "cols": [int(cols.min()), int(cols.max())],
            }
        )
    return {
        "mode": "op",
        "size": [H, W],
        "pixel": list(cones.pixel),
        "chunk": cones.chunk,
        "gates": cones.gates,
        "directions": per_dir,
        "union_pixels": int(cones.union.sum()),
        "union_fraction": float(cones.union.double().mean()),
    }


def plot_op(cones: OpCones):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    H, W = cones.grads.shape[-2:]
    i, j = cones.pixel
    fig = plt.figure(figsize=(14.5, 3.4))
    grid = fig.add_gridspec(
        1,
        7,
        width_ratios=[1, 1, 1, 1, 0.05, 1, 0.05],
        left=0.01,
        right=0.95,
        bottom=0.03,
        top=0.78,
        wspace=0.12,
    )
    axes = [fig.add_subplot(grid[0, k]) for k in (0, 1, 2, 3, 5)]
    # Decades below each direction's largest influence, on one scale for the four; unreached inputs are
    # masked (grey), not clipped.
    logs = torch.where(
        cones.regions, torch.log10(cones.grads / cones.grads.amax(dim=(1, 2), keepdim=True)), float("nan")
    )
    vmin = min(-1.0, float(logs.nan_to_num(0.0).min()))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e0e0e0")
    for d, ax in enumerate(axes[:4]):
        im = ax.imshow(logs[d].numpy(), cmap=cmap, interpolation="nearest", vmin=vmin, vmax=0)
        frac = cones.regions[d].double().mean().item()
        ax.set_title(f"d={d} {DIRECTIONS[d]}\nreaches {100 * frac:.1f}% of inputs", fontsize=9)
    cbar = fig.colorbar(im, cax=fig.add_subplot(grid[0, 4]))
    cbar.set_label("log10 |grad| / max", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    counts = cones.regions.sum(dim=0)
    union_cmap = ListedColormap(["#e0e0e0", "#c6dbef", "#6baed6", "#2171b5", "#08306b"])
    im_u = axes[4].imshow(counts.numpy(), cmap=union_cmap, vmin=-0.5, vmax=4.5, interpolation="nearest")
    axes[4].set_title(
        f"union of the four\nreaches {100 * cones.union.double().mean().item():.1f}% of inputs", fontsize=9
    )
    cbar = fig.colorbar(im_u, cax=fig.add_subplot(grid[0, 6]), ticks=range(5))
    cbar.set_label("directions reaching", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    for ax in axes:
        ax.plot([j], [i], marker="x", color="red", markersize=7, mew=2)
        ax.set_xticks([])
        ax.set_yticks([])
    scan = "global scan" if cones.chunk is None else f"chunk={cones.chunk}"
    fig.suptitle(
        f"gspn_propagate: inputs that reach output pixel (row {i}, col {j}) (red x), {H}x{W}, {scan}, "
        f"{cones.gates} gates",
        fontsize=10,
    )
    return fig


# ------------------------------------------------------------------------------------- model mode


@dataclass
class Panel:
    """One model of a model-mode run, built and ready: the ERF of its ``stage`` is computed on ``device``."""

    label: str
    source: str
    caption: str  # the weights, short, for the picture
    model: torch.nn.Module
    stage: int
    num_stages: int
    data: SimpleNamespace  # mean, std, crop_pct, interpolation of the model's own data config
    info: dict[str, Any] = field(default_factory=dict)


def _stage_index(name: str, model: torch.nn.Module, stage: int) -> tuple[int, int]:
    if not hasattr(model, "forward_intermediates"):
        raise ValueError(
            f"{name} has no forward_intermediates(), so its stages cannot be read; pick another model"
        )
    feature_info = getattr(model, "feature_info", None)
    if not feature_info:
        raise ValueError(f"{name} has no feature_info, so its stages are not known; pick another model")
    n = len(feature_info)
    if not -n <= stage < n:
        raise ValueError(
            f"--stage {stage} is out of range for {name}, which has {n} stages (0..{n - 1} or -{n}..-1)"
        )
    return stage % n, n


def _data_of(cfg: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        mean=list(cfg["mean"]),
        std=list(cfg["std"]),
        crop_pct=cfg["crop_pct"],
        interpolation=cfg["interpolation"],
    )


def build_timm_panel(name: str, img_size: tuple[int, int], stage: int, pretrained: bool) -> Panel:
    import timm
    from timm.data import resolve_data_config

    import gspn2  # noqa: F401  (registers the gspn2_* models with timm)

    if not timm.is_model(name):
        raise ValueError(f"--models: {name!r} is not a registered timm model")
    kwargs: dict[str, Any] = {}
    pretrained_cfg = timm.models.get_pretrained_cfg(name)
    # Models with a fixed input size (ViT, Swin) take the size at construction; the others take any size.
    if pretrained_cfg is not None and getattr(pretrained_cfg, "fixed_input_size", False):
        kwargs["img_size"] = img_size
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(
            f"timm could not build {name} for --img-size {img_size[0]}x{img_size[1]}: {e}"
        ) from e
    stage, n = _stage_index(name, model, stage)
    data = _data_of(resolve_data_config({}, model=model))
    weights = "pretrained" if pretrained else "random init"
    return Panel(name, f"timm, {weights}", weights, model, stage, n, data)


def build_checkpoint_panel(path: str, stage: int, ema: bool) -> tuple[Panel, int]:
    """A train.py checkpoint's model (through the project's loader); also returns its training image size."""
    from omegaconf import OmegaConf

    import gspn2  # noqa: F401
    from gspn2.train.build import build_model
    from gspn2.train.checkpoint import CheckpointError, load_checkpoint, load_model_state

    ckpt = load_checkpoint(path)
    train_cfg = OmegaConf.create(ckpt["config"])
    train_cfg.model.pretrained = False  # the checkpoint supplies the weights
    model = build_model(train_cfg.model, train_cfg.data.num_classes)
    if ema and ckpt.get("ema") is None:
        raise CheckpointError(f"--ema but checkpoint {path!r} holds no EMA weights")
    load_model_state(model, ckpt["ema"] if ema else ckpt["model"], path, what="EMA" if ema else "model")
    name = train_cfg.model.name
    stage, n = _stage_index(f"{name} of {path}", model, stage)
    td = train_cfg.data
    data = SimpleNamespace(
        mean=list(td.mean), std=list(td.std), crop_pct=td.crop_pct, interpolation=td.interpolation
    )
    weights = "EMA" if ema else "model"
    source = f"{path}, {weights} weights, epoch {ckpt['epoch']}"
    caption = f"trained, epoch {ckpt['epoch']} at {td.img_size}px" + (", EMA" if ema else "")
    return Panel(name, source, caption, model, stage, n, data), int(td.img_size)


def list_images(folder: str) -> list[Path]:
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--data {folder!r} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"--data {folder!r} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    return files


def pick_images(files: Sequence[Path], batch: int, seed: int, folder: str) -> list[Path]:
    """``batch`` distinct files, a seeded random choice (all of them when there are exactly ``batch``)."""
    if len(files) < batch:
        raise ValueError(f"--batch {batch} needs {batch} images but --data {folder!r} holds {len(files)}")
    g = torch.Generator().manual_seed(seed)
    keep = torch.randperm(len(files), generator=g)[:batch].sort().values.tolist()
    return [files[k] for k in keep]


def load_images(files: Sequence[Path], img_size: tuple[int, int], data: SimpleNamespace) -> torch.Tensor:
    """The evaluation transform of ``data`` (resize, centre crop, normalise) at ``img_size``, stacked."""
    from PIL import Image

    from gspn2.train.data import build_transform

    cfg = SimpleNamespace(img_size=img_size, **vars(data))
    transform = build_transform(cfg, None, is_training=False)
    out = []
    for f in files:
        with Image.open(f) as im:
            out.append(transform(im.convert("RGB")))
    return torch.stack(out)


def noise_images(batch: int, img_size: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *img_size, generator=g)


def _stage_output(panel: Panel, x: torch.Tensor) -> torch.Tensor:
    (feat,) = panel.model.forward_intermediates(
        x, indices=[panel.stage], intermediates_only=True, stop_early=True
    )
    return feat


def probe_stage(panel: Panel, img_size: tuple[int, int], device: torch.device) -> None:
    """Run one zero image up to the stage on ``device``, so that a size the model cannot take, or a stage
    without a spatial map, fails as an argument error; fills ``panel.info`` with the stage's geometry."""
    model = panel.model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        with torch.no_grad():
            feat = _stage_output(panel, torch.zeros(1, 3, *img_size, device=device))
    except (RuntimeError, ValueError) as e:  # a conv that cannot run, or the model's own size check
        raise ValueError(
            f"{panel.label} cannot run at --img-size {img_size[0]}x{img_size[1]} up to stage {panel.stage}: "
            f"{str(e).splitlines()[0]}"
        ) from e
    if feat.ndim != 4:
        raise ValueError(
            f"{panel.label}: stage {panel.stage} gives a {feat.ndim}-D output, not a (B, C, h, w) map"
        )
    _, C, h, w = feat.shape
    panel.info = {"channels": C, "feature_size": [h, w], "centre": [h // 2, w // 2]}


def erf_map(panel: Panel, images: torch.Tensor, device: torch.device, micro_batch: int) -> torch.Tensor:
    """Mean over ``images`` of ``sum_rgb |d s / d image|`` (``s``: centre feature of the stage, summed over
    channels), as a float64 ``(H, W)`` map on the CPU. Call :func:`probe_stage` first."""
    model = panel.model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ci, cj = panel.info["centre"]
    total = torch.zeros(images.shape[-2:], dtype=torch.float64)
    for start in range(0, len(images), micro_batch):
        x = images[start : start + micro_batch].to(device).requires_grad_(True)
        feat = _stage_output(panel, x)
        # In eval mode the images do not interact, so one backward of the batch sum gives each image's
        # own gradient.
        (grad,) = torch.autograd.grad(feat[:, :, ci, cj].sum(), x)
        total += grad.abs().sum(dim=1).sum(dim=0).to("cpu", torch.float64)
    return total / len(images)


def area_fractions(erf: torch.Tensor, levels: Sequence[float] = MASS_LEVELS) -> dict[str, Any]:
    """Smallest share of pixels holding each level of the map's mass, and the value each region starts at."""
    flat = erf.flatten().double()
    total = flat.sum()
    if not total > 0:
        raise ValueError(
            "the ERF map is zero everywhere: the chosen stage's centre does not depend on the input"
        )
    values, _ = flat.sort(descending=True)
    cum = values.cumsum(0) / total
    out: dict[str, Any] = {}
    for p in levels:
        # First k with cum[k-1] >= p; min() keeps k in range should rounding leave cum[-1] just below p.
        k = min(int(torch.searchsorted(cum, torch.tensor([p], dtype=cum.dtype)).item()) + 1, flat.numel())
        out[f"{round(100 * p)}"] = {
            "fraction": k / flat.numel(),
            "pixels": k,
            "threshold": float(values[k - 1]),
        }
    return out


def plot_model(
    panels: Sequence[Panel], maps: Sequence[torch.Tensor], fractions: Sequence[dict[str, Any]], title: str
):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    width = 3.4 * n + 0.9
    fig, axes = plt.subplots(1, n, figsize=(width, 4.0), squeeze=False)
    axes = axes[0]
    fig.subplots_adjust(left=0.01, right=1 - 0.9 / width, bottom=0.02, top=0.78, wspace=0.1)
    for ax, panel, m, fr in zip(axes, panels, maps, fractions):
        shown = torch.log10(torch.clamp_min(m / m.max(), 1e-4))
        im = ax.imshow(shown.numpy(), cmap="magma", vmin=-4, vmax=0, interpolation="nearest")
        h, w = panel.info["feature_size"]
        stride = panel.model.feature_info[panel.stage].get("reduction", "?")
        ax.set_title(
            f"{panel.label}, {panel.caption}\nstage {panel.stage} (stride {stride}, {h}x{w} map)\n"
            f"50% of mass in {100 * fr['50']['fraction']:.1f}%, "
            f"90% in {100 * fr['90']['fraction']:.1f}% of image",
            fontsize=8,
        )
        ax.set_xticks([])
        ax.set_yticks([])
    cax = fig.add_axes([1 - 0.75 / width, 0.08, 0.12 / width, 0.64])
    cbar = fig.colorbar(im, cax=cax)
    cbar.set_label("log10 ERF / max", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9.5)
    return fig


# ------------------------------------------------------------------------------------------ driver


def _write(fig, png: Path, summary: dict[str, Any]) -> Path:
    import matplotlib.pyplot as plt

    from gspn2.train.checkpoint import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(png, buf.getvalue())
    js = png.with_suffix(".json")
    atomic_write_bytes(js, (json.dumps(summary, indent=2) + "\n").encode())
    return js


def prepare_op_run(args: argparse.Namespace):
    """Every check of op mode; nothing is written here."""
    png = _png_path(args.out)
    size = args.size
    pixel = tuple(args.pixel) if args.pixel is not None else (size[0] // 2, size[1] // 2)
    check_op_args(size, pixel, args.chunk, args.gates, args.seed)
    return png, size, pixel


def run_op(args: argparse.Namespace, prepared=None) -> dict[str, Any]:
    png, size, pixel = prepared or prepare_op_run(args)
    cones = op_cones(size, pixel, args.chunk, args.gates, args.seed)
    summary = op_summary(cones)
    summary["seed"] = args.seed
    fig = plot_op(cones)
    js = _write(fig, png, summary)
    for row in summary["directions"]:
        print(
            f"direction {row['direction']} ({row['scan']}): reaches {row['pixels']} inputs "
            f"({100 * row['fraction']:.1f}%), rows {row['rows']}, cols {row['cols']}"
        )
    print(
        f"union: {summary['union_pixels']} of {size[0] * size[1]} inputs "
        f"({100 * summary['union_fraction']:.1f}%)"
    )
    print(png)
    print(js)
    return summary


def prepare_model_run(args: argparse.Namespace):
    """Every check and every model build of model mode; nothing is written here."""
    png = _png_path(args.out)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if not args.models and not args.checkpoints:
        raise ValueError("give at least one of --models NAME ... or --checkpoints PATH ...")
    if args.ema and not args.checkpoints:
        raise ValueError("--ema needs --checkpoints: a timm model by name has no EMA weights")
    device = _device(args.device)
    files = None
    if args.data is not None:
        files = pick_images(list_images(args.data), args.batch, args.seed, args.data)
    # Seeded before any model is built: random-init weights, noise and image choice all follow --seed.
    torch.manual_seed(args.seed)
    panels: list[Panel] = []
    ckpt_sizes = []
    for path in args.checkpoints:
        panel, size = build_checkpoint_panel(path, args.stage, args.ema)
        panels.append(panel)
        ckpt_sizes.append(size)
    img_size = args.img_size
    if img_size is None:
        if ckpt_sizes and len(set(ckpt_sizes)) > 1:
            raise ValueError(f"the checkpoints were trained at different sizes {ckpt_sizes}: pass --img-size")
        side = ckpt_sizes[0] if ckpt_sizes else 224
        img_size = (side, side)
    for name in args.models:
        panels.append(build_timm_panel(name, img_size, args.stage, args.pretrained))
    for panel in panels:
        probe_stage(panel, img_size, device)
    return png, device, files, img_size, panels


def run_model(args: argparse.Namespace, prepared=None) -> dict[str, Any]:
    png, device, files, img_size, panels = prepared or prepare_model_run(args)
    noise = None if files is not None else noise_images(args.batch, img_size, args.seed)
    maps, fractions, rows = [], [], []
    for panel in panels:
        images = load_images(files, img_size, panel.data) if files is not None else noise
        m = erf_map(panel, images, device, args.micro_batch or args.batch)
        fr = area_fractions(m)
        maps.append(m)
        fractions.append(fr)
        peak = divmod(int(m.argmax()), m.shape[1])
        rows.append(
            {
                "model": panel.label,
                "source": panel.source,
                "stage": panel.stage,
                "num_stages": panel.num_stages,
                "reduction": panel.model.feature_info[panel.stage].get("reduction"),
                **panel.info,
                "peak": list(peak),
                "area_fraction_50": fr["50"]["fraction"],
                "area_fraction_90": fr["90"]["fraction"],
                "pixels_50": fr["50"]["pixels"],
                "pixels_90": fr["90"]["pixels"],
            }
        )
        print(
            f"{panel.label} ({panel.source}), stage {panel.stage}: 50% of the ERF in "
            f"{100 * fr['50']['fraction']:.2f}% of the image, 90% in {100 * fr['90']['fraction']:.2f}%"
        )
    images_text = f"{args.batch} images of {args.data}" if files is not None else f"{args.batch} noise images"
    summary = {
        "mode": "model",
        "img_size": list(img_size),
        "images": images_text,
        "seed": args.seed,
        "device": str(device),
        "models": rows,
    }
    fig = plot_model(panels, maps, fractions, f"ERF at {img_size[0]}x{img_size[1]}, mean over {images_text}")
    js = _write(fig, png, summary)
    print(png)
    print(js)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)

    op = sub.add_parser("op", help="exact dependency cones of gspn_propagate for one pixel")
    op.add_argument("--size", type=parse_size, default=(33, 33), help="image size N or HxW (default 33)")
    op.add_argument(
        "--pixel", type=int, nargs=2, metavar=("ROW", "COL"), help="output pixel (default: centre)"
    )
    op.add_argument(
        "--chunk", type=int, default=None, help="restart the scan every CHUNK steps (default: global)"
    )
    op.add_argument("--gates", default="uniform", help="uniform, random, or a .pt tensor (4, 3, H, W)")
    op.add_argument("--seed", type=int, default=0, help="seed of --gates random")
    op.add_argument("--out", required=True, help="PNG path; the JSON is written next to it")

    model = sub.add_parser("model", help="effective receptive field of models and train.py checkpoints")
    model.add_argument(
        "--models", nargs="+", default=[], metavar="NAME", help="timm model names (gspn2_* too)"
    )
    model.add_argument("--checkpoints", nargs="+", default=[], metavar="PATH", help="train.py checkpoints")
    model.add_argument("--ema", action="store_true", help="the checkpoints' EMA weights")
    model.add_argument("--pretrained", action="store_true", help="timm's pretrained weights for --models")
    model.add_argument(
        "--stage", type=int, default=-1, help="stage (feature_info index) whose centre is used"
    )
    model.add_argument(
        "--img-size",
        type=parse_size,
        default=None,
        help="N or HxW (default: the checkpoints' training size, else 224)",
    )
    model.add_argument("--data", default=None, help="folder of images (searched recursively); default: noise")
    model.add_argument("--batch", type=int, default=16, help="images averaged over (default 16)")
    model.add_argument("--micro-batch", type=int, default=None, help="images per backward (default: --batch)")
    model.add_argument(
        "--seed", type=int, default=0, help="seed of random-init weights, noise and the choice of --data images"
    )
    model.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    model.add_argument("--out", required=True, help="PNG path; the JSON is written next to it")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from gspn2.train.checkpoint import CheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    # Argument errors print with the usage line; errors of the computation itself keep their traceback.
    try:
        prepared = prepare_op_run(args) if args.mode == "op" else prepare_model_run(args)
    except (ValueError, CheckpointError) as e:
        parser.error(str(e))
    return run_op(args, prepared) if args.mode == "op" else run_model(args, prepared)


if __name__ == "__main__":
    main(sys.argv[1:])
