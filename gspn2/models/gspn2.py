"""GSPN-2: vision backbones built on generalized spatial propagation with compact channel proxies.

A timm-style model family (blocks -> model -> init -> checkpoint filter -> builder -> cfgs -> registry)
for GSPN-2-T/S/B (``docs/spec.md``, section 2) plus ``gspn2_micro``, a few-hundred-thousand
parameter member for tests and CPU demos.

Every tensor is channel-first ``(B, C, H, W)``. No module stores an input resolution: the propagation
runs over whatever ``H, W`` reach it, so one model serves 224², 1024² and non-square inputs alike, and a
*global* layer (``chunk=None``) always scans the whole image.

Block (pre-norm residual, with GSPN-2's local perception units)::

    x = x + DWConv3x3(x)                              # LPU
    x = x + DropPath(mixer(LayerNorm2d(x)))
    x = x + DWConv3x3(x)                              # LPU
    x = x + DropPath(mlp(LayerNorm2d(x)))             # 1x1 conv, GELU, 1x1 conv, ratio 4

Mixer (``GSPN2Mixer``), ``C`` channels, ``E = mixer_ratio * C`` hidden, ``P = proxy_dim`` proxy
channels, ``K = affinity_groups``::

    v, z  = split(Conv1x1(x))                         # (B, E, H, W) each; z gates the output
    v     = SiLU(DWConv(v))
    p     = Conv1x1(v)                                # ONE conv: proxy, lambda, u, gate logits of 4 dirs
    h     = gspn_propagate(p_x, sigmoid(p_lam), p_gates, chunk)     # (B, 4, P, H, W), image frame
    y     = Conv1x1(concat_d(h_d * u_d)) + D * v      # 4 directions merged in the image frame, back to E
    out   = Conv1x1(LayerNorm2d(y) * SiLU(z))         # back to C

Speed (``docs/models.md``, "Speed"): with channels_last memory every 1x1 convolution is a GEMM on the
contiguous NHWC rows (``gspn2.layers.Conv1x1``), LayerNorms run in the activation dtype under autocast,
the local perception units are one ``gspn2.ops.depthwise_conv2d`` each (the residual added in the
kernel), and in training autograd functions fuse each LayerNorm into the GEMM after it and GELU into
``fc2``, recomputing the norms and activations in backward instead of saving them; the training mixer keeps
its tensors as channels-last rows between GEMMs, so that few views and permutes reach the dispatcher.
``tests/models/_reference.py`` builds the same function from plain torch and timm modules, loading the
same state dict: the oracle of the equivalence tests.
"""

# No ``from __future__ import annotations``: torch.fx copies the forward's annotations into the code it
# generates, and TorchScript (scripting an fx graph) needs them as real types, not strings.

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, LayerScale2d, NormMlpClassifierHead, register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, named_apply, register_model
from timm.models._features import feature_take_indices

from gspn2.layers import (
    ChunkedConv1x1,
    Conv1x1,
    LayerNorm2d,
    NormParams,
    PointwiseMlp,
    from_rows,
    norm_linear,
    recomputed_silu,
    rows_linear,
    to_rows,
)
from gspn2.layers._trace import fused_training
from gspn2.ops import depthwise_conv2d, gspn_propagate, merge_norm_gate
from gspn2.ops import options as _options

__all__ = ["GSPN2", "GSPN2Block", "GSPN2Mixer", "GSPN2Stage", "LocalPerceptionUnit"]

#: Number of propagation directions of :func:`gspn2.ops.gspn_propagate` (docs/spec.md, section 1).
NUM_DIRECTIONS = 4

# torch.fx leaves (timm's tracer and torchvision's feature extraction take timm's list; torch.fx.wrap below
# covers a plain torch.fx.symbolic_trace): the op entry points check their inputs in Python and choose a
# kernel at run time, which must happen when the graph runs, not once on Proxies.
register_notrace_function(gspn_propagate)
register_notrace_function(depthwise_conv2d)


def min_input_size(num_stages: int = 4) -> int:
    """Smallest height and width that ``num_stages`` stages can take: the stride-4 stem (two 3x3/2 convs
    with padding 1, ``ceil(H / 4)``) and a 2x2/2 downsampling before every later stage
    (``floor(h / 2) >= 1``), i.e. ``2 ** (num_stages + 1) - 3``: 29 for the four stages of every GSPN2."""
    return (4 << (num_stages - 1)) - 3  # a shift: TorchScript's int ** int is a float


@register_notrace_function
def check_input(x: torch.Tensor, in_chans: int, min_size: int) -> torch.Tensor:
    """Return ``x`` if it is a ``(B, in_chans, H, W)`` batch with ``B >= 1`` and ``H, W >= min_size``,
    else raise ``ValueError`` (``TypeError`` for a non-tensor) naming what is wrong.

    A ``torch.fx`` leaf (it runs when the traced graph runs) and scriptable; under ``torch.compile`` and
    ``torch.export`` the comparisons become guards on the symbolic sizes. The result is ``x`` itself, so
    the check stays on the data path of a traced graph instead of being dropped as dead code.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"GSPN2: the input `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"GSPN2: the input `x` must be a 4-D (B, C, H, W) batch, got {x.dim()}-D shape {list(x.shape)} "
            "(a single image needs x.unsqueeze(0))"
        )
    # Each size compared on its own: a comparison between sizes would tie a dynamic size to the others.
    if x.shape[0] < 1:
        raise ValueError(f"GSPN2: the input `x` has batch size 0 (shape {list(x.shape)}); B must be >= 1")
    if x.shape[1] != in_chans:
        raise ValueError(
            f"GSPN2: the input `x` has {x.shape[1]} channels (shape {list(x.shape)}), the model takes {in_chans}"
        )
    if x.shape[2] < min_size or x.shape[3] < min_size:
        raise ValueError(
            f"GSPN2: the input `x` is {x.shape[2]}x{x.shape[3]} (H x W); the model needs H, W >= {min_size} "
            "(a stride-4 stem and a stride-2 downsampling before each later stage)"
        )
    return x


@register_notrace_function
def propagate(x: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor, chunk: Optional[int]) -> torch.Tensor:
    """:func:`gspn2.ops.gspn_propagate`, also from TorchScript, which calls the registered op directly (with the
    planner's kernel choice: the process options of :mod:`gspn2.ops.options` are Python)."""
    if torch.jit.is_scripting():
        return torch.ops.gspn2.propagate(x, lam, gates, chunk, "auto", 0)
    return gspn_propagate(x, lam, gates, chunk)


@register_notrace_function
def depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], add_input: bool = False, silu: bool = False
) -> torch.Tensor:
    """:func:`gspn2.ops.depthwise_conv2d`; TorchScript computes the same function with ``F.conv2d``."""
    if torch.jit.is_scripting():
        y = F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=x.shape[1])
        if add_input:
            y = y + x
        return F.silu(y) if silu else y
    return depthwise_conv2d(x, weight, bias, add_input=add_input, silu=silu)


for _name in ("check_input", "propagate", "depthwise_conv"):
    torch.fx.wrap(_name)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")


def _check_chunk(name: str, value: object) -> None:
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be None (global) or an int >= 1 (local), got {value!r}")
        if value < 1:
            raise ValueError(f"`{name}` must be None (global) or an int >= 1 (local), got {value!r}")


class Stem(nn.Sequential):
    """Overlapping stride-4 stem: ``conv3x3/2 -> LayerNorm2d -> GELU -> conv3x3/2 -> LayerNorm2d``.

    A ``nn.Sequential`` (parameters ``stem.0``, ``stem.1``, ``stem.3``, ``stem.4``; timm's feature wrappers
    run its children in order), whose own forward gives the first norm and the GELU to one pass of gspn2's
    LayerNorm kernel where it runs (eager CUDA, :meth:`LayerNorm2d.forward_gelu`): the same function.

    Shapes: ``(B, in_chans, H, W) -> (B, out_chs, ceil(H / 4), ceil(W / 4))``.
    """

    def __init__(self, in_chans: int, mid_chs: int, out_chs: int) -> None:
        super().__init__(
            nn.Conv2d(in_chans, mid_chs, 3, stride=2, padding=1),
            LayerNorm2d(mid_chs),
            nn.GELU(),
            nn.Conv2d(mid_chs, out_chs, 3, stride=2, padding=1),
            LayerNorm2d(out_chs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self[0](x)
        if torch.jit.is_scripting():
            x = self[2](self[1](x))
        elif _fuses_gelu(self[1], self[2]):
            x = self[1].forward_gelu(x)
        else:  # other modules in their place (a test oracle's, a user's): run them
            x = self[2](self[1](x))
        return self[4](self[3](x))


def _fuses_gelu(norm: nn.Module, act: nn.Module) -> bool:
    """Whether ``act(norm(x))`` is :meth:`LayerNorm2d.forward_gelu`: gspn2's norm and an erf-form GELU."""
    return isinstance(norm, LayerNorm2d) and type(act) is nn.GELU and act.approximate == "none"


class LocalPerceptionUnit(nn.Module):
    """``x + DWConv(x)``: a cheap local-context residual in front of the mixer and the MLP.

    Shapes: ``(B, C, H, W) -> (B, C, H, W)``.
    """

    def __init__(self, dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        _check_positive_int("dim", dim)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"`kernel_size` must be a positive odd int, got {kernel_size!r}")
        self.conv = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One pass: the depthwise op adds the input (``self.conv`` holds the parameters, it is not called).
        return depthwise_conv(x, self.conv.weight, self.conv.bias, add_input=True)


class GSPN2Mixer(nn.Module):
    """GSPN-2 token mixer: four-direction line-scan propagation on a compact channel proxy.

    All four directions' gates, input gates and output gates come from one 1x1 convolution, are viewed
    (not copied) as ``(B, 4, ...)`` and go to a single ``gspn_propagate`` call; its output is already in
    the image frame, so merging is a channel concat plus a 1x1 convolution.

    Args:
        dim: Input and output channels ``C``.
        proxy_dim: Channels ``P`` that are propagated (GSPN-2's compact proxy; 2 in the paper).
        affinity_groups: Affinity groups ``K`` (``P % K == 0``); 1 shares one affinity over all channels.
        mixer_ratio: Hidden width ``E = round(mixer_ratio * C)`` of the value and gate branches.
        dw_kernel_size: Kernel of the depthwise convolution on the value branch.
        chunk: ``None`` for a global scan over the whole image, an int for local scans of that length.
    """

    def __init__(
        self,
        dim: int,
        proxy_dim: int = 2,
        affinity_groups: int = 1,
        mixer_ratio: float = 1.5,
        dw_kernel_size: int = 7,
        chunk: Optional[int] = None,
    ) -> None:
        super().__init__()
        _check_positive_int("dim", dim)
        _check_positive_int("proxy_dim", proxy_dim)
        _check_positive_int("affinity_groups", affinity_groups)
        if proxy_dim % affinity_groups != 0:
            raise ValueError(
                f"`affinity_groups` ({affinity_groups}) must divide `proxy_dim` ({proxy_dim})"
            )
        if mixer_ratio <= 0:
            raise ValueError(f"`mixer_ratio` must be > 0, got {mixer_ratio!r}")
        if dw_kernel_size < 1 or dw_kernel_size % 2 == 0:
            raise ValueError(f"`dw_kernel_size` must be a positive odd int, got {dw_kernel_size!r}")
        _check_chunk("chunk", chunk)
        hidden = max(1, int(round(mixer_ratio * dim)))
        self.proxy_dim = proxy_dim
        self.affinity_groups = affinity_groups
        self.num_directions = NUM_DIRECTIONS  # an attribute: TorchScript cannot read a module-level int
        self.chunk = chunk
        # Channel layout of the generator output: [proxy x | lambda (4 dirs) | u (4 dirs) | gates (4x3xK)].
        self.split_sizes = (
            proxy_dim,
            NUM_DIRECTIONS * proxy_dim,
            NUM_DIRECTIONS * proxy_dim,
            NUM_DIRECTIONS * 3 * affinity_groups,
        )

        # in_proj yields v and z from two GEMMs (one parameter, as the 1x1 conv it replaces).
        self.in_proj = ChunkedConv1x1(dim, 2 * hidden, out_chunks=2)
        self.conv_dw = nn.Conv2d(hidden, hidden, dw_kernel_size, padding=dw_kernel_size // 2, groups=hidden)
        self.act = nn.SiLU()
        self.generate = Conv1x1(hidden, sum(self.split_sizes))
        self.proj_up = Conv1x1(NUM_DIRECTIONS * proxy_dim, hidden)
        self.skip = nn.Parameter(torch.ones(hidden))
        self.norm = LayerNorm2d(hidden)
        self.out_proj = Conv1x1(hidden, dim)

    def forward(self, x: torch.Tensor, norm: Optional[NormParams] = None) -> torch.Tensor:
        """``(B, C, H, W) -> (B, C, H, W)``: the mixer of ``x``, calling its modules.

        With ``norm``, the ``(weight, bias, eps)`` of a LayerNorm over the channels, the mixer of the
        normalised ``x`` in the training formulation (:meth:`forward_fused`).

        1x1 convolutions are GEMMs on channels-last rows with the bias in the GEMM, ``v`` comes out of its
        own GEMM already contiguous for the depthwise convolution, the skip is one ``addcmul`` and the
        LayerNorm stays in the activation dtype.
        """
        if norm is not None:
            return self.forward_fused(x, norm)
        P, D = self.proxy_dim, self.num_directions
        v, z = self.in_proj(x)  # (B, E, H, W) each, channels_last memory
        v = depthwise_conv(v, self.conv_dw.weight, self.conv_dw.bias, silu=True)  # SiLU fused in inference
        xp, lam, u, gates = self.generate(v).split(self.split_sizes, dim=1)
        h = self._scan(xp, lam, gates)
        # u first: the product takes u's channels_last order, so the flatten is a view and proj_up's rows
        # are contiguous.
        y = (u.unflatten(1, (D, P)) * h).flatten(1, 2)  # (B, 4P, H, W)
        y = torch.addcmul(self.proj_up(y), v, self.skip.view(1, -1, 1, 1).to(v.dtype))
        # The scan's scale grows with the image: normalise before gating.
        return self.out_proj(self.norm(y) * self.act(z))

    def _scan(self, xp: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The propagation of the generator's proxy, lambda and gate slices: ``(B, 4, P, H, W)``."""
        P, K, D = self.proxy_dim, self.affinity_groups, self.num_directions
        # The op scans contiguous NCHW lines: copy the proxy-sized slices (P + 4P + 12K channels) once.
        # All three come from one GEMM, so they already share a dtype.
        lam = torch.sigmoid(lam.unflatten(1, (D, P)).contiguous())  # (B, 4, P, H, W)
        gates = gates.unflatten(1, (D, 3, K)).contiguous()  # (B, 4, 3, K, H, W)
        return propagate(xp.contiguous(), lam, gates, self.chunk)

    @torch.jit.unused
    def forward_fused(self, x: torch.Tensor, norm: NormParams) -> torch.Tensor:
        """The mixer of ``LayerNorm(x)`` (``norm``: its ``(weight, bias, eps)``) in the training formulation.

        The norm and ``in_proj``, and the output gate ``self.norm(y) * silu(z)`` and ``out_proj``, are each one
        :func:`~gspn2.layers.norm_linear`, which keeps only the norm's input (and the gate) for backward. With
        the option ``merge="fused"`` (:mod:`gspn2.ops.options`, read when the call is traced) ``proj_up``, the
        skip, the norm and the gate are one :func:`~gspn2.ops.merge_norm_gate` before ``out_proj`` instead.
        Everything between the GEMMs stays in channels-last rows ``(B*H*W, channels)`` except what needs the
        image: ``v`` for the depthwise convolution and the generator's slices for the scan. So ``z``, the
        ``proj_up`` output, the skip (a ``(E,)`` vector broadcast over rows, no view) and the gated norm's input
        never change layout, which keeps the dispatcher calls of forward and backward few. ``in_proj``,
        ``generate``, ``proj_up``, ``norm`` and ``out_proj`` hold the parameters and are not called (their
        forward hooks do not run). Not for ``torch.fx``, ``torch.jit.trace`` or TorchScript
        (:mod:`gspn2.layers._trace`).
        """
        B, _, H, W = x.shape
        P, D = self.proxy_dim, self.num_directions
        w, b = self.in_proj.weight.flatten(1), self.in_proj.bias
        v_rows, z_rows = norm_linear(to_rows(x), norm[0], norm[1], norm[2], w, b, chunks=2, gate=None)
        # SiLU as its own op, as depthwise_conv(silu=True) runs it where autograd records; the compiled
        # backward may recompute it (options.recompute).
        a = depthwise_conv(from_rows(v_rows, B, H, W), self.conv_dw.weight, self.conv_dw.bias)
        v = recomputed_silu(a)
        v_rows = to_rows(v)
        g = rows_linear(v_rows, self.generate.weight.flatten(1), self.generate.bias)
        xp, lam, u, gates = from_rows(g, B, H, W).split(self.split_sizes, dim=1)
        h = self._scan(xp, lam, gates)
        uh = to_rows((u.unflatten(1, (D, P)) * h).flatten(1, 2))  # a view: the product has u's row order
        w, b = self.out_proj.weight.flatten(1), self.out_proj.bias
        if _options.current().merge == "fused":
            # norm(proj_up(uh) + v * skip) * silu(z) in one op, then out_proj.
            m = merge_norm_gate(
                uh, self.proj_up.weight.flatten(1), self.proj_up.bias, v_rows, self.skip, self.norm.weight,
                self.norm.bias, self.norm.eps, z_rows,
            )
            return from_rows(rows_linear(m, w, b), B, H, W)
        y = rows_linear(uh, self.proj_up.weight.flatten(1), self.proj_up.bias, v_rows, self.skip)  # + v * skip
        (out,) = norm_linear(y, self.norm.weight, self.norm.bias, self.norm.eps, w, b, chunks=1, gate=z_rows)
        return from_rows(out, B, H, W)


class GSPN2Block(nn.Module):
    """Pre-norm residual block: LPU, GSPN-2 mixer, LPU, MLP.

    Args:
        dim: Channels ``C``.
        mlp_ratio: MLP hidden width as a multiple of ``C``.
        proxy_dim: Proxy channels of the mixer.
        affinity_groups: Affinity groups ``K`` of the mixer.
        mixer_ratio: Hidden width of the mixer as a multiple of ``C``.
        dw_kernel_size: Depthwise kernel of the mixer.
        lpu_kernel_size: Depthwise kernel of the two local perception units.
        chunk: ``None`` global, int local scan length.
        ls_init_value: Init of LayerScale on both residual branches; ``None`` disables it.
        drop_path: Stochastic depth rate of both residual branches.
    """

    def __init__(
        self,
        dim: int,
        mlp_ratio: float = 4.0,
        proxy_dim: int = 2,
        affinity_groups: int = 1,
        mixer_ratio: float = 1.5,
        dw_kernel_size: int = 7,
        lpu_kernel_size: int = 3,
        chunk: Optional[int] = None,
        ls_init_value: Optional[float] = None,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        if mlp_ratio <= 0:
            raise ValueError(f"`mlp_ratio` must be > 0, got {mlp_ratio!r}")
        self.lpu1 = LocalPerceptionUnit(dim, lpu_kernel_size)
        self.norm1 = LayerNorm2d(dim)
        self.mixer = GSPN2Mixer(
            dim,
            proxy_dim=proxy_dim,
            affinity_groups=affinity_groups,
            mixer_ratio=mixer_ratio,
            dw_kernel_size=dw_kernel_size,
            chunk=chunk,
        )
        self.ls1 = LayerScale2d(dim, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.lpu2 = LocalPerceptionUnit(dim, lpu_kernel_size)
        self.norm2 = LayerNorm2d(dim)
        self.mlp = PointwiseMlp(dim, int(round(mlp_ratio * dim)))
        self.ls2 = LayerScale2d(dim, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, C, H, W)``.

        In training the mixer and the MLP take ``norm1``'s and ``norm2``'s parameters and fuse each norm
        into their first GEMM (their training formulation; the norms' forward hooks then do not run);
        otherwise, and while a graph recorder runs (:mod:`gspn2.layers._trace`), every module is called.
        """
        x = self.lpu1(x)
        if fused_training():
            norm1 = (self.norm1.weight, self.norm1.bias, self.norm1.eps)
            x = x + self.drop_path1(self.ls1(self.mixer(x, norm1)))
            x = self.lpu2(x)
            norm2 = (self.norm2.weight, self.norm2.bias, self.norm2.eps)
            return x + self.drop_path2(self.ls2(self.mlp(x, norm2)))
        x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x))))
        x = self.lpu2(x)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class GSPN2Stage(nn.Module):
    """Optional strided-conv downsampling followed by ``depth`` blocks.

    Args:
        in_chs: Input channels.
        out_chs: Output channels.
        depth: Number of blocks.
        downsample: Halve the resolution with ``LayerNorm2d -> Conv2x2/2`` first; otherwise
            ``in_chs`` must equal ``out_chs``.
        drop_path_rates: One stochastic-depth rate per block.
        **block_kwargs: The other arguments of every :class:`GSPN2Block` (``chunk``, ``mlp_ratio``, ...).
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        depth: int,
        downsample: bool,
        drop_path_rates: Sequence[float],
        **block_kwargs: Any,
    ) -> None:
        super().__init__()
        if len(drop_path_rates) != depth:
            raise ValueError(f"`drop_path_rates` needs {depth} entries, got {len(drop_path_rates)}")
        if downsample:
            self.downsample = nn.Sequential(LayerNorm2d(in_chs), nn.Conv2d(in_chs, out_chs, 2, stride=2))
        elif in_chs != out_chs:
            raise ValueError(f"`in_chs` ({in_chs}) must equal `out_chs` ({out_chs}) without downsampling")
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(*[GSPN2Block(out_chs, drop_path=r, **block_kwargs) for r in drop_path_rates])
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class GSPN2(nn.Module):
    """GSPN-2 backbone and classifier (four stages, strides 4/8/16/32).

    Args:
        in_chans: Input image channels.
        num_classes: Classifier outputs; 0 gives a feature model with ``head.fc = Identity``.
        global_pool: Global pooling type of the head (``'avg'``, ``'max'``, ... or ``''`` for none).
        depths: Blocks per stage.
        dims: Channels per stage.
        stage_chunks: Scan type per stage: ``None`` for global propagation over the whole image,
            an int ``L`` for local propagation restarting every ``L`` steps.
        proxy_dim: Proxy channels ``C_proxy`` propagated by every mixer.
        affinity_groups: Affinity groups ``K`` (1: one affinity per pixel shared by all channels).
        mixer_ratio: Mixer hidden width as a multiple of the stage width.
        mlp_ratio: MLP hidden width as a multiple of the stage width.
        dw_kernel_size: Depthwise kernel inside the mixer.
        lpu_kernel_size: Depthwise kernel of the local perception units.
        ls_init_value: LayerScale init; ``None`` disables LayerScale.
        head_hidden_size: Optional pre-logits hidden layer of the head.
        drop_rate: Dropout before the classifier.
        drop_path_rate: Stochastic depth rate, increasing linearly over blocks up to this value.
    """

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        depths: Tuple[int, ...] = (2, 3, 8, 2),
        dims: Tuple[int, ...] = (80, 160, 320, 640),
        stage_chunks: Tuple[Optional[int], ...] = (None, None, None, None),
        proxy_dim: int = 2,
        affinity_groups: int = 1,
        mixer_ratio: float = 1.5,
        mlp_ratio: float = 4.0,
        dw_kernel_size: int = 7,
        lpu_kernel_size: int = 3,
        ls_init_value: Optional[float] = None,
        head_hidden_size: Optional[int] = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        _check_positive_int("in_chans", in_chans)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"`num_classes` must be an int >= 0, got {num_classes!r}")
        depths, dims, stage_chunks = tuple(depths), tuple(dims), tuple(stage_chunks)
        if len(depths) != 4 or len(dims) != 4:
            raise ValueError(f"`depths` and `dims` need 4 entries (4 stages), got {depths} and {dims}")
        for i, (d, c) in enumerate(zip(depths, dims)):
            _check_positive_int(f"depths[{i}]", d)
            _check_positive_int(f"dims[{i}]", c)
        if len(stage_chunks) != len(depths):
            raise ValueError(f"`stage_chunks` needs {len(depths)} entries, got {stage_chunks}")
        for i, chunk in enumerate(stage_chunks):
            _check_chunk(f"stage_chunks[{i}]", chunk)
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"`drop_path_rate` must be in [0, 1), got {drop_path_rate!r}")

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False

        # Overlapping stride-4 stem: two 3x3 stride-2 convs keep odd sizes and border pixels.
        stem_mid = max(1, dims[0] // 2)
        self.stem = Stem(in_chans, stem_mid, dims[0])

        # Stochastic depth grows linearly over all blocks (timm's calculate_drop_path_rates, not in
        # every timm >= 1.0.15 that we support).
        # device="cpu": the schedule is plain numbers, also when the model is built under torch.device("meta").
        rates = torch.linspace(0, drop_path_rate, sum(depths), device="cpu")
        block_kwargs = dict(
            mlp_ratio=mlp_ratio,
            proxy_dim=proxy_dim,
            affinity_groups=affinity_groups,
            mixer_ratio=mixer_ratio,
            dw_kernel_size=dw_kernel_size,
            lpu_kernel_size=lpu_kernel_size,
            ls_init_value=ls_init_value,
        )
        dp_rates = [r.tolist() for r in rates.split(list(depths))]
        stages = []
        self.feature_info: List[Dict[str, Union[int, str]]] = []
        prev_chs, stride = dims[0], 4
        for i in range(len(depths)):
            if i > 0:
                stride *= 2
            stages.append(
                GSPN2Stage(
                    prev_chs,
                    dims[i],
                    depth=depths[i],
                    downsample=i > 0,
                    drop_path_rates=dp_rates[i],
                    chunk=stage_chunks[i],
                    **block_kwargs,
                )
            )
            prev_chs = dims[i]
            self.feature_info.append(dict(num_chs=prev_chs, reduction=stride, module=f"stages.{i}"))
        self.stages = nn.Sequential(*stages)
        self.num_features = prev_chs

        self.head = NormMlpClassifierHead(
            self.num_features,
            num_classes,
            hidden_size=head_hidden_size,
            pool_type=global_pool,
            drop_rate=drop_rate,
            norm_layer=LayerNorm2d,
            act_layer="gelu",
        )
        self.head_hidden_size = self.head.num_features
        named_apply(_init_weights, self)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Union[str, List]]:
        """Regex groups of parameter names for layer-wise lr decay and similar."""
        return dict(
            stem=r"^stem",
            blocks=r"^stages\.(\d+)"
            if coarse
            else [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in backward to save memory."""
        self.grad_checkpointing = enable
        for s in self.stages:
            s.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Parameter names to exclude from weight decay (the mixers' per-channel skip scales)."""
        return {n for n, _ in self.named_parameters() if n.endswith("mixer.skip")}

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(
        self, num_classes: int, global_pool: Optional[str] = None, reset_other: bool = False
    ) -> None:
        """Replace the classifier with one of ``num_classes`` outputs (0: identity).

        ``reset_other`` also drops the head's norm and pre-logits layer (used when pruning stages).
        """
        self.num_classes = num_classes
        if reset_other:
            # Done here rather than through head.reset(reset_other=...), which older timm lacks.
            self.head.norm = nn.Identity()
            self.head.pre_logits = nn.Identity()
            self.head.hidden_size = None
            self.head.num_features = self.head.in_features = self.num_features
        self.head.reset(num_classes, global_pool)
        self.head_hidden_size = self.head.num_features

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Final features and the outputs of the stages selected by ``indices`` (timm convention).

        ``norm`` is accepted for API compatibility; this model has no pre-head feature norm.
        """
        if output_fmt != "NCHW":
            raise ValueError(f"`output_fmt` must be 'NCHW', got {output_fmt!r}")
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        stages = self.stages if torch.jit.is_scripting() or not stop_early else self.stages[: max_index + 1]
        x = self.stem(check_input(x, self.in_chans, min_input_size(len(stages))))
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drop stages after the last one ``indices`` needs (and the head if asked)."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[: max_index + 1]
        if max_index < len(self.feature_info) - 1:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
            prune_head = True
        if prune_head:
            self.reset_classifier(0, "", reset_other=True)
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_chans, H, W) -> (B, dims[-1], ~H/32, ~W/32)``; ``H, W >= 29`` (:func:`min_input_size`)."""
        x = self.stem(check_input(x, self.in_chans, min_input_size(len(self.stages))))
        return self.stages(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool, LayerNorm and classify; ``pre_logits=True`` stops before the linear layer."""
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_weights(module: nn.Module, name: Optional[str] = None) -> None:
    """Truncated-normal (std 0.02) conv and linear weights, zero biases (as ConvNeXt)."""
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Accept our trainer's checkpoints and bare state dicts; strip the ``module.`` (DDP) and ``_orig_mod.``
    (``torch.compile``) prefixes. There are no foreign weights to remap.

    A whole checkpoint is unwrapped with timm's preference (its loaders default to ``use_ema=True``): the EMA
    weights when it holds them (``state_dict_ema``, ``model_ema``, or our trainer's ``ema``), else ``state_dict``
    or ``model``. timm's file loaders pick the entry themselves before calling this (train.py also writes
    ``state_dict_ema``, so ``use_ema`` reaches the EMA there)."""
    for key in ("state_dict_ema", "model_ema", "ema", "state_dict", "model"):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    out = {}
    for k, v in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        out[k] = v
    return out


#: Depths and widths of the registered members; every other argument takes GSPN2's default.
_ARCHS: Dict[str, Dict[str, Tuple[int, ...]]] = {
    "gspn2_micro": dict(depths=(1, 1, 2, 1), dims=(16, 32, 64, 128)),
    "gspn2_tiny": dict(depths=(2, 3, 8, 2), dims=(80, 160, 320, 640)),
    "gspn2_small": dict(depths=(2, 3, 21, 2), dims=(88, 176, 352, 704)),
    "gspn2_base": dict(depths=(5, 5, 12, 5), dims=(112, 224, 448, 896)),
}


def _create_gspn2(variant: str, pretrained: bool = False, **kwargs) -> GSPN2:
    return build_model_with_cfg(
        GSPN2,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), flatten_sequential=True),
        **dict(_ARCHS[variant], **kwargs),
    )


def _cfg(url: str = "", **kwargs) -> Dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.0",
        "classifier": "head.fc",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "gspn2_micro": _cfg(input_size=(3, 32, 32), pool_size=(1, 1)),
        "gspn2_tiny": _cfg(),
        "gspn2_small": _cfg(),
        "gspn2_base": _cfg(),
    }
)


@register_model
def gspn2_micro(pretrained: bool = False, **kwargs) -> GSPN2:
    return _create_gspn2("gspn2_micro", pretrained=pretrained, **kwargs)


@register_model
def gspn2_tiny(pretrained: bool = False, **kwargs) -> GSPN2:
    return _create_gspn2("gspn2_tiny", pretrained=pretrained, **kwargs)


@register_model
def gspn2_small(pretrained: bool = False, **kwargs) -> GSPN2:
    return _create_gspn2("gspn2_small", pretrained=pretrained, **kwargs)


@register_model
def gspn2_base(pretrained: bool = False, **kwargs) -> GSPN2:
    return _create_gspn2("gspn2_base", pretrained=pretrained, **kwargs)
