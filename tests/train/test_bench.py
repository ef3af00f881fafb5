"""scripts/bench_ddp.py runs under torchrun (here: two CPU processes, gloo, a tiny model)."""

from __future__ import annotations

import json

import pytest

from tests.train._helpers import run_cli


@pytest.mark.slow
def test_bench_ddp_two_processes_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        [
            "--standalone",
            "--nproc_per_node=2",
            "scripts/bench_ddp.py",
            "--device",
            "cpu",
            "--model",
            "gspn2_micro",
            "--img-size",
            "32",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--precision",
            "fp32",
            "--json",
            str(out),
        ],
        torchrun=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "img/s per GPU" in proc.stdout
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and len(result["img_per_s_per_gpu"]) == 2
    assert all(v > 0 for v in result["img_per_s_per_gpu"])
    assert result["img_per_s_total"] == pytest.approx(sum(result["img_per_s_per_gpu"]))
