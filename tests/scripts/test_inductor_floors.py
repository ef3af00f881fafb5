"""scripts/inductor_floors.py: Inductor kernels' time against the bytes Inductor counts for them (CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._helpers import REPO
from tests.scripts._load import script_module

PROFILE = """gspn2_tiny train 224^2 batch 128: 50.00 ms/step, 2560 img/s (unprofiled)
profiled CUDA time per step: 30.00 ms (sum of kernel times)
 self CUDA ms/step  share calls/step  operator
             6.000  20.0%      212.0  aten::mm
             0.600   2.0%        2.0  triton_per_fused_native_layer_norm_1
             0.100   0.3%        4.0  triton_poi_fused_gelu_0
             0.050   0.2%        1.0  triton_poi_fused_unknown_9
"""

# Two graphs' kernels, one name in both (byte counts averaged), as TORCH_LOGS=output_code writes them.
CODE = """
@triton_heuristics.pointwise(inductor_meta={'kernel_name': 'triton_poi_fused_unknown_9'})
@triton_heuristics.pointwise(inductor_meta={'kernel_name': 'triton_poi_fused_gelu_0', 'mutated_arg_names': [],
    'kernel_num_gb': 0.021, 'backend_hash': 'x'})
@triton_heuristics.persistent_reduction(inductor_meta={'kernel_name': 'triton_per_fused_native_layer_norm_1',
    'kernel_num_gb': 0.42})
@triton_heuristics.pointwise(inductor_meta={'kernel_name': 'triton_poi_fused_gelu_0', 'kernel_num_gb': 0.063})
"""


def test_floors_per_kernel_and_total():
    with script_module("inductor_floors") as m:
        r = m.floors(PROFILE, CODE, tbps=4.2)
    by_name = {k["name"]: k for k in r["kernels"]}
    assert set(by_name) == {"triton_per_fused_native_layer_norm_1", "triton_poi_fused_gelu_0"}
    assert r["missing"] == ["triton_poi_fused_unknown_9"]
    # 0.42 GB x 2 launches at 4.2 TB/s = 0.2 ms; gelu: mean 0.042 GB x 4 = 0.04 ms
    assert by_name["triton_per_fused_native_layer_norm_1"]["floor_ms"] == pytest.approx(0.2)
    assert by_name["triton_poi_fused_gelu_0"]["floor_ms"] == pytest.approx(0.04)
    assert r["ms"] == pytest.approx(0.7) and r["floor_ms"] == pytest.approx(0.24)
    assert r["kernels"][0]["name"] == "triton_per_fused_native_layer_norm_1"  # largest time above its floor
    with script_module("inductor_floors") as m, pytest.raises(ValueError, match="`tbps`"):
        m.floors(PROFILE, CODE, tbps=0)


def test_cli_refuses_a_log_without_byte_counts(tmp_path):
    prof, log = tmp_path / "p.txt", tmp_path / "c.log"
    prof.write_text(PROFILE)
    log.write_text("no kernels here\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "inductor_floors.py"), str(prof), str(log)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "TORCHINDUCTOR_BENCHMARK_KERNEL=1" in out.stderr
    log.write_text(CODE)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "inductor_floors.py"), str(prof), str(log)],
                         capture_output=True, text=True, check=True)
    assert "floor 0.240 ms at 4.2 TB/s (2.92x)" in out.stdout
