"""The oracle of the model tests: the GSPN-2 blocks written module by module from plain torch and timm
modules.

:func:`reference` takes a gspn2 module (a whole ``GSPN2``, a block, a mixer, ...) and returns a copy in
which every gspn2 layer is replaced by the plain module it stands for, holding the same state dict:

* ``gspn2.layers.LayerNorm2d`` -> timm's ``LayerNorm2d`` (fp32 under autocast);
* ``Conv1x1`` and ``ChunkedConv1x1`` -> ``nn.Conv2d`` with a 1x1 kernel (the mixer chunks the output);
* ``PointwiseMlp`` -> timm's ``Mlp(use_conv=True)`` (``nn.Conv2d``, ``nn.GELU``, ``nn.Conv2d``);
* ``LocalPerceptionUnit`` -> ``x + nn.Conv2d(x)``;
* ``GSPN2Mixer`` and ``GSPN2Block`` -> the formulas of docs/models.md ("Architecture") op by op, autograd
  saving every intermediate, the scan through ``gspn2.ops.gspn_propagate``.

The stem, the downsampling convolutions, the head (with its norm swapped), LayerScale and DropPath are
the model's own torch/timm modules, copied. Parameter shapes come from the plain modules' constructors,
so a strict ``load_state_dict`` of the gspn2 module's weights also checks the state dict layout.

:func:`run`, :func:`assert_same` and :func:`assert_bf16_close` are the comparison of a model with its oracle
(tests/models/test_equivalence.py, on CUDA tests/models/test_gspn2_cuda.py).
"""

from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d as TimmLayerNorm2d
from timm.layers import Mlp

from gspn2.layers import Conv1x1, LayerNorm2d, PointwiseMlp
from gspn2.models import GSPN2Block, GSPN2Mixer, LocalPerceptionUnit
from gspn2.ops import gspn_propagate

__all__ = ["assert_bf16_close", "assert_same", "reference", "rel_err", "run"]

Grads = Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]


def _conv1x1(conv: Conv1x1) -> nn.Conv2d:
    return nn.Conv2d(conv.in_channels, conv.out_channels, 1, bias=conv.bias is not None)


def _norm(norm: LayerNorm2d) -> TimmLayerNorm2d:
    return TimmLayerNorm2d(norm.normalized_shape[0], eps=norm.eps)


class ReferenceLPU(nn.Module):
    def __init__(self, lpu: LocalPerceptionUnit) -> None:
        super().__init__()
        self.conv = copy.deepcopy(lpu.conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class ReferenceMixer(nn.Module):
    def __init__(self, mixer: GSPN2Mixer) -> None:
        super().__init__()
        self.proxy_dim, self.affinity_groups, self.chunk = mixer.proxy_dim, mixer.affinity_groups, mixer.chunk
        self.split_sizes = mixer.split_sizes
        self.in_proj = _conv1x1(mixer.in_proj)
        self.conv_dw = copy.deepcopy(mixer.conv_dw)
        self.act = nn.SiLU()
        self.generate = _conv1x1(mixer.generate)
        self.proj_up = _conv1x1(mixer.proj_up)
        self.skip = nn.Parameter(torch.empty_like(mixer.skip))
        self.norm = _norm(mixer.norm)
        self.out_proj = _conv1x1(mixer.out_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        P, K, D = self.proxy_dim, self.affinity_groups, 4  # four scan directions (docs/spec.md)
        v, z = self.in_proj(x).chunk(2, dim=1)
        v = self.act(self.conv_dw(v))
        xp, lam, u, gates = self.generate(v).split(self.split_sizes, dim=1)
        lam = torch.sigmoid(lam).unflatten(1, (D, P))  # (B, 4, P, H, W)
        gates = gates.unflatten(1, (D, 3, K))  # (B, 4, 3, K, H, W) logits
        # The op takes one dtype for all three inputs (under autocast sigmoid's output is fp32), NCHW lines.
        dt = xp.dtype
        h = gspn_propagate(xp.contiguous(), lam.to(dt).contiguous(), gates.to(dt).contiguous(), self.chunk)
        y = (h * u.unflatten(1, (D, P))).flatten(1, 2)  # (B, 4P, H, W)
        y = self.proj_up(y) + v * self.skip.view(1, -1, 1, 1).to(v.dtype)
        return self.out_proj(self.norm(y) * self.act(z))


class ReferenceBlock(nn.Module):
    def __init__(self, block: GSPN2Block) -> None:
        super().__init__()
        self.lpu1 = ReferenceLPU(block.lpu1)
        self.norm1 = _norm(block.norm1)
        self.mixer = ReferenceMixer(block.mixer)
        self.ls1, self.drop_path1 = copy.deepcopy(block.ls1), copy.deepcopy(block.drop_path1)
        self.lpu2 = ReferenceLPU(block.lpu2)
        self.norm2 = _norm(block.norm2)
        self.mlp = _plain(block.mlp)
        self.ls2, self.drop_path2 = copy.deepcopy(block.ls2), copy.deepcopy(block.drop_path2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lpu1(x)
        x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x))))
        x = self.lpu2(x)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def _plain(module: nn.Module) -> Optional[nn.Module]:
    """The plain counterpart of a gspn2 module (weights not loaded yet); None for any other module."""
    if isinstance(module, GSPN2Block):
        return ReferenceBlock(module)
    if isinstance(module, GSPN2Mixer):
        return ReferenceMixer(module)
    if isinstance(module, LocalPerceptionUnit):
        return ReferenceLPU(module)
    if isinstance(module, PointwiseMlp):
        return Mlp(module.fc1.in_channels, module.fc1.out_channels, act_layer=nn.GELU, use_conv=True)
    if isinstance(module, LayerNorm2d):
        return _norm(module)
    if isinstance(module, Conv1x1):
        return _conv1x1(module)
    return None


def _swap_children(module: nn.Module) -> None:
    for name, child in module.named_children():
        plain = _plain(child)
        if plain is None:
            _swap_children(child)
        else:
            setattr(module, name, plain)


def reference(module: nn.Module) -> nn.Module:
    """A module-by-module copy of ``module`` (see the module docstring) holding its weights (a strict
    ``load_state_dict``), in the same train/eval mode, on the same device and in the dtype of its first
    parameter."""
    ref = _plain(module)
    if ref is None:
        ref = copy.deepcopy(module)  # the model's own modules (stem, head, ...) and attributes
        _swap_children(ref)
    param = next(module.parameters())
    ref = ref.to(param.device, param.dtype)
    ref.load_state_dict(module.state_dict(), strict=True)
    return ref.train(module.training)


# ---- comparing a model with its oracle ----


def run(model: torch.nn.Module, x: torch.Tensor, train: bool, bf16: bool, seed: int = 3) -> Grads:
    """Output, input gradient and parameter gradients of a fixed random projection of the output."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    torch.manual_seed(seed)  # the same drop-path draws for model and oracle
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * weight).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), x.grad.float(), grads


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``ref``."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_same(model: Grads, ref: Grads, rtol: float) -> None:
    """Output, input gradient and every parameter gradient of the model within ``rtol`` of the oracle's,
    relative to each tensor's largest magnitude."""
    assert model[2].keys() == ref[2].keys()
    pairs = [("output", model[0], ref[0]), ("input grad", model[1], ref[1])]
    pairs += [(f"grad {n}", model[2][n], ref[2][n]) for n in ref[2]]
    bad = [(what, err) for what, a, b in pairs if (err := rel_err(a, b)) > rtol]
    assert not bad, f"the model differs from the oracle (relative to max |ref|, tol {rtol:g}): {bad}"


def assert_bf16_close(model: Grads, ref: Grads, exact: Grads) -> None:
    """The model's bf16 error against the fp32 oracle <= 4 x the oracle's bf16 error + 2e-2.

    The model's LayerNorms run in bf16 under autocast where the oracle's (timm's) run in float32 (by design:
    docs/models.md, "Speed"), so its bf16 error is larger; on an H200 the largest ratio was 3.3x, on
    gspn2_tiny's ``mixer.generate`` gradients (0.082 against 0.025). A wrong cast or a dropped term gives
    errors of order 1."""
    pairs = [("output", model[0], ref[0], exact[0]), ("input grad", model[1], ref[1], exact[1])]
    pairs += [(f"grad {n}", model[2][n], ref[2][n], exact[2][n]) for n in exact[2]]
    bad = []
    for what, a, b, e in pairs:
        err_model, err_ref = rel_err(a, e), rel_err(b, e)
        if err_model > 4 * err_ref + 2e-2:
            bad.append((what, round(err_model, 4), round(err_ref, 4)))
    assert not bad, f"bf16 model much worse than the bf16 oracle (what, model err, oracle err): {bad}"
