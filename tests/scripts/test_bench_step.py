"""The CPU-testable parts of scripts/bench_step.py (the timings need a GPU)."""

from __future__ import annotations

import pytest

SCRIPT = "bench_step"  # the `bench` fixture (tests/scripts/conftest.py) imports it


def test_unknown_model_names_the_argument(bench, monkeypatch):
    bench._check_model("gspn2_micro")  # a registered name passes
    monkeypatch.setattr("sys.argv", ["bench_step.py", "--models", "gspn2_micro", "nope_net"])
    with pytest.raises(SystemExit, match="--models: unknown timm model 'nope_net'"):
        bench.main()


@pytest.mark.parametrize("flag,value", [("--batch", "0"), ("--iters", "0"), ("--repeats", "0"), ("--warmup", "-1")])
def test_bad_counts_name_the_argument(bench, flag, value, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_step.py", flag, value])
    with pytest.raises(SystemExit, match=flag):
        bench.main()


def test_summary_takes_medians_over_rounds(bench):
    rows = [
        {"model": "a", "eager_ms": 100.0, "host_ms": 90.0, "graph_ms": 50.0},
        {"model": "a", "eager_ms": 120.0, "host_ms": 80.0, "graph_ms": 70.0},
        {"model": "b", "error": "boom"},
    ]
    table = bench.summarize(rows, ["a", "b"], batch=128).splitlines()
    # medians 110 / 85 / 60 ms: 1164 and 2133 img/s, eager 1.83x the graph
    assert table[2] == "| a | 110.00 | 85.00 | 60.00 | 1164 | 2133 | 1.83 |"
    assert table[3].startswith("| b | failed")



def test_count_ops_of_micro(bench):
    """--count-ops on gspn2_micro at a small input: a forward and a backward that both dispatch, per-op counts
    that sum to the total, the GSPN-2 blocks found with their children, and a custom op counted as one call."""
    row = bench.count_ops("gspn2_micro", batch=1, size=32)
    assert row["forward"] > 0 and row["backward"] > 0
    assert row["total"] == row["forward"] + row["backward"] == sum(row["ops"].values())
    # one scan per block in forward, its backward op once per block in backward (5 blocks in gspn2_micro)
    assert row["ops"]["gspn2.propagate"] == row["ops"]["gspn2.propagate_backward"] == 5
    blk = row["blocks"]["GSPN2Block"]
    assert blk["blocks"] == 5 and blk["per_block"] * 5 == blk["forward_calls"] <= row["forward"]
    assert blk["children_per_block"]["mixer"] > blk["children_per_block"]["lpu1"] > 0
    text = bench.format_counts(row).splitlines()
    assert text[0].startswith(f"gspn2_micro: {row['total']} aten calls") and "GSPN2Block x5" in text[2]


def test_count_ops_rejects_bad_sizes(bench):
    with pytest.raises(ValueError, match="`batch` and `size`"):
        bench.count_ops("gspn2_micro", batch=0)
