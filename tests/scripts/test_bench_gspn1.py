"""The CPU-testable parts of scripts/bench_gspn1.py (the timings need a GPU and GSPN-1's sources)."""

from __future__ import annotations

import pytest

SCRIPT = "bench_gspn1"  # the `bench` fixture (tests/scripts/conftest.py) imports it


def test_gspn2_problems_do_the_same_scan_work(bench):
    for (B, C, H, W), _ in bench.SHAPES:
        problems = bench.gspn2_shapes(B, C, H, W)
        assert [k for *_, k in problems] == [C // 4, 1]  # per-channel gates, then one gate group
        for b, c, h, w, _k in problems:
            assert 4 * b * c * h * w == B * C * H * W  # four directions of C / 4 channels
    with pytest.raises(ValueError, match="multiple of 4"):
        bench.gspn2_shapes(1, 6, 8, 8)


def test_bad_source_directory_is_named_before_anything_is_written(bench, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--gspn1-src: .* is not a directory"):
        bench.main(["--gspn1-src", str(tmp_path / "absent"), "--out-dir", str(out)])
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "gaterecurrent2dnoind_cuda.cpp").write_text("")
    with pytest.raises(ValueError, match="lacks gaterecurrent2dnoind_kernel.cu"):
        bench.main(["--gspn1-src", str(tmp_path / "src"), "--out-dir", str(out)])
    assert not out.exists()


def test_markdown_has_one_cell_per_column(bench):
    rec = dict(gspn1="16x8x1024x1024", gspn2="16x2x1024x1024, K=2", dtype="fp32", gspn1_fwd_ms=31.8,
               gspn1_bwd_ms=77.3, fwd_ms=1.43, bwd_ms=3.31, graph_fwd_ms=1.42, graph_bwd_ms=3.30)
    env = dict(command="python scripts/bench_gspn1.py", gpu="H100", torch="2.11", cuda="13.0", gspn1_src="/src")
    header, sep, row = bench.markdown([rec], env).splitlines()[3:6]
    assert header.count("|") == sep.count("|") == row.count("|")
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == "1.43 / 3.31" and cells[5] == "22.2x / 23.4x"
