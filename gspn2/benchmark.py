"""Helpers shared by the scripts: timing (scripts/bench_models.py, scripts/bench_step.py; kernel time from a CUDA
graph for scripts/bench_dwconv.py), the device's copy rate (the bandwidth floors of scripts/bench_op.py and
scripts/bench_gelu_linear.py), the arguments and the forward / forward + backward timing of the fused-op
benchmarks (scripts/bench_merge.py, scripts/bench_gelu_linear.py), a GSPN-2 model's depthwise convolution shapes (scripts/bench_dwconv.py,
scripts/gpu_profile.py), the ``--aot-config`` option (scripts/bench_models.py, scripts/activation_memory.py),
image-size arguments (scripts/count.py, scripts/receptive_field.py) and the benchmarked model step
(scripts/bench_models.py, scripts/ab_compile.py)."""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from gspn2 import inductor
from gspn2.ops.dwconv import FAMILIES
from gspn2.ops.options import DWCONV_TILE_COLS

__all__ = [
    "DWCONV_VARIANTS", "TINY_STAGES", "aot_config", "copy_bandwidth", "cudagraph_ms", "dwconv_shapes",
    "dwconv_variant_options", "fused_op_args", "fwd_and_fwd_bwd_ms", "graph_ms", "median_ms", "model_at",
    "model_step", "parse_image_size", "selected_stages",
]


def copy_bandwidth() -> float:
    """The CUDA device's copy rate in bytes/s (bytes read plus bytes written), from a device-to-device copy of a
    2 GiB float32 buffer of random values (median of ``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    n = 1 << 29
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = float(do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median"))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3)


def fused_op_args(script: str, description: str, argv=None) -> argparse.Namespace:
    """The arguments of a fused-op benchmark (``--batch``, ``--dtype``, ``--sweep``, ``--json``, ``--sides``),
    checked before anything runs; exits naming ``script`` without a CUDA GPU."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels over launch configurations")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--sides", type=int, nargs="+", default=None, metavar="SIDE",
                        help="only the stages with these feature-map sides (56, 28, 14, 7); default: all four")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.sides is not None and not set(args.sides) <= {56, 28, 14, 7}:
        parser.error(f"--sides takes 56, 28, 14 and 7 (gspn2_tiny's stages at 224^2), got {args.sides}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    return args


#: gspn2_tiny's stages at 224^2: (side of the feature map, channels C) (the fused-op benchmarks' shapes).
TINY_STAGES = ((56, 80), (28, 160), (14, 320), (7, 640))


def selected_stages(sides) -> list[tuple[int, int]]:
    """The ``(side, C)`` entries of :data:`TINY_STAGES` whose side is in ``sides`` (all of them for None)."""
    return [st for st in TINY_STAGES if sides is None or st[0] in sides]


def cudagraph_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of one call of ``fn`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``,
    50 ms of replays): kernel time without the host's."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def fwd_and_fwd_bwd_ms(fn: Callable[[], torch.Tensor], leaves, dtype: torch.dtype) -> tuple[float, float]:
    """Median milliseconds of CUDA-graph replays (``triton.testing.do_bench_cudagraph``) of ``fn()`` under
    ``dtype`` autocast without autograd, and of ``fn()`` with the gradients of ``leaves`` (from ones). Both
    run once first, outside the capture (compilation, autograd's first run)."""

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            fn()

    def fwd_bwd():
        with torch.autocast("cuda", dtype=dtype):
            out = fn()
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    fwd_bwd()
    fwd()
    return cudagraph_ms(fwd), cudagraph_ms(fwd_bwd)


def median_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool | None = None) -> float:
    """Median milliseconds of one call of ``fn`` after ``warmup`` untimed calls.

    On CUDA (``cuda=None``: whenever a GPU is present) each call is timed with a pair of CUDA events on the
    current stream and synchronised, so the figure is device time including the launches; otherwise with
    ``time.perf_counter``.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"`warmup` must be >= 0 and `iters` >= 1, got {warmup} and {iters}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn: Callable[[], object], reps: int = 20, iters: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of one call of ``fn`` on the GPU, without its host cost.

    ``fn`` runs ``warmup`` times on a side stream, then ``reps`` calls are captured in one CUDA graph, and the
    graph's replay is timed (``median_ms``, ``iters`` replays) and divided by ``reps``: kernel time and the
    gaps between kernels, not Python or dispatcher time. ``fn`` must be capturable (no host synchronisation,
    no CPU tensors); it runs ``warmup + reps`` times from Python.
    """
    if reps < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"`reps` and `iters` must be >= 1 and `warmup` >= 0, got {reps}, {iters} and {warmup}")
    if not torch.cuda.is_available():
        raise RuntimeError("graph_ms needs a CUDA GPU (torch.cuda.is_available() is False)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs documents
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return median_ms(graph.replay, 1, iters, cuda=True) / reps


def dwconv_shapes(model: str, resolution: int) -> list[tuple[int, int, int, bool, int]]:
    """``(channels, side, kernel, add_input, calls)`` of each distinct depthwise convolution of a GSPN-2 model
    (timm name) at a square input: per stage, the local perception units' 3x3 ``x + conv(x)`` (two per block)
    and the mixer's 7x7 ``conv(x)`` (one per block), with how many times one forward pass calls it."""
    import timm

    net = timm.create_model(model)
    stages = getattr(net, "stages", None)
    if stages is None or not hasattr(stages[0].blocks[0], "lpu1"):
        raise ValueError(f"dwconv_shapes: `model` must be a GSPN-2 model, got {model!r}")
    shapes = []
    side = ((resolution - 1) // 2) // 2 + 1  # the stem: two 3x3 stride-2 convolutions, padding 1
    for i, stage in enumerate(stages):
        if i > 0:
            side = (side - 2) // 2 + 1  # a 2x2 stride-2 downsampler
        block, n = stage.blocks[0], len(stage.blocks)
        lpu, dw = block.lpu1.conv, block.mixer.conv_dw
        shapes.append((lpu.in_channels, side, lpu.kernel_size[0], True, 2 * n))
        shapes.append((dw.in_channels, side, dw.kernel_size[0], False, n))
    return shapes


#: The depthwise kernel variants by name, ``t<kernel>v<cols>``: the op's ``kernel`` argument (0 ``tile``, the
#: input- and weight-gradient kernels; 1 ``fused``, the one-pass backward; 2 ``mma``, the tensor-core forward
#: and input gradient, 16-bit only; gspn2.ops.dwconv.FAMILIES) and the tile kernels' output columns per thread.
DWCONV_VARIANTS = tuple(f"t{k}v{c}" for k in range(len(FAMILIES)) for c in DWCONV_TILE_COLS)


def dwconv_variant_options(name: str) -> dict:
    """The gspn2 options (:func:`gspn2.ops.options.set_options`) that select depthwise variant ``name``
    (:data:`DWCONV_VARIANTS`; ``""`` or ``"auto"``: ``dwconv_kernel="auto"``)."""
    if name in ("", "auto"):
        return {"dwconv_kernel": "auto"}
    if name not in DWCONV_VARIANTS:
        raise ValueError(f"a depthwise variant must be auto or one of {', '.join(DWCONV_VARIANTS)}, got {name!r}")
    return {"dwconv_kernel": FAMILIES[int(name[1])], "dwconv_tile_cols": int(name[3])}


def _config_items(items: list[str], config, flag: str) -> dict:
    """``["key=value", ...]`` -> ``{key: value}`` for the torch config module ``config`` (``key`` may be
    dotted: ``triton.unique_kernel_names``). Values are Python literals. Raises ``ValueError`` naming ``flag``
    and the item for a malformed item, an unknown key or a value that is not a literal."""
    import ast

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        target = config
        *path, attr = key.split(".")
        for part in path:
            target = getattr(target, part, None)
        if target is None or not hasattr(target, attr):
            raise ValueError(f"{flag}: {config.__name__} has no {key!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{flag} {key}: {value!r} is not a Python literal") from None
    return out


def aot_config(items: list[str]) -> dict:
    """``["key=value", ...]`` -> ``{key: value}`` for ``torch._functorch.config.patch`` (the settings of
    AOTAutograd's partitioner, which decides what a compiled model saves for backward and what it
    recomputes). Values are Python literals. Raises ``ValueError`` naming the item for a malformed item,
    an unknown key or a value that is not a literal.
    """
    import torch._functorch.config as config

    return _config_items(items, config, "--aot-config")


def inductor_config(items: list[str]) -> dict:
    """``["key=value", ...]`` -> ``{key: value}`` for ``torch._inductor.config.patch`` (dotted keys for its
    sub-configs: ``triton.mix_order_reduction_split_size=128``), checked as ``aot_config`` checks."""
    import torch._inductor.config as config

    return _config_items(items, config, "--inductor")


def parse_image_size(text: str) -> tuple[int, int]:
    """argparse type: ``"32"`` -> (32, 32); ``"24x40"`` -> (24, 40) (H x W), positive ints."""
    parts = text.lower().split("x")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or HxW with positive ints, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected N or HxW with positive ints, got {text!r}")
    return values  # type: ignore[return-value]


def model_at(name: str, resolution: int) -> torch.nn.Module:
    """timm model ``name`` with 1000 classes, built for ``resolution`` where the model fixes its grid at
    construction (Swin's windows, DeiT's and ViT's patch grid; other models run at any size)."""
    import timm

    kwargs = {}
    if name.startswith(("swin", "deit", "vit")) and resolution != 224:
        kwargs["img_size"] = resolution
    return timm.create_model(name, num_classes=1000, **kwargs)


def model_step(
    name: str, task: str, resolution: int, batch: int, compile_mode: str | None = None, device: str = "cuda"
) -> tuple[Callable[[], None], torch.nn.Module]:
    """The benchmarked step of model ``name`` and the model: ``task="infer"`` one forward under
    ``inference_mode``; ``"train"`` forward, cross-entropy, backward, AdamW step (fused on CUDA; lr 1e-4,
    weight decay 0.05) and ``zero_grad``; bf16 autocast, channels_last, random inputs of ``batch`` images at
    ``resolution``^2. ``compile_mode``: ``torch.compile``'s ``mode`` for the model, or None (eager)."""
    if task not in ("infer", "train"):
        raise ValueError(f"`task` must be 'infer' or 'train', got {task!r}")
    train = task == "train"
    model = model_at(name, resolution).to(device).train(train).to(memory_format=torch.channels_last)
    fwd = inductor.compile(model, mode=compile_mode) if compile_mode is not None else model
    if not train:
        x = torch.randn(batch, 3, resolution, resolution, device=device).to(memory_format=torch.channels_last)

        def infer() -> None:
            with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16):
                fwd(x)

        return infer, model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=device == "cuda")
    x = torch.randn(batch, 3, resolution, resolution, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return train_step, model
