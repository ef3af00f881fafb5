"""The CPU-testable parts of scripts/bench_op.py (the timings need a GPU)."""

from __future__ import annotations

SCRIPT = "bench_op"  # the `bench` fixture (tests/scripts/conftest.py) imports it


def test_floor_bytes_counts_every_direction(bench):
    # B16 C2 1024^2 fp32, K = C: per pixel and direction, x + lam + h (C each) and 3 gates (K each).
    fwd, bwd = bench.floor_bytes(16, 2, 1024, 1024, 2, 4)
    px = 16 * 1024 * 1024
    assert fwd == 4 * (3 * 2 + 3 * 2) * px * 4
    assert bwd == (4 * (5 * 2 + 6 * 2) + 2) * px * 4
    assert bench.floor_bytes(1, 8, 64, 64, 1, 2)[0] == 4 * (3 * 8 + 3) * 64 * 64 * 2


def test_kernel_name_and_table_show_the_cluster_kernel(bench):
    assert bench.kernel_name({"kernel": "fast", "cs": 1, "cluster_ctas": 2}) == "fast (1) + cluster x2"
    wide = {"kernel": "fast", "cs": 1, "cluster_ctas": 2, "cluster_sub": 2, "split_ctas": 2}
    assert bench.kernel_name(wide) == "fast (1) + cluster x2 (2 tiles per copy) + split x2"
    assert bench.kernel_name({"kernel": "fast", "cs": 4, "cluster_ctas": 0}) == "fast (4)"
    assert bench.kernel_name({"kernel": "general", "cs": 2}) == "general (2)"
    split = {"kernel": "fast", "cs": 1, "cluster_ctas": 8, "split_ctas": 2}
    assert bench.kernel_name(split) == "fast (1) + cluster x8 + split x2"
    rec = dict(label="GSPN-1 anchor", B=16, C=2, H=1024, W=1024, K=2, dtype="fp32", fwd_ms=1.5, bwd_ms=12.3,
               fwd_floor_ms=0.758, bwd_floor_ms=1.42, fwd_pct_floor=50.5, bwd_pct_floor=11.5, general_fwd_ms=3.71,
               general_bwd_ms=20.7, stream_fwd_ms=2.01, stream_bwd_ms=12.4, plan_fwd={"kernel": "fast", "cs": 1, "cluster_ctas": 2},
               plan_bwd={"kernel": "fast", "cs": 1, "cluster_ctas": 8})
    md = bench.markdown([rec], 4.25e12, {"gpu": "H200", "torch": "2.11", "cuda": "13.0"})
    header, sep, row = md.splitlines()[2:5]
    assert header.count("|") == sep.count("|") == row.count("|")  # one cell per column
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[0] == "GSPN-1 anchor: 16x2x1024x1024, K=2" and cells[9] == "2.01 / 12.4"
    assert cells[-1] == "fast (1) + cluster x2; fast (1) + cluster x8"
