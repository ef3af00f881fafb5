"""gspn2.layers.LayerNorm2d: timm's LayerNorm2d computed in the activation dtype."""

from __future__ import annotations

import pytest
import torch
from timm.layers import LayerNorm2d as TimmLayerNorm2d

from gspn2.layers import LayerNorm2d


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_equals_timm_and_keeps_the_activation_dtype(channels_last):
    torch.manual_seed(0)
    norm = LayerNorm2d(6)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    timm_norm = TimmLayerNorm2d(6)
    timm_norm.load_state_dict(norm.state_dict(), strict=True)
    x = torch.randn(2, 6, 3, 5)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(norm(x), timm_norm(x))
    xb = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm(xb)
    want = timm_norm(xb.float())  # the same input, normalised in fp32
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())
    assert got.is_contiguous(memory_format=torch.channels_last)
