"""Fuzz gspn2's op entries with bad and edge inputs, each case in its own process.

Targets: the public functions ``gspn2.ops.gspn_propagate`` and ``gspn2.ops.depthwise_conv2d``, the raw ops
``torch.ops.gspn2.propagate`` / ``propagate_backward`` / ``depthwise_conv2d`` / ``depthwise_conv2d_backward``,
the option setters of ``gspn2.ops.options``, and both public functions under
``torch.compile(fullgraph=True, backend="eager")``.

Every case runs in a child process (forked from a parent that has imported gspn2, or spawned with
``--start spawn``; the default on CUDA), so that a crash, an abort or a hang is seen: a per-case timeout kills
the child. Outcomes:

==========  =======================================================================================
OK-CLEAR    bad input: ``TypeError`` / ``ValueError`` whose message names the offending argument
            (```name``` in backticks). Under ``torch.compile``: the eager call is OK-CLEAR and the
            compiled call's error (dynamo wraps every error raised while tracing in its own exception
            type under ``fullgraph=True``) carries the eager message verbatim.
OK-SCHEMA   raw ops only: torch's schema matcher refused a Python value of the wrong type for the argument
            (``RuntimeError ... for argument 'name'``) before any gspn2 code ran.
OK-RESULT   valid input: right shape, dtype and device, equal to the float64 reference
            (``gspn_propagate_ref``, ``F.conv2d``) within the dtype's tolerance, NaN/inf exactly where the
            reference has them; gradients likewise.
SKIP        the case's inputs cannot be built in this build of torch (reported, not flagged).
CRYPTIC     another exception type, or a message that does not name the argument (flagged)
SILENT      bad input accepted (flagged)
WRONG       valid input, result differs from the reference, or refused (flagged)
CRASH       the child died from a signal or exited non-zero without a Python exception (flagged)
HANG        the child ran past ``--timeout`` (flagged)
==========  =======================================================================================

Raw ops receive their arguments through torch's schema conversion, which turns ``True`` into ``1`` for an
``int`` argument and an ``int`` into a ``bool`` for a ``bool`` argument; those cases expect the result of the
converted value.

    python scripts/fuzz_op.py --jobs 2 --out fuzz.json          # every case, CPU
    python scripts/fuzz_op.py --device cuda --jobs 8            # CUDA tensors (the C++ checks)
    python scripts/fuzz_op.py -k chunk --limit 20               # a subset while iterating

Exit status 1 if any case is flagged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401  (registers the ops)
from gspn2.ops import depthwise_conv2d, gspn_propagate, gspn_propagate_ref, options

OK_LABELS = ("OK-CLEAR", "OK-SCHEMA", "OK-RESULT", "SKIP")
FLAGGED_LABELS = ("CRYPTIC", "SILENT", "WRONG", "CRASH", "HANG")
LABELS = OK_LABELS + FLAGGED_LABELS
MESSAGE_CHARS = 4000


class Wrong(AssertionError):
    """A valid input gave a result that differs from the reference."""


class SetupError(Exception):
    """The case's inputs could not be built (not a finding about gspn2)."""


@dataclasses.dataclass
class Call:
    """What a case runs: ``run()`` calls gspn2; ``check(out)`` raises :class:`Wrong` on a bad result.
    ``eager`` (compile cases): the same call without ``torch.compile``."""

    run: Callable[[], Any]
    check: Optional[Callable[[Any], None]] = None
    eager: Optional[Callable[[], Any]] = None
    expect: Optional[str] = None  # overrides the case's expectation on this device (see cuda_limits)


@dataclasses.dataclass
class Case:
    name: str
    build: Callable[[str], Call]  # device -> Call (builds the inputs; SetupError if this torch cannot)
    expect: str  # "error": bad input; "result": valid input; "either": a clear error or the right result
    names: tuple = ()  # the arguments an error may name
    raw: bool = False  # a raw torch.ops call (the schema matcher may refuse it: OK-SCHEMA)
    compile: bool = False


# ----------------------------------------------------------------------------------------------------------
# Inputs and references


def _randn(shape, dtype, dev, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device=dev, dtype=dtype)


def prop_inputs(dev, B=1, C=2, H=3, W=4, K=1, dtype=torch.float32, seed=0):
    return (
        _randn((B, C, H, W), dtype, dev, seed),
        _randn((B, 4, C, H, W), dtype, dev, seed + 1),
        _randn((B, 4, 3, K, H, W), dtype, dev, seed + 2, scale=2.0),
    )


def dw_inputs(dev, B=1, C=3, H=5, W=6, K=3, dtype=torch.float32, wdtype=None, seed=0, bias=True):
    wdtype = dtype if wdtype is None else wdtype
    x = _randn((B, C, H, W), dtype, dev, seed)
    w = _randn((C, 1, K, K), wdtype, dev, seed + 1, scale=0.3)
    b = _randn((C,), wdtype, dev, seed + 2) if bias else None
    return x, w, b


_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def assert_close(got, ref, dtype, what="result"):
    """``got`` equals ``ref`` (float64, CPU) within ``dtype``'s tolerance, non-finite values at the same places."""
    if not isinstance(got, torch.Tensor):
        raise Wrong(f"{what}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(ref.shape):
        raise Wrong(f"{what}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
    if got.device.type == "meta":
        return
    g = got.detach().to("cpu", torch.float64)
    for label, mask in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(mask(g), mask(ref)):
            raise Wrong(f"{what}: {label} at {int(mask(g).sum())} places, reference {int(mask(ref).sum())}")
    finite = torch.isfinite(ref)
    if finite.any():
        tol = _TOL[dtype]
        scale = max(1.0, float(ref[finite].abs().max()))
        err = float((g[finite] - ref[finite]).abs().max())
        if not err <= tol * scale:
            raise Wrong(f"{what}: max abs error {err:.3g} > {tol * scale:.3g} ({dtype})")


def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def check_prop(x, lam, gates, chunk, finite=False):
    """The check of a propagation result: the float64 reference on the same values."""
    ref = gspn_propagate_ref(_f64(x), _f64(lam), _f64(gates), chunk)

    def check(h):
        if h.dtype != x.dtype or h.device != x.device:
            raise Wrong(f"dtype/device {h.dtype} on {h.device}, expected {x.dtype} on {x.device}")
        assert_close(h, ref, x.dtype)
        if finite and not bool(torch.isfinite(h).all()):
            raise Wrong("non-finite output where every value must be finite")

    return check


def _to64(t):
    return None if t is None else t.to("cpu", torch.float64)  # keeps the autograd graph (gradient references)


def conv_ref(x, w, b, add_input=False, silu=False):
    x64 = _to64(x)
    y = F.conv2d(x64, _to64(w), _to64(b), padding=w.shape[-1] // 2, groups=x.shape[1])
    if add_input:
        y = y + x64
    return F.silu(y) if silu else y


def check_dw(x, w, b, add_input=False, silu=False):
    ref = conv_ref(_f64(x), _f64(w), _f64(b), add_input, silu)
    dt = x.dtype

    def check(y):
        if y.dtype != dt or y.device != x.device:
            raise Wrong(f"dtype/device {y.dtype} on {y.device}, expected {dt} on {x.device}")
        assert_close(y, ref, torch.float32 if dt == torch.float64 and w.dtype != dt else dt)

    return check


def _grad_check(inputs, fn_op, fn_ref, seed=5):
    """Run ``fn_op`` with autograd on ``inputs`` (those requiring grad), compare values and gradients with
    ``fn_ref`` on float64 copies."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    out = fn_op(*inputs)
    copies = [None if t is None else _f64(t).requires_grad_(t.requires_grad) for t in inputs]
    ref = fn_ref(*copies)
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = torch.autograd.grad((out * r.to(out.dtype)).sum(), leaves) if leaves else ()
    expected = torch.autograd.grad((ref * r).sum(), [c for c in copies if c is not None and c.requires_grad]) if leaves else ()
    return out, ref, got, expected


def cuda_limits(raw: bool, x, weight=None) -> Optional[str]:
    """``"either"`` where a raw op's CUDA implementation refuses a valid input by design: float64 (the public
    functions route it to the reference or cuDNN) and depthwise kernel sizes other than 3, 5, 7."""
    if not (raw and isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    if x.dtype == torch.float64 or (weight is not None and weight.shape[-1] not in (3, 5, 7)):
        return "either"
    return None


# ----------------------------------------------------------------------------------------------------------
# The cases


def _pub_prop(x, lam, gates, chunk=None, kernel=None):
    return gspn_propagate(x, lam, gates, chunk) if kernel is None else gspn_propagate(x, lam, gates, chunk, kernel=kernel)


def _raw_prop(x, lam, gates, chunk=None, kernel="auto", cluster_ctas=0):
    return torch.ops.gspn2.propagate.default(x, lam, gates, chunk, kernel, cluster_ctas)


PROP_ENTRIES = (("prop", _pub_prop, False), ("rawprop", _raw_prop, True))


def _meta(t):
    return t.to("meta")


def _other_device(dev):
    return "cpu" if dev != "cpu" else "meta"


def _nested(t, layout):
    """A nested tensor of ``t``'s batch entries (two copies of the first one for a batch of one)."""
    return torch.nested.nested_tensor(list(t.unbind(0)) if t.shape[0] > 1 else [t[0], t[0]], layout=layout)


def _sparse(t):
    return t.to_sparse()


def _mkldnn(t):
    if not torch.backends.mkldnn.is_available():
        raise SetupError("this torch has no mkldnn")
    try:
        return t.float().to_mkldnn()
    except RuntimeError as e:  # e.g. mkldnn tensors on a CUDA device
        raise SetupError(f"to_mkldnn: {e}") from e


def _transposed(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _strided_view(t):
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    big[..., 1::2] = t
    return big[..., 1::2]


def prop_bad_tensor_cases():
    """(label, f(dev) -> (x, lam, gates), names) of bad tensor inputs of the propagation."""
    P = prop_inputs
    cases = [
        ("x-rank3", lambda d: (P(d)[0][0],) + P(d)[1:], ("x",)),
        ("x-rank5", lambda d: (P(d)[0][None],) + P(d)[1:], ("x",)),
        ("x-rank0", lambda d: (torch.tensor(1.0, device=d),) + P(d)[1:], ("x",)),
        ("lam-rank4", lambda d: (P(d)[0], P(d)[1][:, 0], P(d)[2]), ("lam",)),
        ("lam-rank6", lambda d: (P(d)[0], P(d)[1][None], P(d)[2]), ("lam",)),
        ("gates-rank5", lambda d: P(d)[:2] + (P(d)[2][:, :, :, 0],), ("gates",)),
        ("gates-rank7", lambda d: P(d)[:2] + (P(d)[2][None],), ("gates",)),
        ("lam-B", lambda d: (P(d)[0], P(d, B=2)[1], P(d)[2]), ("lam",)),
        ("lam-dirs3", lambda d: (P(d)[0], P(d)[1][:, :3], P(d)[2]), ("lam",)),
        ("lam-C", lambda d: (P(d)[0], P(d, C=3)[1], P(d)[2]), ("lam",)),
        ("lam-H", lambda d: (P(d)[0], P(d, H=4)[1], P(d)[2]), ("lam",)),
        ("lam-W", lambda d: (P(d)[0], P(d, W=5)[1], P(d)[2]), ("lam",)),
        ("gates-B", lambda d: P(d)[:2] + (P(d, B=2)[2],), ("gates",)),
        ("gates-dirs2", lambda d: P(d)[:2] + (P(d)[2][:, :2],), ("gates",)),
        ("gates-offsets2", lambda d: P(d)[:2] + (P(d)[2][:, :, :2],), ("gates",)),
        ("gates-H", lambda d: P(d)[:2] + (P(d, H=2)[2],), ("gates",)),
        ("gates-W", lambda d: P(d)[:2] + (P(d, W=2)[2],), ("gates",)),
        ("bcast-lam-B1", lambda d: (P(d, B=2)[0], P(d, B=1)[1], P(d, B=2)[2]), ("lam",)),
        ("bcast-lam-dir1", lambda d: (P(d)[0], P(d)[1][:, :1], P(d)[2]), ("lam",)),
        ("bcast-lam-C1", lambda d: (P(d)[0], P(d)[1][:, :, :1], P(d)[2]), ("lam",)),
        ("bcast-gates-B1", lambda d: (P(d, B=2)[0], P(d, B=2)[1], P(d, B=1)[2]), ("gates",)),
        ("bcast-gates-H1", lambda d: P(d)[:2] + (P(d)[2][..., :1, :],), ("gates",)),
        ("bcast-gates-W1", lambda d: P(d)[:2] + (P(d)[2][..., :1],), ("gates",)),
        ("bcast-gates-dir1", lambda d: P(d)[:2] + (P(d)[2][:, :1],), ("gates",)),
        ("bcast-x-B1", lambda d: (P(d, B=1)[0],) + P(d, B=2)[1:], ("lam", "x")),
        ("bcast-x-H1", lambda d: (P(d)[0][:, :, :1],) + P(d)[1:], ("lam", "x")),
        ("empty-B", lambda d: P(d, B=0), ("x",)),
        ("empty-C", lambda d: P(d, C=0, K=1), ("x", "gates")),
        ("empty-H", lambda d: P(d, H=0), ("x",)),
        ("empty-W", lambda d: P(d, W=0), ("x",)),
        ("empty-K", lambda d: P(d, K=0), ("gates",)),
        ("K3-C4", lambda d: P(d, C=4, K=3), ("gates",)),
        ("K4-C2", lambda d: P(d, C=2, K=4), ("gates",)),
        ("K2-C3", lambda d: P(d, C=3, K=2), ("gates",)),
        ("x-f32-lam-f64", lambda d: (P(d)[0], P(d, dtype=torch.float64)[1], P(d)[2]), ("lam",)),
        ("gates-f64", lambda d: P(d)[:2] + (P(d, dtype=torch.float64)[2],), ("gates",)),
        ("x-f64-rest-f32", lambda d: (P(d, dtype=torch.float64)[0],) + P(d)[1:], ("lam", "x")),
        ("lam-f16", lambda d: (P(d)[0], P(d, dtype=torch.float16)[1], P(d)[2]), ("lam",)),
        ("gates-bf16", lambda d: P(d)[:2] + (P(d, dtype=torch.bfloat16)[2],), ("gates",)),
        ("x-f16-lam-bf16", lambda d: (P(d, dtype=torch.float16)[0], P(d, dtype=torch.bfloat16)[1], P(d, dtype=torch.float16)[2]), ("lam",)),
        ("lam-int64", lambda d: (P(d)[0], P(d)[1].long(), P(d)[2]), ("lam",)),
        ("gates-bool", lambda d: P(d)[:2] + (P(d)[2] > 0,), ("gates",)),
        ("gates-int32", lambda d: P(d)[:2] + (P(d)[2].int(),), ("gates",)),
        ("x-meta", lambda d: (_meta(P(d)[0]),) + P(d)[1:], ("x", "lam")),
        ("lam-otherdev", lambda d: (P(d)[0], P(d)[1].to(_other_device(d)), P(d)[2]), ("lam",)),
        ("gates-otherdev", lambda d: P(d)[:2] + (P(d)[2].to(_other_device(d)),), ("gates",)),
        ("x-sparse", lambda d: (_sparse(P(d)[0]),) + P(d)[1:], ("x",)),
        ("lam-sparse", lambda d: (P(d)[0], _sparse(P(d)[1]), P(d)[2]), ("lam",)),
        ("gates-sparse", lambda d: P(d)[:2] + (_sparse(P(d)[2]),), ("gates",)),
        ("x-sparse-csr", lambda d: (P(d)[0].to_sparse_csr(),) + P(d)[1:], ("x",)),
        ("x-mkldnn", lambda d: (_mkldnn(P(d)[0]),) + P(d)[1:], ("x",)),
        ("lam-mkldnn", lambda d: (P(d)[0], _mkldnn(P(d)[1]), P(d)[2]), ("lam",)),
        ("x-nested", lambda d: (_nested(P(d)[0], torch.strided),) + P(d)[1:], ("x",)),
        ("x-nested-jagged", lambda d: (_nested(P(d)[0], torch.jagged),) + P(d)[1:], ("x",)),
        ("gates-nested", lambda d: P(d)[:2] + (_nested(P(d)[2], torch.strided),), ("gates",)),
        ("x-None", lambda d: (None,) + P(d)[1:], ("x",)),
        ("x-list", lambda d: (P(d)[0].tolist(),) + P(d)[1:], ("x",)),
        ("x-numpy", lambda d: (P("cpu")[0].numpy(),) + P(d)[1:], ("x",)),
        ("x-float", lambda d: (1.0,) + P(d)[1:], ("x",)),
        ("x-str", lambda d: ("x",) + P(d)[1:], ("x",)),
        ("lam-None", lambda d: (P(d)[0], None, P(d)[2]), ("lam",)),
        ("lam-numpy", lambda d: (P(d)[0], P("cpu")[1].numpy(), P(d)[2]), ("lam",)),
        ("gates-tuple", lambda d: P(d)[:2] + (tuple(P(d)[2].unbind(0)),), ("gates",)),
        ("gates-int", lambda d: P(d)[:2] + (3,), ("gates",)),
    ]
    dtypes = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
              torch.complex128]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32") if hasattr(torch, n)]
    for dt in dtypes:
        cases.append((f"all-{str(dt).split('.')[-1]}", lambda d, dt=dt: tuple(t.to(dt) for t in P(d, dtype=torch.float64)), ("x",)))
    return cases


def _error_case(entry, fn, raw, label, make, names):
    """A case whose inputs ``make(device)`` builds and whose call must fail clearly."""
    def build(dev):
        try:
            args = make(dev)
        except SetupError:
            raise
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            raise SetupError(f"{type(e).__name__}: {e}") from e
        return Call(lambda: fn(*args))

    return Case(f"{entry}/{label}", build, "error", names, raw=raw)


def _valid_prop(entry, fn, raw, label, make, chunk=None, kw=None, finite=False, ref_chunk="same"):
    kw = kw or {}

    def build(dev):
        x, lam, gates = make(dev)
        c = chunk if ref_chunk == "same" else ref_chunk
        return Call(lambda: fn(x, lam, gates, chunk, **kw), check_prop(x, lam, gates, c, finite=finite),
                    expect=cuda_limits(raw, x))

    return Case(f"{entry}/{label}", build, "result", raw=raw)


def _outside_line_gates(gates, value):
    """``gates`` with ``value`` in every logit of a neighbour outside its line (the spec ignores them) and
    the same tensor with 0 there (the reference input whose output must be identical)."""
    g = gates.clone()
    H, W = g.shape[-2:]
    for d in (0, 1):  # lines are columns (axis H): offset -1 at row 0, +1 at row H - 1
        g[:, d, 0, :, 0, :] = value
        g[:, d, 2, :, H - 1, :] = value
    for d in (2, 3):  # lines are rows (axis W)
        g[:, d, 0, :, :, 0] = value
        g[:, d, 2, :, :, W - 1] = value
    clean = g.clone()
    clean[~torch.isfinite(clean) | (clean == value)] = 0.0
    return g, clean


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def prop_valid_cases():
    """(label, make(dev) -> (x, lam, gates), chunk, finite)."""
    P = prop_inputs
    inf = math.inf
    out = []
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out.append((f"dtype-{str(dt).split('.')[-1]}", lambda d, dt=dt: P(d, H=4, W=5, dtype=dt), None, False))
    for (B, C, H, W, K) in ((1, 1, 1, 1, 1), (1, 2, 1, 7, 1), (1, 2, 7, 1, 2), (3, 1, 2, 2, 1), (1, 4, 3, 3, 4),
                            (1, 6, 4, 5, 2), (2, 3, 5, 6, 3), (1, 2, 17, 17, 1), (1, 2, 2, 33, 2)):
        out.append((f"size-{B}x{C}x{H}x{W}-K{K}", lambda d, s=(B, C, H, W, K): P(d, *s), None, False))
    for chunk in (1, 2, 3, 5, 100, 10**6, 2**62, 2**63 - 1):
        out.append((f"chunk-{chunk}", lambda d: P(d, H=5, W=6), chunk, False))
    out += [
        ("x-transposed", lambda d: (_transposed(P(d, H=4, W=5)[0]),) + P(d, H=4, W=5)[1:], None, False),
        ("lam-permuted", lambda d: (P(d)[0], P(d)[1].permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4), P(d)[2]), None, False),
        ("gates-strided", lambda d: P(d)[:2] + (_strided_view(P(d)[2]),), None, False),
        ("x-channels-last", lambda d: (P(d, C=3, K=3)[0].contiguous(memory_format=torch.channels_last),) + P(d, C=3, K=3)[1:], None, False),
        ("lam-channels-last-3d", lambda d: (P(d)[0], P(d)[1].contiguous(memory_format=torch.channels_last_3d), P(d)[2]), None, False),
        ("x-expanded-B", lambda d: (P(d, B=1)[0].expand(2, -1, -1, -1),) + P(d, B=2)[1:], None, False),
        ("x-scalar-expanded", lambda d: (torch.tensor(0.5, device=d).expand(1, 2, 3, 4),) + P(d)[1:], None, False),
        ("lam-expanded-dir", lambda d: (P(d)[0], P(d)[1][:, :1].expand(-1, 4, -1, -1, -1), P(d)[2]), None, False),
        ("gates-expanded-K", lambda d: P(d, C=4)[:2] + (P(d, K=1)[2][:, :1, :1].expand(1, 4, 3, 1, 3, 4),), None, False),
        ("x-offset-view", lambda d: (_randn((1, 2, 3, 9), torch.float32, d, 7)[..., 2:6],) + P(d)[1:], None, False),
        ("nan-x", lambda d: (_with(P(d, H=5, W=6)[0], (0, 0, 2, 2), math.nan),) + P(d, H=5, W=6)[1:], None, False),
        ("inf-x", lambda d: (_with(P(d, H=5, W=6)[0], (0, 1, 0, 3), inf),) + P(d, H=5, W=6)[1:], None, False),
        ("neginf-x", lambda d: (_with(P(d, H=5, W=6)[0], (0, 1, 4, 0), -inf),) + P(d, H=5, W=6)[1:], None, False),
        ("nan-x-chunk2", lambda d: (_with(P(d, H=5, W=6)[0], (0, 0, 1, 1), math.nan),) + P(d, H=5, W=6)[1:], 2, False),
        ("nan-lam", lambda d: (P(d, H=5, W=6)[0], _with(P(d, H=5, W=6)[1], (0, 2, 1, 3, 3), math.nan), P(d, H=5, W=6)[2]), None, False),
        ("inf-lam", lambda d: (P(d, H=5, W=6)[0], _with(P(d, H=5, W=6)[1], (0, 0, 0, 0, 0), inf), P(d, H=5, W=6)[2]), None, False),
        ("nan-gate-inline", lambda d: P(d, H=5, W=6)[:2] + (_with(P(d, H=5, W=6)[2], (0, 0, 1, 0, 2, 3), math.nan),), None, False),
        ("posinf-gate-inline", lambda d: P(d, H=5, W=6)[:2] + (_with(P(d, H=5, W=6)[2], (0, 1, 1, 0, 2, 3), inf),), None, True),
        ("neginf-gate-inline", lambda d: P(d, H=5, W=6)[:2] + (_with(P(d, H=5, W=6)[2], (0, 2, 0, 0, 2, 3), -inf),), None, True),
        ("neginf-gates-all", lambda d: P(d, H=5, W=6)[:2] + (torch.full_like(P(d, H=5, W=6)[2], -inf),), None, True),
        ("posinf-gates-all", lambda d: P(d, H=5, W=6)[:2] + (torch.full_like(P(d, H=5, W=6)[2], inf),), None, True),
    ]
    return out


def prop_outside_line_cases():
    """(label, shape, value, chunk, dtype): non-finite logits of neighbours outside the line must not leak."""
    out = []
    for value, vname in ((math.nan, "nan"), (math.inf, "posinf"), (-math.inf, "neginf")):
        for shape, sname in (((1, 2, 5, 6, 1), "5x6"), ((1, 2, 1, 1, 1), "1x1"), ((1, 2, 1, 7, 2), "1x7"), ((2, 4, 6, 1, 2), "6x1")):
            out.append((f"outside-line-{vname}-{sname}", shape, value, None, torch.float32))
        out.append((f"outside-line-{vname}-chunk2", (1, 2, 5, 6, 1), value, 2, torch.float32))
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        out.append((f"outside-line-nan-{str(dt).split('.')[-1]}", (1, 2, 4, 5, 1), math.nan, None, dt))
    return out


def _outside_case(entry, fn, raw, label, shape, value, chunk, dtype):
    def build(dev):
        x, lam, gates = prop_inputs(dev, *shape, dtype=dtype)
        g, clean = _outside_line_gates(gates, value)
        return Call(lambda: fn(x, lam, g, chunk), check_prop(x, lam, clean, chunk, finite=True),
                    expect=cuda_limits(raw, x))

    return Case(f"{entry}/{label}", build, "result", raw=raw)


def prop_chunk_cases():
    """(label, chunk, expect, names, raw expectation override)."""
    return [
        ("chunk-neg1", -1, "error", None),
        ("chunk-0", 0, "error", None),
        ("chunk-min-int64", -(2**63), "error", None),
        ("chunk-below-int64", -(2**63) - 1, "error", None),
        ("chunk-2^63", 2**63, "error", None),
        ("chunk-2^64", 2**64, "error", None),
        ("chunk-1e30", 10**30, "error", None),
        ("chunk-True", True, "error", ("result", 1)),
        ("chunk-False", False, "error", None),
        ("chunk-1.0", 1.0, "error", None),
        ("chunk-2.5", 2.5, "error", None),
        ("chunk-nan", math.nan, "error", None),
        ("chunk-inf", math.inf, "error", None),
        ("chunk-str", "2", "error", None),
        ("chunk-numpy-int64", np.int64(2), "either", None),
        ("chunk-tensor", "tensor", "either", None),
        ("chunk-list", [2], "error", None),
    ]


def _chunk_case(entry, fn, raw, label, chunk, expect, raw_override):
    if raw and raw_override is not None:
        expect, ref_chunk = raw_override
    else:
        ref_chunk = 2 if label in ("chunk-numpy-int64", "chunk-tensor") else None

    def build(dev):
        x, lam, gates = prop_inputs(dev, H=5, W=6)
        c = torch.tensor(2) if chunk == "tensor" else chunk
        return Call(lambda: fn(x, lam, gates, c), check_prop(x, lam, gates, ref_chunk))

    return Case(f"{entry}/{label}", build, expect, ("chunk",), raw=raw)


def _kernel_cases():
    """Bad and valid ``kernel`` / ``cluster_ctas`` values; valid ones use W = 16 (the cluster kernels' tile)."""
    cases = []
    for label, k in (("bogus", "bogus"), ("empty", ""), ("upper", "FAST"), ("space", "fast "), ("int", 1),
                     ("bytes", b"auto"), ("list", ["auto"])):
        for entry, fn, raw in PROP_ENTRIES:
            def build(dev, fn=fn, k=k):
                x, lam, gates = prop_inputs(dev, H=4, W=16)
                return Call(lambda: fn(x, lam, gates, None, kernel=k), check_prop(x, lam, gates, None))

            # torch's schema matcher decodes bytes for a str argument: the raw op sees "auto"
            expect = "result" if raw and isinstance(k, bytes) else "error"
            cases.append(Case(f"{entry}/kernel-{label}", build, expect, ("kernel",), raw=raw))
    for k in ("auto", "fast", "general", "cluster", "short"):
        for entry, fn, raw in PROP_ENTRIES:
            cases.append(_valid_prop(entry, fn, raw, f"kernel-{k}", lambda d: prop_inputs(d, C=2, H=5, W=16), kw={"kernel": k}))
    for label, cc, expect in (("neg1", -1, "error"), ("1", 1, "error"), ("3", 3, "error"), ("16", 16, "error"),
                              ("2^40", 2**40, "error"), ("2^63", 2**63, "error"), ("str", "2", "error"),
                              ("float", 2.0, "error"), ("None", None, "error"), ("True", True, "error")):
        def build(dev, cc=cc):
            x, lam, gates = prop_inputs(dev, H=4, W=16)
            return Call(lambda: _raw_prop(x, lam, gates, None, "auto", cc))

        cases.append(Case(f"rawprop/cluster_ctas-{label}", build, expect, ("cluster_ctas",), raw=True))
    for cc in (0, 2, 4, 8):
        cases.append(_valid_prop("rawprop", _raw_prop, True, f"cluster_ctas-{cc}", lambda d: prop_inputs(d, C=2, H=5, W=16),
                                 kw={"kernel": "cluster", "cluster_ctas": cc}))
    return cases


def _grad_cases():
    cases = []
    subsets = [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]
    for entry, fn, raw in PROP_ENTRIES:
        for req in subsets:
            for dt, chunk in ((torch.float64, None), (torch.float32, 2)):
                label = f"grad-{''.join(n for n, r in zip(('x', 'lam', 'gates'), req) if r) or 'none'}-{str(dt).split('.')[-1]}"

                def build(dev, req=req, dt=dt, chunk=chunk, fn=fn):
                    ins = [t.requires_grad_(r == 1) for t, r in zip(prop_inputs(dev, C=4, H=4, W=5, K=2, dtype=dt), req)]

                    def run():
                        out, ref, got, expected = _grad_check(
                            ins, lambda a, b, c: fn(a, b, c, chunk), lambda a, b, c: gspn_propagate_ref(a, b, c, chunk)
                        )
                        assert_close(out, ref, dt)
                        if out.requires_grad != any(req):
                            raise Wrong(f"output requires_grad={out.requires_grad} for inputs {req}")
                        for g, e in zip(got, expected):
                            assert_close(g, e, dt, "gradient")
                        return out

                    return Call(run, lambda out: None, expect=cuda_limits(raw, ins[0]))

                cases.append(Case(f"{entry}/{label}", build, "result", raw=raw))

        def build_nan(dev, fn=fn):
            x, lam, gates = prop_inputs(dev, C=2, H=4, W=5, dtype=torch.float64)
            g, clean = _outside_line_gates(gates, math.nan)
            x.requires_grad_(True), lam.requires_grad_(True), g.requires_grad_(True)

            def run():
                h = fn(x, lam, g, None)
                grads = torch.autograd.grad(h.sum(), (x, lam, g))
                ref_in = [_f64(t).requires_grad_(True) for t in (x, lam, clean)]
                ref = torch.autograd.grad(gspn_propagate_ref(*ref_in).sum(), ref_in)
                for got, e in zip(grads, ref):
                    assert_close(got, e, torch.float64, "gradient")
                    if not bool(torch.isfinite(got).all()):
                        raise Wrong("non-finite gradient")
                return h

            return Call(run, lambda out: None, expect=cuda_limits(raw, x))

        cases.append(Case(f"{entry}/grad-outside-line-nan", build_nan, "result", raw=raw))

        def build_int(dev, fn=fn):
            x, lam, gates = prop_inputs(dev)
            x.requires_grad_(True)
            return Call(lambda: fn(x, lam, gates.to(torch.float64).requires_grad_(True), None))

        cases.append(Case(f"{entry}/grad-mixed-dtype", build_int, "error", ("gates",), raw=raw))
    return cases


def _raw_backward(grad_h, x, lam, gates, h, chunk=None, kernel="auto", cluster_ctas=0):
    return torch.ops.gspn2.propagate_backward.default(grad_h, x, lam, gates, h, chunk, kernel, cluster_ctas)


def _backward_cases():
    from gspn2.ops import gspn_propagate_backward_ref

    def base(dev, dt=torch.float64, chunk=None):
        x, lam, gates = prop_inputs(dev, C=4, H=4, W=5, K=2, dtype=dt)
        h = gspn_propagate_ref(x, lam, gates, chunk)
        gh = _randn(h.shape, dt, dev, 9)
        return gh, x, lam, gates, h

    def valid(label, mutate=lambda a: a, dt=torch.float64, chunk=None):
        def build(dev):
            gh, x, lam, gates, h = mutate(base(dev, dt, chunk))
            ref = gspn_propagate_backward_ref(*(_f64(t) for t in (gh, x, lam, gates, h)), chunk)

            def check(out):
                for name, got, e, like in zip(("grad_x", "grad_lam", "grad_gates"), out, ref, (x, lam, gates)):
                    if got.dtype != like.dtype:
                        raise Wrong(f"{name} dtype {got.dtype}, expected {like.dtype}")
                    assert_close(got, e, dt, name)

            return Call(lambda: _raw_backward(gh, x, lam, gates, h, chunk), check, expect=cuda_limits(True, x))

        return Case(f"rawbwd/{label}", build, "result", raw=True)

    def bad(label, mutate, names, **kw):
        def build(dev):
            args = mutate(base(dev), dev)
            return Call(lambda: _raw_backward(*args, **kw))

        return Case(f"rawbwd/{label}", build, "error", names, raw=True)

    cases = [
        valid("valid-f64"),
        valid("valid-f32-chunk2", dt=torch.float32, chunk=2),
        valid("valid-bf16", dt=torch.bfloat16),
        valid("grad_h-noncontiguous", lambda a: (_transposed(a[0]),) + a[1:]),
        valid("h-strided", lambda a: a[:4] + (_strided_view(a[4]),)),
        bad("grad_h-shape", lambda a, d: (a[0][:, :3],) + a[1:], ("grad_h",)),
        bad("grad_h-bcast", lambda a, d: (a[0][:1, :1],) + a[1:], ("grad_h",)),
        bad("grad_h-f32", lambda a, d: (a[0].float(),) + a[1:], ("grad_h",)),
        bad("grad_h-int", lambda a, d: (a[0].long(),) + a[1:], ("grad_h",)),
        bad("grad_h-otherdev", lambda a, d: (a[0].to(_other_device(d)),) + a[1:], ("grad_h",)),
        bad("grad_h-sparse", lambda a, d: (_sparse(a[0]),) + a[1:], ("grad_h",)),
        bad("grad_h-nested", lambda a, d: (_nested(a[0], torch.strided),) + a[1:], ("grad_h",)),
        bad("grad_h-nested-jagged", lambda a, d: (_nested(a[0], torch.jagged),) + a[1:], ("grad_h",)),
        bad("grad_h-None", lambda a, d: (None,) + a[1:], ("grad_h",)),
        bad("grad_h-list", lambda a, d: (a[0].tolist(),) + a[1:], ("grad_h",)),
        bad("h-shape", lambda a, d: a[:4] + (a[4][:, :, :2],), ("h",)),
        bad("h-f16", lambda a, d: a[:4] + (a[4].half(),), ("h",)),
        bad("h-otherdev", lambda a, d: a[:4] + (a[4].to(_other_device(d)),), ("h",)),
        bad("x-int", lambda a, d: (a[0], a[1].long()) + a[2:], ("x",)),
        bad("lam-shape", lambda a, d: (a[0], a[1], a[2][:, :2]) + a[3:], ("lam",)),
        bad("gates-K3", lambda a, d: a[:3] + (prop_inputs(d, C=4, H=4, W=5, K=3, dtype=torch.float64)[2], a[4]), ("gates",)),
        bad("chunk-neg1", lambda a, d: a, ("chunk",), chunk=-1),
        bad("chunk-2^63", lambda a, d: a, ("chunk",), chunk=2**63),
        bad("kernel-bogus", lambda a, d: a, ("kernel",), kernel="bogus"),
        bad("cluster_ctas-3", lambda a, d: a, ("cluster_ctas",), cluster_ctas=3),
    ]
    return cases


# ---- depthwise convolution


def _pub_dw(x, w, b=None, add_input=False, silu=False, kernel=None, cols=None):
    return depthwise_conv2d(x, w, b, add_input, silu)


def _raw_dw(x, w, b=None, add_input=False, silu=False, kernel=0, cols=4):
    return torch.ops.gspn2.depthwise_conv2d.default(x, w, b, add_input, silu, kernel, cols)


DW_ENTRIES = (("dw", _pub_dw, False), ("rawdw", _raw_dw, True))


def dw_bad_cases():
    """(label, make(dev) -> (x, w, b), names)."""
    D = dw_inputs
    cases = [
        ("x-rank3", lambda d: (D(d)[0][0],) + D(d)[1:], ("x",)),
        ("x-rank5", lambda d: (D(d)[0][None],) + D(d)[1:], ("x",)),
        ("weight-rank3", lambda d: (D(d)[0], D(d)[1][:, 0], D(d)[2]), ("weight",)),
        ("weight-C", lambda d: (D(d)[0], D(d, C=4)[1], D(d)[2]), ("weight",)),
        ("weight-in2", lambda d: (D(d)[0], D(d)[1].expand(-1, 2, -1, -1), D(d)[2]), ("weight",)),
        ("weight-nonsquare", lambda d: (D(d)[0], D(d, K=5)[1][..., :3], D(d)[2]), ("weight",)),
        ("weight-K2", lambda d: (D(d)[0], D(d, K=2)[1], D(d)[2]), ("weight",)),
        ("weight-K4", lambda d: (D(d)[0], D(d, K=4)[1], D(d)[2]), ("weight",)),
        ("weight-bcast-C1", lambda d: (D(d)[0], D(d, C=1)[1], D(d)[2]), ("weight",)),
        ("bias-C", lambda d: (D(d)[0], D(d)[1], D(d, C=4)[2]), ("bias",)),
        ("bias-2d", lambda d: (D(d)[0], D(d)[1], D(d)[2][None]), ("bias",)),
        ("bias-0d", lambda d: (D(d)[0], D(d)[1], D(d)[2][0]), ("bias",)),
        ("bias-list", lambda d: (D(d)[0], D(d)[1], D(d)[2].tolist()), ("bias",)),
        ("bias-float", lambda d: (D(d)[0], D(d)[1], 1.0), ("bias",)),
        ("weight-numpy", lambda d: (D(d)[0], D("cpu")[1].numpy(), D(d)[2]), ("weight",)),
        ("weight-None", lambda d: (D(d)[0], None, D(d)[2]), ("weight",)),
        ("x-None", lambda d: (None,) + D(d)[1:], ("x",)),
        ("x-list", lambda d: (D(d)[0].tolist(),) + D(d)[1:], ("x",)),
        ("empty-B", lambda d: D(d, B=0), ("x",)),
        ("empty-C", lambda d: D(d, C=0), ("x",)),
        ("empty-H", lambda d: D(d, H=0), ("x",)),
        ("empty-W", lambda d: D(d, W=0), ("x",)),
        ("weight-int", lambda d: (D(d)[0], D(d)[1].long(), D(d)[2]), ("weight",)),
        ("weight-bool", lambda d: (D(d)[0], D(d)[1] > 0, D(d)[2]), ("weight",)),
        ("weight-complex", lambda d: (D(d)[0], D(d)[1].to(torch.complex64), D(d)[2]), ("weight",)),
        ("bias-int", lambda d: (D(d)[0], D(d)[1], D(d)[2].int()), ("bias",)),
        ("weight-otherdev", lambda d: (D(d)[0], D(d)[1].to(_other_device(d)), D(d)[2]), ("weight",)),
        ("bias-otherdev", lambda d: (D(d)[0], D(d)[1], D(d)[2].to(_other_device(d))), ("bias",)),
        ("x-meta", lambda d: (_meta(D(d)[0]),) + D(d)[1:], ("weight", "x")),
        ("x-sparse", lambda d: (_sparse(D(d)[0]),) + D(d)[1:], ("x",)),
        ("weight-sparse", lambda d: (D(d)[0], _sparse(D(d)[1]), D(d)[2]), ("weight",)),
        ("bias-sparse", lambda d: (D(d)[0], D(d)[1], _sparse(D(d)[2])), ("bias",)),
        ("x-mkldnn", lambda d: (_mkldnn(D(d)[0]),) + D(d)[1:], ("x",)),
        ("x-nested", lambda d: (_nested(D(d)[0], torch.strided),) + D(d)[1:], ("x",)),
        ("x-nested-jagged", lambda d: (_nested(D(d)[0], torch.jagged),) + D(d)[1:], ("x",)),
        ("weight-nested", lambda d: (D(d)[0], _nested(D(d)[1], torch.strided), D(d)[2]), ("weight",)),
    ]
    dtypes = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.complex64]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n)]
    for dt in dtypes:
        cases.append((f"x-{str(dt).split('.')[-1]}", lambda d, dt=dt: (D(d, dtype=torch.float64)[0].to(dt),) + D(d)[1:], ("x",)))
    return cases


def dw_valid_cases():
    """(label, make(dev) -> (x, w, b), add_input, silu)."""
    D = dw_inputs
    out = []
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out.append((f"dtype-{str(dt).split('.')[-1]}", lambda d, dt=dt: D(d, dtype=dt), False, False))
        out.append((f"dtype-{str(dt).split('.')[-1]}-channels-last",
                    lambda d, dt=dt: (D(d, dtype=dt)[0].contiguous(memory_format=torch.channels_last),) + D(d, dtype=dt)[1:], True, False))
    for K in (1, 3, 5, 7, 9):
        out.append((f"K{K}", lambda d, K=K: D(d, K=K), False, False))
    for (B, C, H, W, K) in ((1, 1, 1, 1, 3), (1, 2, 1, 1, 7), (1, 2, 1, 9, 3), (2, 3, 9, 1, 5), (1, 8, 2, 3, 3)):
        out.append((f"size-{B}x{C}x{H}x{W}-K{K}", lambda d, s=(B, C, H, W, K): D(d, *s), False, False))
    for add_input in (False, True):
        for silu in (False, True):
            out.append((f"flags-add{int(add_input)}-silu{int(silu)}", lambda d: (D(d)[0].contiguous(memory_format=torch.channels_last),) + D(d)[1:], add_input, silu))
    out += [
        ("no-bias", lambda d: D(d, bias=False), False, False),
        ("x-f32-weight-f64", lambda d: D(d, wdtype=torch.float64), False, False),
        ("x-bf16-weight-f32", lambda d: D(d, dtype=torch.bfloat16, wdtype=torch.float32), True, False),
        ("x-f16-weight-f32-cl", lambda d: (D(d, dtype=torch.float16, wdtype=torch.float32)[0].contiguous(memory_format=torch.channels_last),)
         + D(d, dtype=torch.float16, wdtype=torch.float32)[1:], False, False),
        ("x-transposed", lambda d: (_transposed(D(d)[0]),) + D(d)[1:], False, False),
        ("weight-transposed", lambda d: (D(d)[0], _transposed(D(d)[1]), D(d)[2]), False, False),
        ("bias-expanded", lambda d: (D(d)[0], D(d)[1], torch.tensor(0.25, device=d).expand(3)), False, False),
        ("x-expanded-B", lambda d: (D(d)[0].expand(2, -1, -1, -1),) + D(d)[1:], True, False),
        ("x-strided", lambda d: (_strided_view(D(d)[0]),) + D(d)[1:], False, False),
        ("nan-x", lambda d: (_with(D(d)[0], (0, 1, 2, 2), math.nan),) + D(d)[1:], False, False),
        ("inf-x-cl", lambda d: (_with(D(d)[0], (0, 0, 0, 0), math.inf).contiguous(memory_format=torch.channels_last),) + D(d)[1:], True, False),
        # The centre tap meets every pixel: a NaN weight times a padded zero is NaN in one convolution
        # algorithm and skipped in another (both F.conv2d), so an off-centre NaN tap has no single reference.
        ("nan-weight", lambda d: (D(d)[0], _with(D(d)[1], (1, 0, 1, 1), math.nan), D(d)[2]), False, False),
        ("inf-bias", lambda d: (D(d)[0], D(d)[1], _with(D(d)[2], 2, -math.inf)), False, False),
    ]
    return out


def _dw_valid(entry, fn, raw, label, make, add_input, silu):
    def build(dev):
        x, w, b = make(dev)
        return Call(lambda: fn(x, w, b, add_input, silu), check_dw(x, w, b, add_input, silu), expect=cuda_limits(raw, x, w))

    return Case(f"{entry}/{label}", build, "result", raw=raw)


def _dw_flag_cases():
    cases = []
    for label, kw in (("add_input-str", {"add_input": "no"}), ("add_input-int", {"add_input": 1}),
                      ("add_input-None", {"add_input": None}), ("silu-int", {"silu": 0}), ("silu-str", {"silu": "yes"})):
        value = next(iter(kw.values()))
        coerced = value is None or isinstance(value, int)  # the schema turns an int or None into a bool

        def build(dev, kw=kw):
            x, w, b = dw_inputs(dev)
            flags = {"add_input": False, "silu": False, **kw}
            return Call(lambda: _pub_dw(x, w, b, **kw), check_dw(x, w, b, bool(flags["add_input"]), bool(flags["silu"])))

        def build_raw(dev, kw=kw):
            x, w, b = dw_inputs(dev)
            flags = {"add_input": False, "silu": False, **kw}
            return Call(lambda: _raw_dw(x, w, b, **kw), check_dw(x, w, b, bool(flags["add_input"]), bool(flags["silu"])))

        name = label.split("-")[0]
        cases.append(Case(f"dw/{label}", build, "error", (name,)))
        cases.append(Case(f"rawdw/{label}", build_raw, "result" if coerced else "error", (name,), raw=True))
    for label, kernel, cols in (("kernel-3", 3, 4), ("kernel-4", 4, 4), ("kernel-neg1", -1, 4), ("kernel-2^40", 2**40, 4),
                                ("kernel-str", "0", 4), ("kernel-float", 0.0, 4), ("kernel-True", True, 4),
                                ("kernel-None", None, 4), ("cols-2", 0, 2), ("cols-16", 0, 16), ("cols-2^63", 0, 2**63),
                                ("cols-str", 0, "8")):
        def build(dev, kernel=kernel, cols=cols):
            x, w, b = dw_inputs(dev)
            return Call(lambda: _raw_dw(x, w, b, False, False, kernel, cols))

        cases.append(Case(f"rawdw/{label}", build, "error", (label.split("-")[0],), raw=True))
    for kernel in (0, 1):
        for cols in (4, 8):
            def build(dev, kernel=kernel, cols=cols):
                x, w, b = dw_inputs(dev, C=8)
                x = x.contiguous(memory_format=torch.channels_last)
                return Call(lambda: _raw_dw(x, w, b, True, False, kernel, cols), check_dw(x, w, b, True, False))

            cases.append(Case(f"rawdw/kernel{kernel}-cols{cols}", build, "result", raw=True))
    return cases


def _dw_grad_cases():
    cases = []
    for entry, fn, raw in DW_ENTRIES:
        for req in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]:
            for add_input, cl in ((False, False), (True, True)):
                label = f"grad-{''.join(n for n, r in zip(('x', 'weight', 'bias'), req) if r) or 'none'}-add{int(add_input)}"

                def build(dev, req=req, add_input=add_input, cl=cl, fn=fn):
                    x, w, b = dw_inputs(dev, dtype=torch.float64)
                    if cl:
                        x = x.contiguous(memory_format=torch.channels_last)
                    ins = [t.requires_grad_(r == 1) for t, r in zip((x, w, b), req)]

                    def run():
                        out, ref, got, expected = _grad_check(
                            ins, lambda a, b_, c: fn(a, b_, c, add_input), lambda a, b_, c: conv_ref(a, b_, c, add_input)
                        )
                        assert_close(out, ref, torch.float64)
                        for g, e in zip(got, expected):
                            assert_close(g, e, torch.float64, "gradient")
                        return out

                    return Call(run, lambda out: None, expect=cuda_limits(raw, x, w))

                cases.append(Case(f"{entry}/{label}", build, "result", raw=raw))

    def build_silu(dev):
        x, w, b = dw_inputs(dev, dtype=torch.float64)
        w.requires_grad_(True)

        def run():
            out, ref, got, expected = _grad_check(
                (x, w, b), lambda a, b_, c: _pub_dw(a, b_, c, False, True), lambda a, b_, c: conv_ref(a, b_, c, False, True)
            )
            assert_close(out, ref, torch.float64)
            for g, e in zip(got, expected):
                assert_close(g, e, torch.float64, "gradient")
            return out

        return Call(run, lambda out: None)

    cases.append(Case("dw/grad-weight-silu", build_silu, "result"))

    def build_raw_silu(dev):
        x, w, b = dw_inputs(dev)
        w.requires_grad_(True)
        return Call(lambda: torch.autograd.grad(_raw_dw(x, w, b, False, True).sum(), w))

    cases.append(Case("rawdw/grad-silu-backward", build_raw_silu, "error", ("silu",), raw=True))
    return cases


def _dw_backward_cases():
    def base(dev):
        x, w, _ = dw_inputs(dev, dtype=torch.float64)
        return _randn(x.shape, torch.float64, dev, 4), x, w

    def raw_bwd(gy, x, w, has_bias=True, add_input=False, kernel=0, cols=4):
        return torch.ops.gspn2.depthwise_conv2d_backward.default(gy, x, w, has_bias, add_input, kernel, cols)

    def build_valid(dev):
        gy, x, w = base(dev)
        xr, wr = _f64(x).requires_grad_(True), _f64(w).requires_grad_(True)
        br = torch.zeros(w.shape[0], dtype=torch.float64, requires_grad=True)
        ref = torch.autograd.grad((conv_ref(xr, wr, br) * _f64(gy)).sum(), (xr, wr, br))

        def check(out):
            for name, got, e in zip(("grad_x", "grad_weight", "grad_bias"), out, ref):
                assert_close(got, e, torch.float64, name)

        return Call(lambda: raw_bwd(gy, x, w), check, expect=cuda_limits(True, x, w))

    cases = [Case("rawdwbwd/valid", build_valid, "result", raw=True)]
    for label, mutate, names in (
        ("grad_y-shape", lambda a, d: (a[0][:, :, :2],) + a[1:], ("grad_y",)),
        ("grad_y-C", lambda a, d: (a[0][:, :1],) + a[1:], ("grad_y",)),
        ("grad_y-int", lambda a, d: (a[0].long(),) + a[1:], ("grad_y",)),
        ("grad_y-otherdev", lambda a, d: (a[0].to(_other_device(d)),) + a[1:], ("grad_y",)),
        ("grad_y-sparse", lambda a, d: (_sparse(a[0]),) + a[1:], ("grad_y",)),
        ("grad_y-nested", lambda a, d: (_nested(a[0], torch.strided),) + a[1:], ("grad_y",)),
        ("grad_y-nested-jagged", lambda a, d: (_nested(a[0], torch.jagged),) + a[1:], ("grad_y",)),
        ("x-rank3", lambda a, d: (a[0], a[1][0], a[2]), ("x",)),
        ("weight-C", lambda a, d: (a[0], a[1], a[2][:2]), ("weight",)),
    ):
        def build(dev, mutate=mutate):
            args = mutate(base(dev), dev)
            return Call(lambda: raw_bwd(*args))

        cases.append(Case(f"rawdwbwd/{label}", build, "error", names, raw=True))

    def build_kernel(dev):
        gy, x, w = base(dev)
        return Call(lambda: raw_bwd(gy, x, w, kernel=5))

    cases.append(Case("rawdwbwd/kernel-5", build_kernel, "error", ("kernel",), raw=True))
    return cases


# ---- options and torch.compile


def _option_cases():
    cases = []
    for label, kw, names in (
        ("kernel-bogus", {"kernel": "bogus"}, ("kernel",)),
        ("kernel-int", {"kernel": 1}, ("kernel",)),
        ("backend-gpu", {"backend": "gpu"}, ("backend",)),
        ("cluster_ctas-3", {"cluster_ctas": 3}, ("cluster_ctas",)),
        ("cluster_ctas-True", {"cluster_ctas": True}, ("cluster_ctas",)),
        ("dwconv-mkl", {"dwconv": "mkl"}, ("dwconv",)),
        ("dwconv_tile_cols-5", {"dwconv_tile_cols": 5}, ("dwconv_tile_cols",)),
        ("dwconv_tile_cols-str", {"dwconv_tile_cols": "8"}, ("dwconv_tile_cols",)),
        ("dwconv_kernel-row", {"dwconv_kernel": "row"}, ("dwconv_kernel",)),
        ("unknown", {"kernal": "fast"}, ("kernal",)),
    ):
        def build(dev, kw=kw):
            def run():
                with options.override(**kw):
                    pass

            return Call(run)

        cases.append(Case(f"options/{label}", build, "error", names))
    return cases


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def _compile_cases():
    P, D = prop_inputs, dw_inputs
    # make(dev) -> (f, args): the inputs are built outside the compiled function.
    bad = [
        ("prop-chunk-neg1", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, -1), P(d)), ("chunk",)),
        ("prop-chunk-2^64", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, 2**64), P(d)), ("chunk",)),
        ("prop-chunk-float", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, 1.5), P(d)), ("chunk",)),
        ("prop-chunk-True", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, True), P(d)), ("chunk",)),
        ("prop-x-int", lambda d: (gspn_propagate, tuple(t.long() for t in P(d))), ("x",)),
        ("prop-lam-shape", lambda d: (gspn_propagate, (P(d)[0], P(d)[1][:, :3], P(d)[2])), ("lam",)),
        ("prop-gates-K3", lambda d: (gspn_propagate, P(d, C=4)[:2] + (P(d, C=4, K=3)[2],)), ("gates",)),
        ("prop-mixed-dtype", lambda d: (gspn_propagate, (P(d)[0], P(d, dtype=torch.float64)[1], P(d)[2])), ("lam",)),
        ("prop-empty-H", lambda d: (gspn_propagate, P(d, H=0)), ("x",)),
        ("prop-kernel-bogus", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, kernel="bogus"), P(d)), ("kernel",)),
        ("prop-kernel-int", lambda d: (lambda a, b, c: gspn_propagate(a, b, c, kernel=1), P(d)), ("kernel",)),
        ("prop-lam-otherdev", lambda d: (gspn_propagate, (P(d)[0], P(d)[1].to(_other_device(d)), P(d)[2])), ("lam",)),
        ("dw-weight-C", lambda d: (depthwise_conv2d, (D(d)[0], D(d, C=4)[1])), ("weight",)),
        ("dw-weight-K2", lambda d: (depthwise_conv2d, (D(d)[0], D(d, K=2)[1])), ("weight",)),
        ("dw-x-int", lambda d: (depthwise_conv2d, (D(d)[0].long(), D(d)[1])), ("x",)),
        ("dw-bias-C", lambda d: (depthwise_conv2d, (D(d)[0], D(d)[1], D(d, C=4)[2])), ("bias",)),
        ("dw-add_input-str", lambda d: (lambda a, b, c: depthwise_conv2d(a, b, c, add_input="no"), D(d)), ("add_input",)),
        ("dw-empty-B", lambda d: (depthwise_conv2d, D(d, B=0)), ("x",)),
    ]
    cases = []
    for label, make, names in bad:
        def build(dev, make=make):
            f, args = make(dev)
            return Call(lambda: _compiled(f)(*args), eager=lambda: f(*args))

        cases.append(Case(f"compile/{label}", build, "error", names, compile=True))

    def build_prop(dev):
        x, lam, gates = P(dev, H=4, W=5)
        return Call(lambda: _compiled(lambda a, b, c: gspn_propagate(a, b, c, 2))(x, lam, gates), check_prop(x, lam, gates, 2))

    def build_dw(dev):
        x, w, b = D(dev)
        x = x.contiguous(memory_format=torch.channels_last)
        return Call(lambda: _compiled(lambda a, b_, c: depthwise_conv2d(a, b_, c, True))(x, w, b), check_dw(x, w, b, True))

    cases += [Case("compile/prop-valid", build_prop, "result"), Case("compile/dw-valid", build_dw, "result")]
    return cases


def build_cases() -> list[Case]:
    """Every case, in a fixed order (names are unique)."""
    cases = []
    for entry, fn, raw in PROP_ENTRIES:
        cases += [_error_case(entry, fn, raw, *c) for c in prop_bad_tensor_cases()]
        cases += [_valid_prop(entry, fn, raw, label, make, chunk, finite=finite) for label, make, chunk, finite in prop_valid_cases()]
        cases += [_outside_case(entry, fn, raw, *c) for c in prop_outside_line_cases()]
        cases += [_chunk_case(entry, fn, raw, *c) for c in prop_chunk_cases()]
    cases += _kernel_cases() + _grad_cases() + _backward_cases()
    for entry, fn, raw in DW_ENTRIES:
        cases += [_error_case(entry, fn, raw, *c) for c in dw_bad_cases()]
        cases += [_dw_valid(entry, fn, raw, *c) for c in dw_valid_cases()]
    cases += _dw_flag_cases() + _dw_grad_cases() + _dw_backward_cases() + _option_cases() + _compile_cases()
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise AssertionError(f"duplicate case names: {sorted(dup)}")
    return cases


# ----------------------------------------------------------------------------------------------------------
# Running one case and classifying it


def _exc_info(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e)[:MESSAGE_CHARS]}


def run_case(case: Case, device: str) -> dict:
    """Run one case in this process; return its raw outcome (JSON-serialisable)."""
    try:
        call = case.build(device)
    except SetupError as e:
        return {"status": "setup", "message": str(e)[:MESSAGE_CHARS]}
    out: dict = {} if call.expect is None else {"expect": call.expect}
    if case.compile:
        try:
            call.eager()
            out["eager"] = {"status": "returned"}
        except Exception as e:  # the fuzz records every exception type
            out["eager"] = {"status": "raised", **_exc_info(e)}
    try:
        result = call.run()
    except Exception as e:  # the fuzz records every exception type
        out.update({"status": "raised", **_exc_info(e)})
        return out
    if call.check is None:
        out["status"] = "returned"
        out["result"] = _describe(result)
        return out
    try:
        call.check(result)
    except Wrong as e:
        out.update({"status": "wrong", "message": str(e)[:MESSAGE_CHARS]})
        return out
    out["status"] = "ok"
    return out


def _describe(result) -> str:
    if isinstance(result, torch.Tensor):
        return f"tensor {tuple(result.shape)} {result.dtype} on {result.device}"
    if isinstance(result, (tuple, list)):
        return "(" + ", ".join(_describe(r) for r in result) + ")"
    return type(result).__name__


def _names_argument(message: str, names) -> bool:
    return any(f"`{n}`" in message for n in names)


def _schema_refusal(exc: dict, names) -> bool:
    return exc.get("type") == "RuntimeError" and any(
        f"for argument '{n}'" in exc["message"] for n in names
    )


def _clear(exc: dict, names) -> bool:
    return exc.get("type") in ("TypeError", "ValueError") and _names_argument(exc.get("message", ""), names)


def classify(case: Case, outcome: dict) -> tuple[str, str]:
    """(label, why) of a case's outcome."""
    status = outcome["status"]
    expect = outcome.get("expect", case.expect)
    if status == "hang":
        return "HANG", f"no result within {outcome.get('timeout')} s"
    if status == "crash":
        return "CRASH", f"exit code {outcome.get('exitcode')}" + (f": {outcome['message']}" if outcome.get("message") else "")
    if status == "setup":
        return "SKIP", outcome["message"]
    if status in ("ok", "wrong", "returned") and expect == "error":
        return "SILENT", f"accepted, returned {outcome.get('result', 'a result')}"
    if status == "ok":
        return "OK-RESULT", ""
    if status == "wrong":
        return "WRONG", outcome["message"]
    if status == "returned":  # a valid call whose case has no check: never built that way
        return "WRONG", "no check for a valid input"
    # status == "raised"
    why = f"{outcome['type']}: {outcome['message'].splitlines()[0] if outcome['message'] else ''}"
    if expect == "result":
        return "WRONG", f"valid input refused: {why}"
    if case.compile:
        eager = outcome.get("eager", {})
        if not _clear(eager, case.names):
            return "CRYPTIC", f"eager call: {eager.get('type', 'no error')}: {eager.get('message', '')[:300]}"
        first = eager["message"].splitlines()[0]
        if first in outcome["message"]:
            return "OK-CLEAR", f"compiled {outcome['type']} carries the eager {eager['type']}"
        return "CRYPTIC", f"compiled error lacks the eager message: {why}"
    if _clear(outcome, case.names):
        return "OK-CLEAR", why
    if case.raw and _schema_refusal(outcome, case.names):
        return "OK-SCHEMA", why
    return "CRYPTIC", why


# ----------------------------------------------------------------------------------------------------------
# Process management


def _child(index: int, device: str, conn, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        case = build_cases()[index] if _CASES is None else _CASES[index]
        outcome = run_case(case, device)
    except BaseException as e:  # report what escaped the case runner (its own bug) instead of a bare exit code
        outcome = {"status": "crash", "exitcode": None, "message": "".join(traceback.format_exception(e))[-MESSAGE_CHARS:]}
    conn.send(outcome)
    conn.close()


_CASES: Optional[list] = None  # the parent's case list, inherited by forked children


def _receive(conn) -> Optional[dict]:
    """The child's outcome, or None if it died before sending one (the pipe then reads as closed)."""
    try:
        return conn.recv() if conn.poll() else None
    except EOFError:
        return None


def run_all(cases: list[Case], indices: list[int], device: str, jobs: int, timeout: float, start: str,
            threads: int = 1, progress: Callable[[str], None] = lambda s: None) -> dict[int, dict]:
    """Run ``cases[i]`` for ``i`` in ``indices``, each in its own process, ``jobs`` at a time."""
    global _CASES
    _CASES = cases if start == "fork" else None
    ctx = mp.get_context(start)
    pending = list(indices)
    running: dict = {}  # sentinel -> (index, process, conn, started)
    results: dict[int, dict] = {}
    while pending or running:
        while pending and len(running) < jobs:
            i = pending.pop(0)
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(i, device, child_conn, threads), daemon=True)
            p.start()
            child_conn.close()
            running[p.sentinel] = (i, p, parent_conn, time.monotonic())
        ready = mp.connection.wait(list(running), timeout=1.0)
        now = time.monotonic()
        for s in list(running):
            i, p, conn, started = running[s]
            if s in ready:
                outcome = _receive(conn)
                p.join()
                if outcome is None:
                    outcome = {"status": "crash", "exitcode": p.exitcode}
                elif p.exitcode not in (0, None) and outcome.get("status") != "crash":
                    outcome = {"status": "crash", "exitcode": p.exitcode, "message": "exited non-zero after reporting"}
            elif now - started > timeout:
                p.kill()
                p.join()
                outcome = {"status": "hang", "timeout": timeout}
            else:
                continue
            outcome["seconds"] = round(now - started, 2)
            conn.close()
            del running[s]
            results[i] = outcome
            progress(f"[{len(results)}/{len(indices)}] {cases[i].name}: {classify(cases[i], outcome)[0]}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    ap.add_argument("--start", choices=("fork", "spawn"), default=None,
                    help="how a case's process starts (default: fork on cpu, spawn on cuda)")
    ap.add_argument("-k", dest="pattern", default=None, help="only cases whose name contains this")
    ap.add_argument("--limit", type=int, default=None, help="at most this many cases (after -k)")
    ap.add_argument("--out", default=None, help="write every case's outcome as JSON here")
    ap.add_argument("--list", action="store_true", help="list the case names and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    start = args.start or ("fork" if args.device == "cpu" else "spawn")

    cases = build_cases()
    indices = [i for i, c in enumerate(cases) if args.pattern is None or args.pattern in c.name]
    if args.limit is not None:
        indices = indices[: args.limit]
    if args.list:
        for i in indices:
            print(cases[i].name)
        return 0
    if not indices:
        ap.error(f"no case matches -k {args.pattern!r}")
    t0 = time.monotonic()
    results = run_all(cases, indices, args.device, args.jobs, args.timeout, start,
                      progress=(lambda s: None) if args.quiet else (lambda s: print(s, flush=True)))
    rows = []
    for i in indices:
        label, why = classify(cases[i], results[i])
        expect = results[i].get("expect", cases[i].expect)
        rows.append({"name": cases[i].name, "expect": expect, "label": label, "why": why, "outcome": results[i]})
    counts = {label: sum(r["label"] == label for r in rows) for label in LABELS}
    flagged = [r for r in rows if r["label"] in FLAGGED_LABELS]
    print(f"\ngspn2 op fuzz: {len(rows)} cases on {args.device} in {time.monotonic() - t0:.0f} s")
    print(f"{'outcome':<10} {'cases':>6}")
    for label in LABELS:
        print(f"{label:<10} {counts[label]:>6}")
    for r in rows:
        if r["label"] in FLAGGED_LABELS or r["label"] == "SKIP":
            print(f"  {r['label']:<8} {r['name']}: {r['why'][:300]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "counts": counts, "cases": rows}, f, indent=1)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
