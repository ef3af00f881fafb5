"""gspn2.benchmark.median_ms: call counts and argument checks (no timing assertions)."""

from __future__ import annotations

import pytest

from gspn2.benchmark import median_ms


def test_runs_warmup_then_timed_calls():
    calls = []
    ms = median_ms(lambda: calls.append(1), warmup=3, iters=5, cuda=False)
    assert len(calls) == 8
    assert isinstance(ms, float) and ms >= 0.0


@pytest.mark.parametrize("warmup, iters", [(-1, 5), (0, 0)])
def test_bad_counts_are_named(warmup, iters):
    with pytest.raises(ValueError, match="`warmup` must be >= 0 and `iters` >= 1"):
        median_ms(lambda: None, warmup=warmup, iters=iters)
