"""``gspn2::merge_norm_gate``: the GSPN-2 mixer's output chain up to its last GEMM, as one op.

The mixer merges the four directions' proxy outputs back to its hidden width ``E``, adds the skip, normalises
and gates (docs/spec.md, section 2)::

    out = layer_norm(x @ weight.T + bias + skip_input * skip) * silu(gate)

with ``x`` the ``(N, R)`` rows of ``u * h`` (``R = 4 * C_proxy``, 8 in GSPN-2), ``skip_input`` the value
branch ``v`` and ``gate`` the gate branch ``z``, both ``(N, E)``, and the LayerNorm over the ``E`` channels
with an affine ``norm_weight``, ``norm_bias``. As separate ops this is a GEMM with 8 inputs per output, an
``addcmul``, a LayerNorm and a gated product, each reading and writing ``(N, E)`` activations, and their
backward twice as many passes. Here the forward reads ``skip_input`` and ``gate`` once and writes ``out``;
the backward (two kernels) reads ``grad_out``, ``skip_input`` and ``gate`` twice and writes the gradients of
``skip_input`` and ``gate`` once (``y`` and the normalised ``y`` are recomputed from the saved row
statistics, not kept).

Ops (the public entry is :func:`merge_norm_gate`):

* ``gspn2::merge_norm_gate(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
  -> (out, mean, rstd)``: ``mean``, ``rstd`` are the LayerNorm's float32 row statistics (saved for backward);
* ``gspn2::merge_norm_gate_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate,
  mean, rstd) -> (grad_x, grad_weight, grad_bias, grad_skip_input, grad_skip, grad_norm_weight,
  grad_norm_bias, grad_gate)``.

Implementations: on CUDA for float32, float16 and bfloat16 activations the Triton kernels of
:mod:`gspn2.ops._merge_triton` (float32 arithmetic; the parameter gradients as per-program partial sums
added in a fixed order: deterministic); everywhere else (and for float64) :func:`merge_norm_gate_ref` and
:func:`merge_norm_gate_backward_ref`, the same formulas in PyTorch. Activations (``x``, ``skip_input``,
``gate``) share one dtype, which ``out`` and their gradients have; the five parameters keep theirs (float32
under autocast, read as such: no cast copies), as do their gradients.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from gspn2.ops._amp import autocast_enabled, autocast_off
from gspn2.ops._checks import check_tensor, refuse_nested
from gspn2.ops.reference import _compute_dtype  # float32 for 16-bit activations: arithmetic and statistics

__all__ = ["merge_norm_gate", "merge_norm_gate_backward_ref", "merge_norm_gate_ref", "triton_available"]

try:
    from gspn2.ops import _merge_triton
except ImportError:  # no Triton (CPU-only torch builds): the reference runs everywhere
    _merge_triton = None

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_LIB = torch.library.Library("gspn2", "FRAGMENT")
_LIB.define(
    "merge_norm_gate(Tensor x, Tensor weight, Tensor bias, Tensor skip_input, Tensor skip, Tensor norm_weight, "
    "Tensor norm_bias, float eps, Tensor gate) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "merge_norm_gate_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor bias, Tensor skip_input, "
    "Tensor skip, Tensor norm_weight, Tensor norm_bias, Tensor gate, Tensor mean, Tensor rstd) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def triton_available() -> bool:
    """Whether the Triton kernels can be imported (CUDA tensors then run them)."""
    return _merge_triton is not None


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps):
        raise ValueError(f"merge_norm_gate: `eps` must be a finite float > 0, got {eps!r}")


def _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument; each size compared on its own."""
    op = "merge_norm_gate"
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("skip_input", skip_input), ("skip", skip),
                    ("norm_weight", norm_weight), ("norm_bias", norm_bias), ("gate", gate)):
        check_tensor(op, name, t)
    _check_eps(eps)
    if skip_input.dim() != 2:
        raise ValueError(f"{op}: `skip_input` must be (N, E) rows, got shape {tuple(skip_input.shape)}")
    N, E = skip_input.shape
    if E < 1:
        raise ValueError(f"{op}: `skip_input` must have E >= 1 channels, got shape {tuple(skip_input.shape)}")
    if x.dim() != 2 or x.shape[0] != N or x.shape[1] < 1:
        raise ValueError(
            f"{op}: `x` must be (N, R) rows with N = {N} (skip_input's rows), R >= 1, got {tuple(x.shape)}"
        )
    R = x.shape[1]
    if gate.dim() != 2 or gate.shape[0] != N or gate.shape[1] != E:
        raise ValueError(f"{op}: `gate` must be (N, E) = {(N, E)} like `skip_input`, got {tuple(gate.shape)}")
    if weight.dim() != 2 or weight.shape[0] != E or weight.shape[1] != R:
        raise ValueError(f"{op}: `weight` must be (E, R) = {(E, R)}, got {tuple(weight.shape)}")
    for name, t in (("bias", bias), ("skip", skip), ("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t.dim() != 1 or t.shape[0] != E:
            raise ValueError(f"{op}: `{name}` must be (E,) = ({E},), got {tuple(t.shape)}")
    if x.dtype != skip_input.dtype or gate.dtype != skip_input.dtype:
        raise TypeError(
            f"{op}: `x`, `skip_input` and `gate` must share one dtype, got x={x.dtype}, "
            f"skip_input={skip_input.dtype}, gate={gate.dtype}"
        )
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("skip", skip), ("norm_weight", norm_weight),
                    ("norm_bias", norm_bias), ("gate", gate)):
        if t.device != skip_input.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, `skip_input` on {skip_input.device}")


def _check_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd) -> None:
    _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, 1.0, gate)
    op = "merge_norm_gate_backward"
    check_tensor(op, "grad_out", grad_out)
    if tuple(grad_out.shape) != tuple(skip_input.shape) or grad_out.dtype != skip_input.dtype:
        raise ValueError(
            f"{op}: `grad_out` must match `skip_input` ({tuple(skip_input.shape)}, {skip_input.dtype}), "
            f"got {tuple(grad_out.shape)}, {grad_out.dtype}"
        )
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(op, name, t)
        if t.dim() != 1 or t.shape[0] != skip_input.shape[0]:
            raise ValueError(f"{op}: `{name}` must be (N,) = ({skip_input.shape[0]},), got {tuple(t.shape)}")
    for name, t in (("grad_out", grad_out), ("mean", mean), ("rstd", rstd)):
        if t.device != skip_input.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, `skip_input` on {skip_input.device}")


def _merged(x, weight, bias, skip_input, skip, ct):
    return torch.addmm(bias.to(ct), x.to(ct), weight.to(ct).t()) + skip_input.to(ct) * skip.to(ct)


def merge_norm_gate_ref(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate) -> torch.Tensor:
    """``layer_norm(x @ weight.T + bias + skip_input * skip) * silu(gate)`` in plain differentiable PyTorch:
    computed in float32 (float64 for float64 activations), returned in the activations' dtype."""
    _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
    ct = _compute_dtype(skip_input.dtype)
    with autocast_off(skip_input.device.type):  # the stated dtypes, also inside an autocast region
        y = _merged(x, weight, bias, skip_input, skip, ct)
        n = F.layer_norm(y, (y.shape[-1],), norm_weight.to(ct), norm_bias.to(ct), eps)
        return (n * F.silu(gate.to(ct))).to(skip_input.dtype)


def _forward_ref(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate):
    ct = _compute_dtype(skip_input.dtype)
    with autocast_off(skip_input.device.type):
        y = _merged(x, weight, bias, skip_input, skip, ct)
        var, mean = torch.var_mean(y, dim=-1, correction=0)
        rstd = torch.rsqrt(var + eps)
        a = (y - mean[:, None]) * rstd[:, None] * norm_weight.to(ct) + norm_bias.to(ct)
        return (a * F.silu(gate.to(ct))).to(skip_input.dtype), mean, rstd


def merge_norm_gate_backward_ref(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean,
                                 rstd):
    """The gradients of :func:`merge_norm_gate_ref` from its output gradient and the forward's row statistics,
    written out (the formulas the CUDA kernel computes): ``(grad_x, grad_weight, grad_bias, grad_skip_input,
    grad_skip, grad_norm_weight, grad_norm_bias, grad_gate)``, each in its input's dtype."""
    _check_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd)
    with autocast_off(skip_input.device.type):
        ct = _compute_dtype(skip_input.dtype)
        E = skip_input.shape[1]
        y = _merged(x, weight, bias, skip_input, skip, ct)
        n = (y - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
        nw = norm_weight.to(ct)
        a = n * nw + norm_bias.to(ct)
        z = gate.to(ct)
        sg = torch.sigmoid(z)
        go = grad_out.to(ct)
        ga = go * z * sg
        grad_gate = go * a * sg * (1 + z * (1 - sg))
        gn = ga * nw
        gy = rstd.to(ct)[:, None] * (gn - gn.sum(1, keepdim=True) / E - n * (gn * n).sum(1, keepdim=True) / E)
        grad_x = gy @ weight.to(ct)
        grad_weight = gy.t() @ x.to(ct)
        act = skip_input.dtype
        return (
            grad_x.to(x.dtype), grad_weight.to(weight.dtype), gy.sum(0).to(bias.dtype), (gy * skip.to(ct)).to(act),
            (gy * skip_input.to(ct)).sum(0).to(skip.dtype), (ga * n).sum(0).to(norm_weight.dtype),
            ga.sum(0).to(norm_bias.dtype), grad_gate.to(gate.dtype),
        )


def _use_triton(t: torch.Tensor) -> bool:
    return _merge_triton is not None and t.dtype in _KERNEL_DTYPES


@torch.library.impl(_LIB, "merge_norm_gate", "CompositeExplicitAutograd")
def _forward_reference(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate):
    _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
    return _forward_ref(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)


def triton_forward(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate, cfg):
    """The Triton forward on contiguous rows (N >= 1) with the launch configuration ``cfg``
    (:func:`gspn2.ops._merge_triton.config`'s keys): ``(out, mean, rstd)``."""
    N, E = skip_input.shape
    out = torch.empty((N, E), dtype=skip_input.dtype, device=skip_input.device)
    mean = torch.empty((N,), dtype=torch.float32, device=skip_input.device)
    rstd = torch.empty_like(mean)
    _merge_triton.forward(x, weight, bias, skip_input, skip, norm_weight, norm_bias, float(eps), gate, out, mean, rstd,
                          block_m=cfg["fwd_block_m"], num_warps=cfg["fwd_warps"], block_e=cfg["block_e"])
    return out, mean, rstd


@torch.library.impl(_LIB, "merge_norm_gate", "CUDA")
def _forward_cuda(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate):
    _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
    if not _use_triton(skip_input) or skip_input.shape[0] == 0:
        return _forward_ref(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
    with torch.cuda.device(skip_input.device):
        return triton_forward(
            x.contiguous(), weight.contiguous(), bias.contiguous(), skip_input.contiguous(), skip.contiguous(),
            norm_weight.contiguous(), norm_bias.contiguous(), eps, gate.contiguous(),
            _merge_triton.config(skip_input.shape[1]),
        )


@torch.library.register_fake("gspn2::merge_norm_gate", lib=_LIB)
def _forward_fake(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate):
    _check(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate)
    N = skip_input.shape[0]
    stats = skip_input.new_empty((N,), dtype=_compute_dtype(skip_input.dtype))  # the statistics' dtype
    return torch.empty_like(skip_input, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.impl(_LIB, "merge_norm_gate_backward", "CompositeExplicitAutograd")
def _backward_reference(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd):
    return merge_norm_gate_backward_ref(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate,
                                        mean, rstd)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SMs of CUDA device ``index`` (cached: the Triton ops' launchers size their grids by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_programs(device: torch.device, N: int, E: int, cfg: dict, per_sm: int = 4) -> int:
    """Runs of row blocks per channel chunk in the backward: at least two row blocks each, about ``per_sm``
    programs per SM in all (as many as stay resident with the default configuration)."""
    blocks = -(-N // cfg["bwd_block_m"])
    chunks = -(-E // cfg["chunk_e"])
    return max(1, min((blocks + 1) // 2, per_sm * sm_count(device.index) // chunks))


def triton_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd, cfg,
                    programs):
    """The Triton backward on contiguous rows (N >= 1) with the launch configuration ``cfg`` and ``programs``
    runs of row blocks per channel chunk: the op's eight gradients."""
    N, E = skip_input.shape
    R = x.shape[1]
    f32 = dict(dtype=torch.float32, device=skip_input.device)
    grad_v = torch.empty((N, E), dtype=skip_input.dtype, device=skip_input.device)
    grad_gate = torch.empty((N, E), dtype=gate.dtype, device=gate.device)
    # Every program writes its whole share: no initialisation.
    c1, c2 = torch.empty((N,), **f32), torch.empty((N,), **f32)
    grad_x_parts = torch.empty((-(-E // cfg["chunk_e"]), N, R), **f32)
    part_vec = torch.empty((programs, 4, E), **f32)
    part_w = torch.empty((programs, E, R), **f32)
    _merge_triton.backward(
        grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd, c1, c2, grad_x_parts,
        grad_v, grad_gate, part_vec, part_w, block_e=cfg["block_e"], rows_block_m=cfg["fwd_block_m"],
        rows_warps=cfg["fwd_warps"], block_m=cfg["bwd_block_m"], chunk_e=cfg["chunk_e"], num_warps=cfg["bwd_warps"],
    )
    vec = part_vec.sum(0)
    return (
        grad_x_parts.sum(0).to(x.dtype), part_w.sum(0).to(weight.dtype), vec[3].to(bias.dtype), grad_v,
        vec[2].to(skip.dtype), vec[0].to(norm_weight.dtype), vec[1].to(norm_bias.dtype), grad_gate,
    )


@torch.library.impl(_LIB, "merge_norm_gate_backward", "CUDA")
def _backward_cuda(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd):
    _check_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd)
    if (not _use_triton(skip_input) or skip_input.shape[0] == 0 or mean.dtype != torch.float32
            or rstd.dtype != torch.float32):
        return merge_norm_gate_backward_ref(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias,
                                            gate, mean, rstd)
    dev = skip_input.device
    cfg = _merge_triton.config(skip_input.shape[1])
    with torch.cuda.device(dev):
        return triton_backward(
            grad_out.contiguous(), x.contiguous(), weight.contiguous(), bias.contiguous(), skip_input.contiguous(),
            skip.contiguous(), norm_weight.contiguous(), norm_bias.contiguous(), gate.contiguous(),
            mean.contiguous(), rstd.contiguous(), cfg, row_programs(dev, *skip_input.shape, cfg),
        )


@torch.library.register_fake("gspn2::merge_norm_gate_backward", lib=_LIB)
def _backward_fake(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd):
    _check_backward(grad_out, x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd)
    rows = torch.contiguous_format
    return (
        torch.empty_like(x, memory_format=rows), torch.empty_like(weight, memory_format=rows),
        torch.empty_like(bias), torch.empty_like(skip_input, memory_format=rows), torch.empty_like(skip),
        torch.empty_like(norm_weight), torch.empty_like(norm_bias), torch.empty_like(gate, memory_format=rows),
    )


refuse_nested(_LIB, "merge_norm_gate", lambda *args: _check(*args))
refuse_nested(_LIB, "merge_norm_gate_backward", lambda *args: _check_backward(*args))


def _setup_context(ctx, inputs, output):
    x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps, gate = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd)


def _backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd = ctx.saved_tensors
    grads = torch.ops.gspn2.merge_norm_gate_backward.default(
        grad_out.contiguous(), x, weight, bias, skip_input, skip, norm_weight, norm_bias, gate, mean, rstd
    )
    grad_x, grad_w, grad_b, grad_v, grad_s, grad_nw, grad_nb, grad_gate = grads
    return grad_x, grad_w, grad_b, grad_v, grad_s, grad_nw, grad_nb, None, grad_gate


torch.library.register_autograd("gspn2::merge_norm_gate", _backward, setup_context=_setup_context, lib=_LIB)


def merge_norm_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    skip_input: torch.Tensor,
    skip: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
) -> torch.Tensor:
    """``layer_norm(x @ weight.T + bias + skip_input * skip) * silu(gate)``, the LayerNorm over the last
    dimension with ``norm_weight``, ``norm_bias`` and ``eps``: one pass forward, one backward.

    Args:
        x: ``(N, R)`` rows (the mixer: ``u * h`` of the four directions).
        weight: ``(E, R)``; bias: ``(E,)`` (the merging 1x1 convolution ``proj_up``).
        skip_input: ``(N, E)``; skip: ``(E,)`` (the mixer's ``D * v`` skip).
        norm_weight, norm_bias: ``(E,)``; eps: > 0 (the LayerNorm after the merge).
        gate: ``(N, E)``, multiplied in as ``silu(gate)``.

    Under autocast the activations ``x``, ``skip_input`` and ``gate`` are cast to the autocast dtype (as a
    GEMM on them would be); the parameters are read in their own dtype and their gradients come back in it.
    Returns ``(N, E)`` in the activations' dtype. Raises ``TypeError`` / ``ValueError`` naming the argument.
    """
    # Before the schema, which would turn a bool eps into 1.0 and refuse a non-tensor without naming it.
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("skip_input", skip_input), ("skip", skip),
                    ("norm_weight", norm_weight), ("norm_bias", norm_bias), ("gate", gate)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_norm_gate: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    _check_eps(eps)
    device_type = skip_input.device.type
    if autocast_enabled(device_type):
        dt = torch.get_autocast_dtype(device_type)
        x, skip_input, gate = x.to(dt), skip_input.to(dt), gate.to(dt)
    return torch.ops.gspn2.merge_norm_gate.default(x, weight, bias, skip_input, skip, norm_weight, norm_bias, eps,
                                                   gate)[0]
