"""scripts/activation_memory.py: the saved-for-backward counter on models whose saved tensors are known."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.scripts._load import script_module


@pytest.fixture(scope="module")
def am():
    with script_module("activation_memory") as module:
        yield module


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        y = self.fc(x)  # saves x (its input; the weight is a parameter, not counted)
        return y * y  # saves y once (both operands are the same storage)


class _Net(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(dim), _Block(dim))

    def forward(self, x):
        return self.blocks(x).sum()


def test_counts_distinct_storages_per_block_without_parameters(am):
    torch.manual_seed(0)
    net = _Net(8)
    x = torch.randn(4, 8, requires_grad=True)
    names = am.top_level_blocks(net)
    assert names == ["blocks.0", "blocks.1"]
    with am.SavedTensorCounter(net, names) as counter:
        loss = net(x)
    loss.backward()
    row = 4 * 8 * 4  # one (4, 8) float32 activation
    assert counter.per_block["blocks.0"] == 2 * row  # x and fc's output
    assert counter.per_block["blocks.1"] == 2 * row
    assert counter.total == 4 * row
    # A view of a saved tensor is not counted again.
    with am.SavedTensorCounter() as counter:
        a = torch.randn(16, requires_grad=True)
        (a.view(4, 4) * a.view(4, 4).t()).sum()
    assert counter.total == 16 * 4


def test_gspn2_per_block_bytes_add_up(am):
    """A GSPN-2 model at a tiny size: eager and per-block numbers add up to the total."""
    r = am.measure("gspn2_micro", batch=1, resolution=64, dtype=torch.float32, device="cpu", compile_model=False)
    assert r["saved_bytes"] > 0
    assert sum(r["per_block"].values()) + r["outside_blocks"] == r["saved_bytes"]
    assert len(r["per_block"]) >= 4 and all(v > 0 for v in r["per_block"].values())


def test_bad_arguments_are_named(am):
    with pytest.raises(SystemExit):
        am.main(["--models", "no_such_model_xyz"])
    with pytest.raises(SystemExit):
        am.main(["--batch", "0"])
    for bad in ("no_such_key=1", "ban_recompute_reductions", "activation_memory_budget=abc"):
        with pytest.raises(SystemExit):
            am.main(["--models", "gspn2_micro", "--aot-config", bad])


def test_aot_config_is_parsed():
    from gspn2.benchmark import aot_config

    got = aot_config(["ban_recompute_materialized_backward=False", "activation_memory_budget=0.8"])
    assert got == {"ban_recompute_materialized_backward": False, "activation_memory_budget": 0.8}
    with pytest.raises(ValueError, match="no 'nope'"):
        aot_config(["nope=1"])
