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

