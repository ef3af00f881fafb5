"""1x1 convolutions computed as GEMMs on the channels-last view, and two activation-recomputing GEMMs.

With channels_last memory a ``(B, C, H, W)`` activation is a contiguous ``(B*H*W, C)`` row matrix
(:func:`to_rows` is a view), so a 1x1 convolution is one ``addmm``: cuBLAS applies the bias in its
epilogue (cuDNN adds a convolution's bias in a separate kernel) and no layout conversion happens.
:class:`Conv1x1` keeps ``nn.Conv2d``'s parameters (``weight`` of shape ``(out, in, 1, 1)``, ``bias``), so
state dicts, initialisation and fvcore's MAC count (it counts ``aten::linear`` like the convolution:
in x out per pixel) are those of the convolution it replaces.

:func:`gelu_linear` and :func:`norm_linear` are ``linear(gelu(h))`` and
``linear(layer_norm(x) [* silu(z)])`` for training: they save their inputs
only and recompute the cheap elementwise part in backward, instead of autograd keeping both the
activation's input and output alive until backward.

These and :func:`rows_linear` have two implementations of one function: autograd functions in Python,
which ``torch.compile`` traces (Inductor fuses the elementwise work into its kernels), and the C++ ops
``gspn2::rows_norm_linear``, ``gspn2::rows_linear`` and ``gspn2::rows_gelu_linear`` (``gspn2/csrc/rows.cpp``;
the same ATen calls, so the same bits) whose forward and backward run without Python: an eager training
step takes them when the extension is built (the option ``eager_autograd``, :mod:`gspn2.ops.options`).
"""

# No ``from __future__ import annotations``: TorchScript reads the signatures of the ``torch.jit.unused``
# functions below from their annotations, which must be real types, not strings.

from typing import List, Optional, Tuple

import torch
import torch.fx
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_function

from gspn2.layers.norm import layer_norm_rows, layer_norm_rows_backward
from gspn2.ops import _cuda
from gspn2.ops._amp import autocast_enabled, autocast_off
from gspn2.ops._amp import cast_optional as _cast
from gspn2.ops import options as _options
from gspn2.ops.gelu_gemm import gelu_linear as _gelu_linear_op
from gspn2.ops.layernorm import use_kernel as _use_layer_norm_kernel
from gspn2.ops.norm_backward import norm_gate_backward
from gspn2.ops.norm_backward import triton_available as _norm_triton_available

__all__ = [
    "POINTWISE_MAX_IN", "ChunkedConv1x1", "Conv1x1", "NormParams", "cpp_ops_available", "from_rows",
    "gelu_linear", "norm_linear", "recomputed_silu", "rows_linear", "to_rows",
]

#: ``(weight, bias, eps)`` of a LayerNorm over the channels that a block fuses into the next GEMM
#: (:func:`norm_linear`): the ``norm`` argument of the mixer and the MLP.
NormParams = Tuple[torch.Tensor, torch.Tensor, float]

# torch.fx leaves (timm's tracer list and a plain torch.fx.symbolic_trace): the autograd functions and
# their argument checks cannot run on Proxies. The GSPN-2 blocks do not call them while fx traces
# (gspn2.layers._trace); a traced module of one's own that does records one node each.
for _name in ("gelu_linear", "norm_linear", "rows_linear"):
    torch.fx.wrap(_name)


# The C++ forms exist when the extension is built (and holds them: an extension built from older sources
# does not).
_CPP_OPS = _cuda.extension_available() and hasattr(torch.ops.gspn2, "rows_norm_linear")


def cpp_ops_available() -> bool:
    """Whether the C++ ops ``gspn2::rows_*`` are registered (the extension is built)."""
    return _CPP_OPS


_ROWS_OPS = ("rows_norm_linear", "rows_linear", "rows_gelu_linear")
# op name -> (the extension's direct entry or None, the torch.ops overload)
_ROWS_CALLS = {
    name: (_cuda.direct_call(name), getattr(torch.ops.gspn2, name).default) for name in (_ROWS_OPS if _CPP_OPS else ())
}


def _rows_call(name: str, *args):
    """``torch.ops.gspn2.<name>(*args)``, through the extension's direct entry where that may replace it."""
    direct, op = _ROWS_CALLS[name]
    if direct is not None and _cuda.direct_call_allowed(args):
        return direct(*args)
    return op(*args)


def _use_cpp() -> bool:
    """Whether this call takes the C++ op: built, allowed by the option, and not traced by Dynamo."""
    return _CPP_OPS and _options.current().eager_autograd == "auto" and not torch.compiler.is_compiling()


#: Under ``torch.compile``, a training GEMM (:func:`rows_linear`) with at most this many input features (the
#: mixer's ``proj_up`` has ``4 * proxy_dim``) is computed as that many broadcast multiply-adds (option
#: ``small_gemm``, :func:`_linear`): Inductor then fuses it into the kernel that reads its output (the skip,
#: the norm and the gate after ``proj_up``), where cuBLAS would write the full-width output and the next
#: kernel read it back. Inference (:class:`Conv1x1`) keeps the GEMM: there Inductor's fusion of the same
#: chain measured slower (docs/benchmarks.md, "Narrow GEMMs as multiply-adds").
POINTWISE_MAX_IN = 16


def _pointwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``x.shape[-1]`` broadcast multiply-adds, for inputs already in the
    GEMM's dtype (as :class:`_RowsLinear` has them): products and sums in float32, the result rounded once to
    that dtype, as cuBLAS does."""
    xs, w = x.float(), weight.float()
    acc = xs[..., 0:1] * w[:, 0]
    for k in range(1, x.shape[-1]):
        acc = acc + xs[..., k : k + 1] * w[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of the training GEMMs; while ``torch.compile`` traces it, a GEMM of at
    most :data:`POINTWISE_MAX_IN` input features is written as multiply-adds unless the option ``small_gemm``
    is ``gemm`` (:mod:`gspn2.ops.options`).

    Shapes: ``x (..., in)``, ``weight (out, in)``, ``bias (out,)`` or None.
    """
    if (
        torch.compiler.is_compiling()
        and x.shape[-1] <= POINTWISE_MAX_IN
        and _options.current().small_gemm != "gemm"
    ):
        return _pointwise_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W) -> (B*H*W, C)``: a view for channels_last memory, a copy otherwise."""
    return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])


def from_rows(rows: torch.Tensor, B: int, H: int, W: int) -> torch.Tensor:
    """``(B*H*W, C) -> (B, C, H, W)`` with channels_last memory (a view of contiguous ``rows``)."""
    return rows.reshape(B, H, W, rows.shape[-1]).permute(0, 3, 1, 2)


class Conv1x1(nn.Conv2d):
    """A 1x1 convolution computed as ``F.linear`` on the channels-last rows of its input.

    ``(B, in, H, W) -> (B, out, H, W)`` with channels_last memory (a contiguous NCHW input is copied to
    rows once). The parameters are ``nn.Conv2d``'s (``weight`` of shape ``(out, in, 1, 1)``, ``bias``).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        bias: Learnable bias.
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, H, W = x.shape
        # weight.flatten(1): (out, in), a view of the (out, in, 1, 1) parameter.
        return from_rows(F.linear(to_rows(x), self.weight.flatten(1), self.bias), B, H, W)


class ChunkedConv1x1(Conv1x1):
    """A :class:`Conv1x1` whose output comes as a list of ``out_chunks`` tensors, each from its own GEMM.

    Equal to ``conv(x).chunk(out_chunks, dim=1)``, but every chunk is contiguous in channels_last memory
    (a depthwise convolution can take it without a copy). The chunks are channel slices of the weight
    taken by index, so ``torch.fx`` can trace the loop and TorchScript can type the result
    (``List[Tensor]``).

    Args:
        in_channels: Input channels.
        out_channels: Output channels of all chunks together.
        out_chunks: Number of outputs to split the channels into (must divide ``out_channels``).
        bias: Learnable bias.
    """

    def __init__(self, in_channels: int, out_channels: int, out_chunks: int, bias: bool = True) -> None:
        if isinstance(out_chunks, bool) or not isinstance(out_chunks, int) or out_chunks < 1:
            raise ValueError(f"`out_chunks` must be a positive int, got {out_chunks!r}")
        if out_channels % out_chunks != 0:
            raise ValueError(f"`out_chunks` ({out_chunks}) must divide `out_channels` ({out_channels})")
        super().__init__(in_channels, out_channels, bias=bias)
        self.out_chunks = out_chunks

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:  # type: ignore[override]
        n = self.out_channels // self.out_chunks
        B, _, H, W = x.shape
        rows = to_rows(x)
        weight = self.weight.flatten(1)
        bias = self.bias
        outs: List[torch.Tensor] = []
        for i in range(self.out_chunks):
            b = bias[i * n : (i + 1) * n] if bias is not None else None
            outs.append(from_rows(F.linear(rows, weight[i * n : (i + 1) * n], b), B, H, W))
        return outs


# ``auto`` is ``act``: compiled gspn2_tiny trains with a 0.56 GB lower peak than with ``gelu`` (0.95x
# Swin-T's) and no slower (docs/benchmarks.md, "The compiled training defaults, measured").
_RECOMPUTED = {
    "auto": ("gelu", "silu"),
    "gelu": ("gelu",),
    "act": ("gelu", "silu"),
    "gate": ("gelu", "silu", "gate"),
    "all": ("gelu", "silu", "gate", "norm"),
}


def _recomputes(what: str) -> bool:
    """Whether ``torch.compile``, tracing now, recomputes ``what`` in backward instead of keeping it, as the
    option ``recompute`` asks (:mod:`gspn2.ops.options`): ``"gelu"`` (the MLP's), ``"silu"`` (the mixer's
    value branch, :func:`recomputed_silu`), ``"gate"`` (the gated norm's output, the input of the mixer's
    ``out_proj``) or ``"norm"`` (the other normalised GEMM inputs)."""
    if not torch.compiler.is_compiling():
        return False
    return what in _RECOMPUTED.get(_options.current().recompute, ())


def _recomputed(fn, *args):
    """``fn(*args)`` marked for recomputation in backward (a non-reentrant checkpoint): AOTAutograd's
    partitioner then keeps ``fn``'s inputs where it would keep its output, and Inductor recomputes the
    output in the backward kernel that reads those inputs anyway."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def recomputed_silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)``. Under ``torch.compile`` with the option ``recompute`` at ``act``, ``gate`` or ``all``,
    the compiled backward recomputes it from ``x``, which it keeps for SiLU's own gradient anyway: one
    tensor kept instead of two where ``F.silu(x)`` also feeds a GEMM (the mixer's ``generate``)."""
    if _recomputes("silu"):
        return _recomputed(F.silu, x)
    return F.silu(x)


class _GeluLinear(torch.autograd.Function):
    """``F.linear(F.gelu(h), weight, bias)`` saving ``h`` only; ``gelu(h)`` is recomputed in backward."""

    @staticmethod
    def forward(ctx, h, weight, bias):
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(h), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        grad_h = grad_w = grad_b = None
        # All inputs share one dtype (see gelu_linear); an enclosing autocast must not change that.
        with autocast_off(h.device.type):
            if ctx.needs_input_grad[0]:
                grad_h = torch.ops.aten.gelu_backward(grad_out @ weight, h)
            if ctx.needs_input_grad[1]:
                grad_w = grad_out.t() @ F.gelu(h)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = grad_out.sum(0)
        return grad_h, grad_w, grad_b


# TorchScript cannot compile an autograd function: there these two are stubs that raise, which scripted
# blocks never reach (gspn2.layers._trace). The stubs keep no defaults: scripted callers pass every
# argument.
@torch.jit.unused
def gelu_linear(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(F.gelu(h), weight, bias)`` that keeps only ``h`` for backward (not also ``gelu(h)``).

    Computed in ``h.dtype`` (under autocast ``h`` is already the autocast dtype): ``weight`` and ``bias``
    are cast to it, and their gradients come back in their own dtypes, as they would through autocast.
    The option ``mlp`` (:mod:`gspn2.ops.options`, read when the call is traced) picks the formulation:
    ``fused``, the op :func:`gspn2.ops.gelu_linear` (GELU inside its GEMMs); ``auto`` / ``separate``, an
    autograd function of plain ops (GELU its own kernel), which eagerly is the C++ op
    ``gspn2::rows_gelu_linear`` (module docstring). Under ``torch.compile`` the option ``recompute`` (``gelu``
    or ``all``) has ``gelu(h)`` recomputed in backward whatever AOTAutograd's partitioner would keep.

    Shapes: ``h (N, in)``, ``weight (out, in)``, ``bias (out,)`` or None ``-> (N, out)``.
    """
    if _options.current().mlp == "fused":
        return _gelu_linear_op(h, weight.to(h.dtype), _cast(bias, h.dtype))
    if _use_cpp():
        return _rows_call("rows_gelu_linear", h, weight, bias)
    if _recomputes("gelu"):
        with autocast_off(h.device.type):
            return F.linear(_recomputed(F.gelu, h), weight.to(h.dtype), _cast(bias, h.dtype))
    return _GeluLinear.apply(h, weight.to(h.dtype), _cast(bias, h.dtype))


class _RowsLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``, optionally ``+ skip_input * skip_scale`` (one ``addcmul``), with the
    backward written out: one GEMM per gradient and a sum for the bias, where autograd's formulas for
    ``addmm``, the weight transpose and ``addcmul`` dispatch three transposes and a reshape more."""

    @staticmethod
    def forward(ctx, x, weight, bias, skip_input, skip_scale):
        with autocast_off(x.device.type):
            out = _linear(x, weight, bias)
            if skip_input is not None:
                out = torch.addcmul(out, skip_input, skip_scale)
        ctx.save_for_backward(x, weight, skip_input, skip_scale)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, skip_input, skip_scale = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x = grad_w = grad_b = grad_si = grad_ss = None
        # A skip input of a wider dtype widens the output and its gradient; the GEMM's part of it is in the
        # GEMM's dtype (as autograd casts the gradient of a GEMM's output).
        g = grad_out.to(x.dtype)
        with autocast_off(x.device.type):
            if need[0]:
                grad_x = g @ weight
            if need[1]:
                grad_w = g.t() @ x
            if ctx.has_bias and need[2]:
                grad_b = g.sum(0)
            if skip_input is not None:
                if need[3]:
                    grad_si = grad_out * skip_scale
                if need[4]:
                    grad_ss = (grad_out * skip_input).sum(0)
        return grad_x, grad_w, grad_b, grad_si, grad_ss


@torch.jit.unused
def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    skip_input: Optional[torch.Tensor] = None,
    skip_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) [+ skip_input * skip_scale]`` on rows, for training: the same values and
    saved tensors as the plain ops, fewer dispatcher calls in backward.

    Under autocast ``x``, ``weight`` and ``bias`` are cast to the autocast dtype (as ``F.linear`` would be)
    and ``skip_scale`` to ``skip_input``'s dtype; the gradients come back in each input's own dtype, as they
    would through autocast's casts. Eagerly the C++ op ``gspn2::rows_linear`` computes it (module docstring).

    Shapes: ``x (N, in)``, ``weight (out, in)``, ``bias (out,)`` or None, ``skip_input (N, out)`` and
    ``skip_scale (out,)`` (both or neither) ``-> (N, out)``.
    """
    if (skip_input is None) != (skip_scale is None):
        raise ValueError("rows_linear: `skip_input` and `skip_scale` go together (both or neither)")
    device_type = x.device.type
    dt = torch.get_autocast_dtype(device_type) if autocast_enabled(device_type) else x.dtype
    if _use_cpp():
        return _rows_call("rows_linear", x, weight, bias, skip_input, skip_scale, dt)
    if skip_input is not None and skip_scale is not None:
        skip_scale = skip_scale.to(skip_input.dtype)
    return _RowsLinear.apply(x.to(dt), weight.to(dt), _cast(bias, dt), skip_input, skip_scale)


class _NormLinear(torch.autograd.Function):
    """``F.linear(layer_norm(x) [* F.silu(gate)], weight, bias)`` in ``chunks`` outputs, saving ``x``, its
    statistics and ``gate``; the normalised ``x`` is recomputed in backward. With a gate, one output and the
    option ``norm_backward="fused"`` on CUDA, the backward between its two GEMMs is one
    :func:`~gspn2.ops.norm_gate_backward`."""

    @staticmethod
    def forward(ctx, x, gate, norm_weight, norm_bias, weight, bias, eps, chunks):
        ctx.norm_kernel = _use_layer_norm_kernel(x)
        with autocast_off(x.device.type):
            n, mean, rstd = _row_norm(x, norm_weight, norm_bias, eps, ctx.norm_kernel)
            m = n.to(weight.dtype)
            if gate is not None:
                m = m * F.silu(gate)
            # One chunk: no split of the weight and bias. Several: the weight's chunks are saved, so backward
            # does not split it again.
            weights = weight.chunk(chunks) if chunks > 1 else (weight,)
            biases = (bias.chunk(chunks) if chunks > 1 else (bias,)) if bias is not None else (None,) * chunks
            outs = tuple(F.linear(m, w, b) for w, b in zip(weights, biases))
        ctx.save_for_backward(x, gate, norm_weight, norm_bias, mean, rstd, *weights)
        ctx.eps, ctx.chunks, ctx.has_bias = eps, chunks, bias is not None
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        x, gate, norm_weight, norm_bias, mean, rstd, *weights = ctx.saved_tensors
        weight = weights[0]  # dtype and device of all chunks
        need = ctx.needs_input_grad
        grad_x = grad_gate = grad_nw = grad_nb = grad_w = grad_b = None
        grads = [torch.zeros(g_shape, dtype=weight.dtype, device=weight.device) if g is None else g
                 for g, g_shape in zip(grad_outs, [(x.shape[0], w.shape[0]) for w in weights])]
        if (gate is not None and ctx.chunks == 1 and norm_weight is not None and norm_bias is not None
                and _fused_norm_backward(x)):
            return _NormLinear._fused_backward(ctx, grads[0], x, gate, norm_weight, norm_bias, mean, rstd, weight)
        with autocast_off(x.device.type):
            # The same kernel on the same input as in forward: bitwise the forward's normalised x.
            n = _row_norm(x, norm_weight, norm_bias, ctx.eps, ctx.norm_kernel)[0]
            m0 = n.to(weight.dtype)
            s = F.silu(gate) if gate is not None else None
            if need[4]:
                m = m0 * s if s is not None else m0
                grad_w = torch.cat([g.t() @ m for g in grads]) if ctx.chunks > 1 else grads[0].t() @ m
            if ctx.has_bias and need[5]:
                grad_b = torch.cat([g.sum(0) for g in grads]) if ctx.chunks > 1 else grads[0].sum(0)
            if need[0] or need[1] or need[2] or need[3]:
                # The chunks' input gradients are summed in x's dtype, as autograd sums the gradients of
                # the per-GEMM casts of the unfused path.
                grad_n = None
                for g, w in zip(grads, weights):
                    grad_m = g @ w
                    if s is not None:
                        if need[1]:  # the gate multiplies every chunk's input: sum over chunks
                            gg = torch.ops.aten.silu_backward(grad_m * m0, gate)
                            grad_gate = gg if grad_gate is None else grad_gate + gg
                        grad_m = grad_m * s
                    grad_n = grad_m.to(x.dtype) if grad_n is None else grad_n + grad_m.to(x.dtype)
                if need[0] or need[2] or need[3]:
                    mask = [need[0], need[2] and norm_weight is not None, need[3] and norm_bias is not None]
                    if ctx.norm_kernel:
                        grad_x, grad_nw, grad_nb = torch.ops.gspn2.layer_norm_backward.default(
                            grad_n, x, mean, rstd, norm_weight, norm_bias, False, mask
                        )
                        grad_x, grad_nw, grad_nb = (g if m else None for g, m in zip((grad_x, grad_nw, grad_nb), mask))
                    elif _float_affine(x, norm_weight, norm_bias):
                        grad_x, grad_nw, grad_nb = layer_norm_rows_backward(
                            grad_n, x, mean, rstd, norm_weight, [need[0], need[2], need[3]]
                        )
                    else:
                        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(
                            grad_n, x, (x.shape[-1],), mean, rstd, norm_weight, norm_bias, [need[0], need[2], need[3]]
                        )
        return grad_x, grad_gate, grad_nw, grad_nb, grad_w, grad_b, None, None

    @staticmethod
    def _fused_backward(ctx, grad_out, x, gate, norm_weight, norm_bias, mean, rstd, weight):
        """The gated norm's backward as one :func:`~gspn2.ops.norm_gate_backward` between the two GEMMs: the
        input gradient of the GEMM, then the op (which also recomputes the GEMM's input for its weight
        gradient)."""
        need = ctx.needs_input_grad
        with autocast_off(x.device.type):
            grad_m = grad_out @ weight
            grad_x, grad_gate, grad_nw, grad_nb, m = norm_gate_backward(
                grad_m, x, gate, mean.reshape(-1), rstd.reshape(-1), norm_weight, norm_bias
            )
            grad_w = grad_out.t() @ m if need[4] else None
            grad_b = grad_out.sum(0) if ctx.has_bias and need[5] else None
        return (grad_x if need[0] else None, grad_gate if need[1] else None, grad_nw if need[2] else None,
                grad_nb if need[3] else None, grad_w, grad_b, None, None)


class _FoldedNormLinear(torch.autograd.Function):
    """``F.linear(layer_norm(x), weight, bias)`` in ``chunks`` outputs with the norm's affine step folded into
    the GEMM: ``F.linear(xhat, weight * norm_weight, bias + weight @ norm_bias)``, ``xhat`` the rows
    normalised without weight and bias (the same function; the rounding differs). Saves ``x`` and its
    statistics, as :class:`_NormLinear` does.

    The backward takes the norm's weight and bias gradients from the GEMM's weight-sized gradients
    (``sum_o weight[o] * grad_folded_weight[o]``, ``grad_bias @ weight``) instead of summing over the rows,
    so what remains of the norm's backward reduces along each row only. The parameters come in their own
    dtype (float32) and are folded in it before one cast to ``dt``."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, weight, bias, eps, chunks, dt):
        ct = torch.promote_types(weight.dtype, torch.float32)
        with autocast_off(x.device.type):
            xhat, mean, rstd = layer_norm_rows(x, None, None, eps)
            w = weight.to(ct)
            folded_w = w * norm_weight.to(ct) if norm_weight is not None else w
            folded_b = (w * norm_bias.to(ct)).sum(1) if norm_bias is not None else None
            if bias is not None:
                folded_b = bias.to(ct) if folded_b is None else folded_b + bias.to(ct)
            weights = folded_w.to(dt).chunk(chunks)
            biases = folded_b.to(dt).chunk(chunks) if folded_b is not None else (None,) * chunks
            m = xhat.to(dt)
            outs = tuple(F.linear(m, wc, bc) for wc, bc in zip(weights, biases))
        ctx.save_for_backward(x, mean, rstd, weight, norm_weight, norm_bias, *weights)
        ctx.eps, ctx.chunks, ctx.dt = eps, chunks, dt
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        x, mean, rstd, weight, norm_weight, norm_bias, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        ct = torch.promote_types(weight.dtype, torch.float32)
        grads = [torch.zeros(x.shape[0], w.shape[0], dtype=w.dtype, device=w.device) if g is None else g
                 for g, w in zip(grad_outs, weights)]
        grad_x = grad_nw = grad_nb = grad_w = grad_b = None
        with autocast_off(x.device.type):
            if any(need[1:5]):
                # The forward's normalised rows, recomputed by the same ops: the same bits.
                m = ((x.to(torch.promote_types(x.dtype, torch.float32)) - mean) * rstd).to(x.dtype).to(ctx.dt)
                grad_fw = torch.cat([g.t() @ m for g in grads]).to(ct)  # of the folded weight, (out, C)
                grad_fb = torch.cat([g.sum(0, dtype=ct) for g in grads])  # of the folded bias, (out,)
                w = weight.to(ct)
                if need[1] and norm_weight is not None:
                    grad_nw = (grad_fw * w).sum(0).to(norm_weight.dtype)
                if need[2] and norm_bias is not None:
                    grad_nb = (grad_fb[:, None] * w).sum(0).to(norm_bias.dtype)
                if need[3]:
                    grad_w = grad_fw * norm_weight.to(ct) if norm_weight is not None else grad_fw
                    if norm_bias is not None:
                        grad_w = grad_w + grad_fb[:, None] * norm_bias.to(ct)
                    grad_w = grad_w.to(weight.dtype)
                if need[4] and ctx.bias_dtype is not None:
                    grad_b = grad_fb.to(ctx.bias_dtype)
            if need[0]:
                grad_n = None  # summed over the chunks in x's dtype, as _NormLinear does
                for g, wc in zip(grads, weights):
                    gn = (g @ wc).to(x.dtype)
                    grad_n = gn if grad_n is None else grad_n + gn
                grad_x = layer_norm_rows_backward(grad_n, x, mean, rstd, None, [True, False, False])[0]
        return grad_x, grad_nw, grad_nb, grad_w, grad_b, None, None, None


def _float_affine(x, norm_weight, norm_bias) -> bool:
    """Whether the norm's parameters are not in ``x.dtype`` (float32 parameters under ``torch.compile``:
    :func:`~gspn2.layers.layer_norm_rows` and its backward instead of ATen's one-dtype ops)."""
    return any(p is not None and p.dtype != x.dtype for p in (norm_weight, norm_bias))


def _norm_params(x, norm_weight, norm_bias):
    """The norm's parameters as :class:`_NormLinear` takes them: as they are under ``torch.compile`` (the
    plain-op norm applies float32 parameters unrounded, without their casts), else in ``x.dtype``."""
    if torch.compiler.is_compiling():
        return norm_weight, norm_bias
    return _cast(norm_weight, x.dtype), _cast(norm_bias, x.dtype)


def _row_norm(x, norm_weight, norm_bias, eps, kernel: bool):
    """``(normalised rows, mean, rstd)``: gspn2's LayerNorm kernel (``kernel``, eager CUDA rows), the plain-op
    norm (parameters in another dtype than ``x``) or ATen's."""
    if kernel:
        return torch.ops.gspn2.layer_norm.default(x, norm_weight, norm_bias, eps, False)
    if _float_affine(x, norm_weight, norm_bias):
        return layer_norm_rows(x, norm_weight, norm_bias, eps)
    return torch.ops.aten.native_layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps)


def _fused_norm_backward(x: torch.Tensor) -> bool:
    """Whether the gated norm's backward takes :func:`~gspn2.ops.norm_gate_backward`: CUDA rows, Triton
    present, and the option ``norm_backward="fused"`` (read when the backward is traced; ``auto`` keeps the
    separate ops, measured faster in the compiled step)."""
    return x.is_cuda and _norm_triton_available() and _options.current().norm_backward == "fused"


@torch.jit.unused
def norm_linear(
    x: torch.Tensor,
    norm_weight: Optional[torch.Tensor],
    norm_bias: Optional[torch.Tensor],
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    chunks: int = 1,
    gate: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    """``F.linear(layer_norm(x) [* F.silu(gate)], weight, bias).chunk(chunks, dim=-1)``, keeping only ``x``
    (with the norm's per-row statistics) and ``gate`` for backward.

    A LayerNorm followed by a GEMM saves both the norm's input and its output (the GEMM's input); this
    saves the input only and recomputes the normalisation in backward. The norm runs in ``x.dtype`` (as
    :func:`~gspn2.layers.layer_norm_last_dim`), the gate and the GEMMs in the autocast dtype when
    autocast is on (as ``F.linear`` would), else in ``x.dtype``; each chunk is its own GEMM, so every
    output is contiguous (as :class:`Conv1x1` with ``out_chunks``). Eagerly the C++ op
    ``gspn2::rows_norm_linear`` computes it (module docstring). Under ``torch.compile`` with the option
    ``recompute="all"`` it is plain ops whose GEMM inputs (the normalised, gated ``x``) are recomputed in
    backward whatever AOTAutograd's partitioner would keep. Otherwise, without a gate, under
    ``torch.compile`` (option ``norm_affine``: ``auto``, or ``weight`` also eagerly), the norm's weight and
    bias are folded into the GEMM's (:class:`_FoldedNormLinear`).

    Shapes: ``x (N, C)``, ``norm_weight, norm_bias (C,)`` or None, ``weight (out, C)``, ``bias (out,)`` or
    None, ``gate (N, C)`` or None ``->`` ``chunks`` tensors ``(N, out / chunks)``.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or weight.shape[0] % chunks != 0:
        raise ValueError(f"`chunks` must be a positive int dividing {weight.shape[0]} outputs, got {chunks!r}")
    device_type = x.device.type
    dt = torch.get_autocast_dtype(device_type) if autocast_enabled(device_type) else x.dtype
    if _use_cpp():
        return _rows_call(
            "rows_norm_linear",
            x, gate, norm_weight, norm_bias, weight, bias, eps, chunks, dt, _use_layer_norm_kernel(x)
        )
    if _recomputes("gate" if gate is not None else "norm"):
        return _norm_linear_recomputed(x, gate, norm_weight, norm_bias, eps, weight, bias, chunks, dt)
    if gate is None and _folds_norm_affine():
        return list(_FoldedNormLinear.apply(x, norm_weight, norm_bias, weight, bias, eps, chunks, dt))
    nw, nb = _norm_params(x, norm_weight, norm_bias)
    outs = _NormLinear.apply(
        x,
        _cast(gate, dt),
        nw,
        nb,
        weight.to(dt),
        _cast(bias, dt),
        eps,
        chunks,
    )
    return list(outs)


def _folds_norm_affine() -> bool:
    """Whether :func:`norm_linear` folds an ungated norm's weight and bias into the GEMM's (option
    ``norm_affine``): always with ``weight``, under ``torch.compile`` with ``auto`` (measured faster there:
    docs/benchmarks.md, "The compiled training defaults, measured"), never with ``rows``."""
    choice = _options.current().norm_affine
    return choice == "weight" or (choice == "auto" and torch.compiler.is_compiling())


def _norm_gate(
    x, gate, norm_weight, norm_bias, eps: float, dt: torch.dtype, chunks: int
) -> Tuple[torch.Tensor, ...]:
    """The GEMM input of :class:`_NormLinear`, computed as its forward computes it: ``layer_norm(x)`` in
    ``x.dtype``, cast to ``dt``, times ``silu(gate)`` when there is a gate; once per chunk (a cast each, so
    that autograd sums the chunks' gradients in ``x.dtype``, as that function's backward does)."""
    with autocast_off(x.device.type):
        if _float_affine(x, norm_weight, norm_bias):
            n = layer_norm_rows(x, norm_weight, norm_bias, eps)[0]
        else:
            n = F.layer_norm(x, x.shape[-1:], norm_weight, norm_bias, eps)
        s = F.silu(gate) if gate is not None else None
        return tuple(n.to(dt) * s if s is not None else n.to(dt) for _ in range(chunks))


def _norm_linear_recomputed(
    x, gate, norm_weight, norm_bias, eps, weight, bias, chunks, dt
) -> List[torch.Tensor]:
    """:func:`norm_linear` as plain ops for ``torch.compile`` with the GEMM inputs (the normalised, gated
    ``x``) marked for recomputation in backward (:func:`_recomputed`)."""
    nw, nb = _norm_params(x, norm_weight, norm_bias)
    ms = _recomputed(_norm_gate, x, _cast(gate, dt), nw, nb, eps, dt, chunks)
    w, b = weight.to(dt), _cast(bias, dt)
    biases = b.chunk(chunks) if b is not None else (None,) * chunks
    with autocast_off(x.device.type):
        return [F.linear(m, wc, bc) for m, wc, bc in zip(ms, w.chunk(chunks), biases)]


for _fn in (gelu_linear, norm_linear, rows_linear):
    register_notrace_function(_fn)
