"""scripts/triton_resources.py: the norm-gate backward kernel compiled ahead of time for sm_90 on the CPU."""

from __future__ import annotations

import pytest

from gspn2.ops import norm_backward
from tests.scripts._load import script_module

needs_triton = pytest.mark.skipif(not norm_backward.triton_available(), reason="needs Triton")


@needs_triton
def test_fewer_tile_elements_per_thread_take_fewer_registers():
    with script_module("triton_resources") as tr:
        small = tr.resources(480, block_m=2, warps=8, stages=1, arch=90)  # 4 tile elements per thread
        large = tr.resources(480, block_m=4, warps=4, stages=1, arch=90)  # 16
    assert 0 < small["registers"] < large["registers"] <= 255
    assert small["local"] == 0  # no spills


@needs_triton
def test_cli_prints_one_line_per_width_and_refuses_bad_arguments(capsys):
    with script_module("triton_resources") as tr:
        tr.main(["--e", "40"])
        line = capsys.readouterr().out.strip()
        assert line.startswith("E=40 block_m=") and "registers" in line
        with pytest.raises(SystemExit):
            tr.main(["--warps", "0"])
    assert "--warps must be >= 1" in capsys.readouterr().err
