"""scripts/ncu_source.py: the instruction and stall summary of an Nsight Compute source-page CSV (CPU)."""

from __future__ import annotations

import csv

import pytest

from tests.scripts._load import script_module

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
          "stall_wait", "stall_barrier (Not Issued)"]


def _write(path, kernels):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in kernels:
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (sass, executed, samples, barrier, wait) in enumerate(rows):
                w.writerow([hex(0x1000 + 16 * i), f"      {sass}", samples, executed, barrier, wait, 0])
    return str(path)


def test_summary_and_blocks(tmp_path):
    # A loop body of three instructions run 100 times, a prologue run once, a predicated branch.
    rows = [("LDC R1, c[0x0][0x28]", 1, 0, 0, 0), ("S2R R0, SR_TID.X", 1, 2, 0, 2),
            ("FFMA R2, R3, R4, R2", 100, 10, 0, 10), ("LDS R3, [R5]", 100, 30, 20, 10),
            ("FFMA R2, R3, R6, R2", 100, 0, 0, 0), ("@P0 BRA 0x1020", 100, 8, 8, 0)]
    path = _write(tmp_path / "k.csv", [("kernel_a", rows), ("kernel_b", rows[:2])])
    with script_module("ncu_source") as m:
        kernels = m.read_kernels(path)
        assert [k["name"] for k in kernels] == ["kernel_a", "kernel_b"]
        text = m.summary(kernels[0])
        blocks = m.blocks(kernels[0], 2)
    assert text.startswith("0.00 M warp instructions")  # 402 instructions
    assert "FFMA 49.8%" in text and "LDS 24.9%" in text and "BRA 24.9%" in text  # of 402
    assert "barrier 56.0%" in text and "wait 44.0%" in text  # of 50 samples: 28 barrier, 22 wait
    # the loop body with its closing branch is one block; the prologue another
    assert "SASS 2-5 (4 instructions, each run 100 times): 99.5% of the instructions" in blocks[0]
    assert "FFMA 2" in blocks[0] and "SASS 0-1" in blocks[1]


def test_refuses_a_file_without_kernels_and_an_unknown_kernel(tmp_path, monkeypatch):
    empty = tmp_path / "empty.csv"
    empty.write_text('"==PROF== nothing"\n')
    path = _write(tmp_path / "k.csv", [("kernel_a", [("NOP", 1, 0, 0, 0)])])
    with script_module("ncu_source") as m:
        with pytest.raises(SystemExit, match="no kernel in"):
            m.read_kernels(str(empty))
        monkeypatch.setattr("sys.argv", ["ncu_source.py", path, "--kernel", "3"])
        with pytest.raises(SystemExit, match=r"--kernel 3 is not in 0\.\.0"):
            m.main()
