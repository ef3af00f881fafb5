"""Depthwise convolution on channels-last memory: ``conv(x) + bias [+ x] [then SiLU]`` as one custom op.

cuDNN's depthwise kernels on channels_last bf16 tensors are a large share of a GSPN-2 step: every block runs
three (two 3x3 local perception units on C channels and the mixer's 7x7 on its hidden width).
:func:`depthwise_conv2d` computes the same function with gspn2's CUDA kernels (``gspn2/csrc/dwconv_tile.cu``:
forward, input gradient, weight and bias gradients; float32 weights and accumulation; deterministic) and
optionally adds the input (the ``x + DWConv(x)`` residual) or applies SiLU in the same pass.

Ops (schemas here; the CUDA implementations and their autograd are registered in C++, ``gspn2/csrc/dwconv.cpp``;
every other device runs ``F.conv2d`` / ``aten.convolution_backward`` with the autograd formula below):

* ``gspn2::depthwise_conv2d(x, weight, bias, add_input, silu, kernel, cols) -> y`` (``y`` has ``x``'s strides)
* ``gspn2::depthwise_conv2d_backward(grad_y, x, weight, has_bias, add_input, kernel, cols) -> (grad_x, grad_w, grad_b)``

In plain eager code :func:`depthwise_conv2d` calls the op through the extension's direct entry
(:func:`gspn2.ops._cuda.direct_call`), the same dispatcher op without ``torch.ops``' argument parsing.

The kernels are *shared-memory tile* kernels (docs/kernel.md, "Depthwise convolution kernels"): a CTA stages
an input tile with its halo once in shared memory and gives each thread 4 rows x ``cols`` (4 or 8) output
pixels of one channel. ``kernel`` picks the family (:data:`FAMILIES` names the choices): 0 (``tile``), an
input-gradient kernel (the forward with flipped taps) and a weight-gradient kernel; 1 (``fused``), one pass
that stages grad_y and x once for all three gradients; 2 (``mma``), every pass on the tensor cores as products
of Toeplitz matrices (``gspn2/csrc/dwconv_mma.cu``: float16 and bfloat16 inputs with C a multiple of 8, on
GPUs of compute capability 9.0; other inputs raise).

The option ``dwconv_kernel`` picks the family (``auto``: :data:`AUTO_VARIANT`, the backward and the columns
that measured fastest for each kernel size; ``tile``: 0; ``fused``: 1; ``mma``: 2), and ``dwconv_tile_cols``
the columns of an explicitly chosen tile family (``mma`` takes none).

The backend on CUDA tensors is the process option ``dwconv`` (:mod:`gspn2.ops.options`, ``GSPN2_DWCONV``):

* ``auto`` (default): the CUDA kernels for channels_last float32/float16/bfloat16 inputs with K = 3 or 7 when
  the extension is built (the local perception units and the mixer, where the kernels measured 2.4x faster
  than cuDNN over a training step; docs/benchmarks.md), ``F.conv2d`` (cuDNN) otherwise, called directly so that
  ``torch.compile`` sees a plain convolution.
* ``cuda``: the kernels for every K in {3, 5, 7}, and an error where they cannot run.
* ``cudnn``: always ``F.conv2d`` (comparisons, debugging).
* ``stencil``: :func:`stencil_conv2d`, K * K shifted multiply-adds in plain tensor ops that Inductor fuses with
  their neighbours (measured slower than the kernels under ``torch.compile``; comparisons).

The choice is made when the call is traced: under ``torch.compile``, set the option before compiling.

    >>> y = depthwise_conv2d(x, conv.weight, conv.bias, add_input=True)   # x + conv(x)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from gspn2.ops import _cuda
from gspn2.ops import options as _options
from gspn2.ops._amp import autocast_enabled, cast_optional
from gspn2.ops._checks import check_tensor, refuse_forward_ad, refuse_nested

__all__ = [
    "AUTO_KERNEL_SIZES",
    "AUTO_VARIANT",
    "FAMILIES",
    "KERNEL_SIZES",
    "depthwise_conv2d",
    "kernel_available",
    "stencil_conv2d",
    "variant",
]

#: Kernel sizes the CUDA kernel implements, from the extension (gspn2/csrc/dwconv.h); none without it ...
KERNEL_SIZES = tuple(_cuda.limits()["dwconv_kernel_sizes"]) if _cuda.extension_available() else ()
#: ... and those ``dwconv="auto"`` gives it (measured faster than cuDNN: scripts/bench_dwconv.py).
AUTO_KERNEL_SIZES = (3, 7)
#: The backward and the output columns per thread ``dwconv_kernel="auto"`` runs for each kernel size: the
#: fastest forward plus backward, summed over gspn2_tiny's blocks, on the models' 3x3 and 7x7 shapes
#: (docs/benchmarks.md, "The depthwise convolution kernel"): the one-pass backward with 8 columns for the 3x3,
#: the tile kernels with 4 columns for the 7x7.
AUTO_VARIANT = {3: ("fused", 8), 5: ("tile", 4), 7: ("tile", 4)}
#: The backward by the op's ``kernel`` argument (the ``dwconv_kernel`` option's values but ``auto``).
FAMILIES = _options.DWCONV_KERNELS[1:]
_EXTENSION = _cuda.extension_available()
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define(
    "depthwise_conv2d(Tensor x, Tensor weight, Tensor? bias, bool add_input, bool silu, int kernel, "
    "int cols) -> Tensor"
)
_LIB.define(
    "depthwise_conv2d_backward(Tensor grad_y, Tensor x, Tensor weight, bool has_bias, bool add_input, int kernel, "
    "int cols) -> (Tensor, Tensor, Tensor)"
)


def kernel_available() -> bool:
    """Whether gspn2's CUDA extension, which holds the kernel, is built."""
    return _EXTENSION


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if name != "bias" or t is not None:
            check_tensor("depthwise_conv2d", name, t)
    if x.dim() != 4:
        raise ValueError(f"depthwise_conv2d: `x` must be a (B, C, H, W) tensor, got {tuple(x.shape)}")
    for dim, size in zip("BCHW", x.shape):
        if size < 1:
            raise ValueError(
                f"depthwise_conv2d: `x` must have no empty dimension, got {dim} = 0 in {tuple(x.shape)}"
            )
    C = x.shape[1]
    if weight.dim() != 4 or weight.shape[0] != C or weight.shape[1] != 1 or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"depthwise_conv2d: `weight` must be (C, 1, K, K) with C = {C} (x's channels), got {tuple(weight.shape)}")
    if weight.shape[2] % 2 == 0:
        raise ValueError(f"depthwise_conv2d: `weight` must have an odd kernel size ('same' padding K // 2), got K = {weight.shape[2]}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != C):
        raise ValueError(f"depthwise_conv2d: `bias` must be (C,) with C = {C}, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"depthwise_conv2d: `{name}` is on {t.device}, `x` on {x.device}")


def _check_grad_y(grad_y: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(grad_y, torch.Tensor):
        raise TypeError(f"depthwise_conv2d: `grad_y` must be a torch.Tensor, got {type(grad_y).__name__}")
    if grad_y.layout != torch.strided or grad_y.is_nested:
        raise TypeError("depthwise_conv2d: `grad_y` must be a dense (strided) tensor")
    if tuple(grad_y.shape) != tuple(x.shape) or grad_y.dtype != x.dtype or grad_y.device != x.device:
        raise ValueError(
            f"depthwise_conv2d: `grad_y` must match `x` in shape, dtype and device ({tuple(x.shape)}, {x.dtype}, "
            f"{x.device}), got {tuple(grad_y.shape)}, {grad_y.dtype}, {grad_y.device}"
        )


def _check_flags(add_input, silu) -> None:
    for name, v in (("add_input", add_input), ("silu", silu)):
        if not isinstance(v, bool):
            raise TypeError(f"depthwise_conv2d: `{name}` must be a bool, got {type(v).__name__}")


def _check_variant(kernel: int, cols: int, x: Optional[torch.Tensor] = None, xname: str = "x") -> None:
    """The ``kernel`` and ``cols`` arguments, and for ``kernel`` 2 on CUDA tensors ``x``'s dtype and channels
    (the checks of gspn2/csrc/dwconv.cpp, here for fake tensors)."""
    if kernel not in (0, 1, 2):
        raise ValueError(f"gspn2: `kernel` must be 0, 1 or 2, got {kernel}")
    if cols not in (4, 8):
        raise ValueError(f"gspn2: `cols` must be 4 or 8, got {cols}")
    if kernel == 2 and x is not None and x.device.type == "cuda":
        family = "`kernel` 2 (the depthwise tensor-core kernels)"
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{family} takes float16 or bfloat16 `{xname}`, got {x.dtype}")
        if x.shape[1] % 8 != 0:
            raise ValueError(f"{family} takes C a multiple of 8, got C = {x.shape[1]}")


_CL = torch.channels_last


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=_CL)


def _use_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA kernel computes this call (CUDA tensors; the ``dwconv`` option decides)."""
    choice = _options.current().dwconv
    if choice == "cudnn" or weight.dim() != 4:  # a malformed weight: the caller's checks name it
        return False
    K = weight.shape[-1]
    if choice == "auto" and K not in AUTO_KERNEL_SIZES:  # the common cuDNN case: no further checks
        return False
    if _EXTENSION and x.dtype in _KERNEL_DTYPES and K in KERNEL_SIZES and x.is_contiguous(memory_format=_CL):
        return True
    if choice == "auto":
        return False
    reasons = []
    if not _EXTENSION:
        reasons.append("gspn2's CUDA extension is not built (pip install --no-build-isolation -e .)")
    if x.dtype not in _KERNEL_DTYPES:
        reasons.append(f"dtype {x.dtype} (the kernel takes float32, float16, bfloat16)")
    if K not in KERNEL_SIZES:
        reasons.append(f"kernel size {K} (the kernel takes {KERNEL_SIZES})")
    if not _channels_last(x):
        reasons.append("an input without channels_last memory")
    raise ValueError(f"{_options.DWCONV_ENV}=cuda, but the depthwise kernel cannot run: {'; '.join(reasons)}")


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` with ``ref``'s strides (the fake implementations promise ``empty_like`` of the input)."""
    return t if t.stride() == ref.stride() else torch.empty_like(ref).copy_(t)


def _conv_reference(x, weight, bias, add_input, silu, match_strides=True):
    y = F.conv2d(x, weight.to(x.dtype), cast_optional(bias, x.dtype), padding=weight.shape[-1] // 2, groups=x.shape[1])
    if add_input:
        y = y + x
    if silu:
        y = F.silu(y)
    return _like(y, x) if match_strides else y


def stencil_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    add_input: bool = False,
    silu: bool = False,
) -> torch.Tensor:
    """The depthwise convolution as K * K shifted multiply-adds of the zero-padded input, in plain tensor ops.

    ``conv(x) + bias [+ x]`` accumulated in float32 (float64 for float64 input) with taps in that dtype, as
    the CUDA kernels do, rounded to ``x``'s dtype, then SiLU if ``silu``. Under ``torch.compile`` Inductor
    makes the forward one pointwise kernel with K * K masked loads per output and fuses it with its
    neighbours; on gspn2_tiny that measured slower than the CUDA kernels (docs/benchmarks.md, "The
    depthwise convolution as shifted multiply-adds"), so only the option ``dwconv="stencil"`` runs it.
    Eagerly it materialises every shifted product (slow). Shapes as :func:`depthwise_conv2d`; returns
    ``x``'s dtype.
    """
    C, H, W = x.shape[1], x.shape[2], x.shape[3]
    K = weight.shape[-1]
    P = K // 2
    dt = torch.promote_types(x.dtype, torch.float32)  # float32 accumulation, float64 stays float64
    taps = weight.reshape(C, K * K).to(dt)
    xp = F.pad(x, (P, P, P, P))
    acc = x.to(dt) if add_input else None
    for i in range(K):
        for j in range(K):
            term = xp[:, :, i : i + H, j : j + W].to(dt) * taps[:, i * K + j].view(1, C, 1, 1)
            acc = term if acc is None else acc + term
    if bias is not None:
        acc = acc + bias.to(dt).view(1, C, 1, 1)
    y = acc.to(x.dtype)
    return F.silu(y) if silu else y


@torch.library.impl(_LIB, "depthwise_conv2d", "CompositeExplicitAutograd")
def _dwconv_reference(x, weight, bias, add_input, silu, kernel, cols):
    _check(x, weight, bias)
    _check_variant(kernel, cols)
    return _conv_reference(x, weight, bias, add_input, silu)


@torch.library.register_fake("gspn2::depthwise_conv2d", lib=_LIB)
def _dwconv_fake(x, weight, bias, add_input, silu, kernel, cols):
    _check(x, weight, bias)
    _check_variant(kernel, cols, x)
    return torch.empty_like(x)  # same shape, dtype and strides


def _backward_reference(grad_y, x, weight, has_bias, add_input):
    K = weight.shape[-1]
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad_y, x, weight.to(x.dtype), [x.shape[1]] if has_bias else None, [1, 1], [K // 2, K // 2], [1, 1],
        False, [0, 0], x.shape[1], [True, True, has_bias],
    )
    if add_input:
        grad_x = grad_x + grad_y
    grad_b = grad_b.to(weight.dtype) if has_bias else weight.new_zeros(weight.shape[0])
    return _like(grad_x, x), grad_w.to(weight.dtype).contiguous(), grad_b


@torch.library.impl(_LIB, "depthwise_conv2d_backward", "CompositeExplicitAutograd")
def _dwconv_backward_reference(grad_y, x, weight, has_bias, add_input, kernel, cols):
    _check(x, weight, None)
    _check_grad_y(grad_y, x)
    _check_variant(kernel, cols)
    return _backward_reference(grad_y, x, weight, has_bias, add_input)


@torch.library.register_fake("gspn2::depthwise_conv2d_backward", lib=_LIB)
def _dwconv_backward_fake(grad_y, x, weight, has_bias, add_input, kernel, cols):
    _check(x, weight, None)
    _check_grad_y(grad_y, x)
    _check_variant(kernel, cols, grad_y, "grad_y")
    return torch.empty_like(x), torch.empty_like(weight, memory_format=torch.contiguous_format), weight.new_empty(weight.shape[0])


refuse_nested(_LIB, "depthwise_conv2d", lambda x, weight, bias, *flags: _check(x, weight, bias))
def _check_backward_call(grad_y, x, weight, *flags):
    _check(x, weight, None)
    _check_grad_y(grad_y, x)


refuse_nested(_LIB, "depthwise_conv2d_backward", _check_backward_call)


def _setup_context(ctx, inputs, output):
    x, weight, bias, add_input, silu, kernel, cols = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.args = (add_input, kernel, cols)
    ctx.silu = silu


def _backward(ctx, grad_y):
    if ctx.silu:
        # ValueError, as the CUDA formula raises (gspn2/csrc/dwconv.cpp)
        raise ValueError(
            "gspn2::depthwise_conv2d with `silu`=True has no backward; depthwise_conv2d(..., silu=True) applies "
            "SiLU separately whenever autograd records"
        )
    x, weight = ctx.saved_tensors
    add_input, kernel, cols = ctx.args
    grad_x, grad_w, grad_b = torch.ops.gspn2.depthwise_conv2d_backward.default(
        grad_y.contiguous(memory_format=torch.channels_last) if _channels_last(x) else grad_y.contiguous(),
        x, weight, ctx.has_bias, add_input, kernel, cols,
    )
    return grad_x, grad_w, grad_b if ctx.has_bias else None, None, None, None, None


# Every device but CUDA, whose formula (the same one) is registered in C++ for the AutogradCUDA key.
torch.library.register_autograd("gspn2::depthwise_conv2d", _backward, setup_context=_setup_context, lib=_LIB)


def variant(kernel_size: int) -> tuple[int, int]:
    """The ``(kernel, cols)`` arguments of the op for this kernel size under the current options: the family
    (an index into :data:`FAMILIES`: 0, input-gradient and weight-gradient kernels, 1, one pass, 2, the
    tensor-core kernels) and the output columns per thread of the tile kernels."""
    o = _options.current()
    family, cols = o.dwconv_kernel, o.dwconv_tile_cols
    if family == "auto":
        family, cols = AUTO_VARIANT.get(kernel_size, ("tile", 4))
    return FAMILIES.index(family), cols


# variant() by kernel size for the options object in force (options are replaced, never changed in place).
_variants_for: Optional[_options.Options] = None
_variants: dict = {}


def _variant(kernel_size: int) -> tuple[int, int]:
    global _variants_for
    o = _options.current()
    if o is not _variants_for:
        _variants.clear()
        _variants_for = o
    v = _variants.get(kernel_size)
    if v is None:
        v = _variants[kernel_size] = variant(kernel_size)
    return v


_DIRECT = _cuda.direct_call("depthwise_conv2d")
_OP = torch.ops.gspn2.depthwise_conv2d.default


def _dwconv(x, weight, bias, add_input, silu):
    # Only the op lacks forward mode (the cuDNN and stencil paths have it).
    refuse_forward_ad("depthwise_conv2d", x=x, weight=weight, bias=bias)
    kernel, cols = _variant(weight.shape[-1])
    if _DIRECT is not None and _cuda.direct_call_allowed((x, weight, bias)):
        return _DIRECT(x, weight, bias, add_input, silu, kernel, cols)
    return _OP(x, weight, bias, add_input, silu, kernel, cols)


def depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    add_input: bool = False,
    silu: bool = False,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=K // 2, groups=C)``, plus ``x`` if ``add_input``, then SiLU if ``silu``.

    Args:
        x: ``(B, C, H, W)``; channels_last memory takes the CUDA kernel on CUDA tensors.
        weight: ``(C, 1, K, K)``, K odd (an ``nn.Conv2d(C, C, K, padding=K // 2, groups=C)``'s weight).
        bias: ``(C,)`` or None.
        add_input: Return ``x + conv(x)`` in one pass (its gradient adds ``grad_y`` to ``grad_x``).
        silu: Apply SiLU to the result: in the same pass when autograd does not record (inference), as a
            separate ``F.silu`` when it does (the fused op keeps no pre-activation for backward).

    Under autocast ``x`` is cast to the autocast dtype, as ``F.conv2d`` would be; the kernel reads the
    weight and bias in float32 and accumulates in float32. Returns ``x``'s dtype and strides.
    """
    if add_input.__class__ is not bool or silu.__class__ is not bool:
        _check_flags(add_input, silu)  # raises the TypeError
    if not isinstance(x, torch.Tensor):
        check_tensor("depthwise_conv2d", "x", x)  # raises the TypeError
    device_type = "cuda" if x.is_cuda else x.device.type
    if autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if add_input and dtype != x.dtype:  # x + conv(x) promotes to x's dtype, as in eager
            y = x + depthwise_conv2d(x.to(dtype), weight, bias)
            return F.silu(y) if silu else y
        if x.dtype != dtype:
            x = x.to(dtype)
    if x.is_cuda and _options.current().dwconv == "stencil":
        _check(x, weight, bias)
        return stencil_conv2d(x, weight, bias, add_input, silu)
    # The kernel's C++ implementation checks every argument (gspn2/csrc/dwconv.cpp); other paths check here.
    if not (x.is_cuda and isinstance(weight, torch.Tensor) and _use_kernel(x, weight)):
        _check(x, weight, bias)
        if x.is_cuda:  # cuDNN: plain ops, which torch.compile can fuse around
            return _conv_reference(x, weight, bias, add_input, silu, match_strides=False)
    if silu and torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return F.silu(_dwconv(x, weight, bias, add_input, False))
    return _dwconv(x, weight, bias, add_input, silu)
