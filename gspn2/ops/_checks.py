"""Input validation of the ``gspn2::propagate`` ops on every device but CUDA (whose checks are in C++,
``gspn2/csrc/propagate.cpp``): the CPU (reference) implementation and the fake implementation run these.
They fail early and name the argument and the expected shape. Each dimension is compared on its own, so that
symbolic sizes (``torch.export`` with dynamic batch, height and width) are not tied to each other.
"""

from __future__ import annotations

import torch

from gspn2.ops.options import CLUSTER_CTAS, KERNELS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The largest ``chunk`` the op's schema (a 64-bit int) carries.
CHUNK_MAX = 2**63 - 1


def check_chunk(chunk) -> None:
    """``chunk`` must be None or an int in [1, 2^63)."""
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"gspn_propagate: `chunk` must be None or an int, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"gspn_propagate: `chunk` must be None or >= 1, got {chunk}")
    if chunk > CHUNK_MAX:
        raise ValueError(
            f"gspn_propagate: `chunk` must be below 2^63, got {chunk}; use chunk=None for one scan over the image"
        )


def check_kernel_type(kernel) -> None:
    """``kernel`` must be a str (the op's schema would refuse an int with a RuntimeError, and decode bytes)."""
    if not isinstance(kernel, str):
        raise TypeError(
            f"gspn_propagate: `kernel` must be a str ('auto', 'fast', 'general', 'cluster' or 'short'), "
            f"got {type(kernel).__name__}"
        )


def check_options(kernel: str, cluster_ctas: int) -> None:
    """The op's ``kernel`` and ``cluster_ctas`` arguments (used by the CUDA kernels, validated everywhere)."""
    check_kernel_type(kernel)
    if kernel not in KERNELS:
        raise ValueError(f"gspn2: `kernel` must be 'auto', 'fast', 'general', 'cluster' or 'short', got {kernel!r}")
    if cluster_ctas not in CLUSTER_CTAS:
        raise ValueError(f"gspn2: `cluster_ctas` must be 0 (the planner's choice), 2, 4 or 8, got {cluster_ctas}")


def refuse_nested(lib: torch.library.Library, op: str, check) -> None:
    """Give ``gspn2::<op>`` an implementation for nested tensors that runs ``check`` (which refuses them by
    argument name). Strided nested tensors dispatch to the NestedTensor keys, which
    ``CompositeExplicitAutograd`` does not cover, and jagged ones to their tensor subclass; without this both
    end in a ``NotImplementedError`` that names no argument."""
    from torch.nested._internal.nested_tensor import NestedTensor  # the jagged layout's subclass

    def refuse(*args):
        check(*args)
        raise TypeError(f"gspn2::{op} takes dense (strided) tensors only, got a nested tensor")

    # AutogradNestedTensor too: the backward ops have no autograd kernel that would pass nested tensors on.
    for key in ("AutogradNestedTensor", "NestedTensorCPU", "NestedTensorCUDA", "NestedTensorMeta"):
        if hasattr(torch._C.DispatchKey, key):
            lib.impl(op, refuse, key)
    torch.library.register_torch_dispatch(
        f"gspn2::{op}", NestedTensor, lambda mode, func, types, args, kwargs: refuse(*args, **kwargs), lib=lib
    )


def check_tensor(op: str, name: str, t) -> None:
    """Argument ``name`` of ``op`` must be a dense floating-point tensor of a dtype the ops take."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        layout = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{op}: `{name}` must be a dense (strided) tensor, got {layout}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: `{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_propagate_inputs(x: torch.Tensor, lam: torch.Tensor, gates: torch.Tensor, chunk: int | None) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending argument; return ``None`` if all is well."""
    for name, t in (("x", x), ("lam", lam), ("gates", gates)):
        check_tensor("gspn_propagate", name, t)
    if x.dim() != 4:
        raise ValueError(f"gspn_propagate: `x` must have shape (B, C, H, W), got {tuple(x.shape)}")
    B, C, H, W = x.shape
    for dim, size in zip("BCHW", (B, C, H, W)):
        if size < 1:
            raise ValueError(f"gspn_propagate: `x` must have no empty dimension, got {dim} = 0 in {tuple(x.shape)}")
    if lam.dim() != 5 or tuple(lam.shape) != (B, 4, C, H, W):
        raise ValueError(
            f"gspn_propagate: `lam` must have shape (B, 4, C, H, W) = {(B, 4, C, H, W)}, got {tuple(lam.shape)}"
        )
    if gates.dim() != 6:
        raise ValueError(f"gspn_propagate: `gates` must have shape (B, 4, 3, K, H, W), got {tuple(gates.shape)}")
    K = gates.shape[3]
    if K < 1 or C % K != 0:
        raise ValueError(f"gspn_propagate: `gates` has K = {K} affinity groups (dim 3), which must divide C = {C}")
    if tuple(gates.shape) != (B, 4, 3, K, H, W):
        raise ValueError(
            f"gspn_propagate: `gates` must have shape (B, 4, 3, K, H, W) = {(B, 4, 3, K, H, W)}, "
            f"got {tuple(gates.shape)}"
        )
    if lam.dtype != x.dtype or gates.dtype != x.dtype:
        raise TypeError(
            "gspn_propagate: `x`, `lam` and `gates` must share one dtype, got "
            f"x={x.dtype}, lam={lam.dtype}, gates={gates.dtype}"
        )
    if lam.device != x.device or gates.device != x.device:
        raise ValueError(
            "gspn_propagate: `x`, `lam` and `gates` must be on one device, got "
            f"x={x.device}, lam={lam.device}, gates={gates.device}"
        )
    check_chunk(chunk)


def check_backward_inputs(grad_h: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_h`` and ``h`` of ``gspn2::propagate_backward``: (B, 4, C, H, W), x's dtype and device."""
    B, C, H, W = x.shape
    for name, t in (("grad_h", grad_h), ("h", h)):
        check_tensor("gspn_propagate", name, t)
        if tuple(t.shape) != (B, 4, C, H, W):
            raise ValueError(f"gspn2: `{name}` must have shape (B, 4, C, H, W) = {(B, 4, C, H, W)}, got {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"gspn2: `{name}` must match `x` in dtype and device, got {t.dtype} on {t.device}")


def refuse_forward_ad(op: str, **tensors) -> None:
    """Raise ``NotImplementedError`` naming the argument if a tensor carries a forward-mode AD tangent: the
    ops have reverse-mode formulas only, and the Python autograd registration would otherwise return an
    output without its tangent. Free outside ``torch.autograd.forward_ad.dual_level()``."""
    if torch.autograd.forward_ad._current_level < 0:
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op}: `{name}` carries a forward-mode AD tangent; the op supports reverse-mode autograd only"
            )
