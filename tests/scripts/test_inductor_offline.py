"""scripts/inductor_offline.py: what torch.compile builds for an H200, on this machine without a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gspn2.ops import _cuda
from tests._helpers import REPO
from tests.scripts._load import script_module

SCRIPT = REPO / "scripts" / "inductor_offline.py"


def _toolchain() -> str:
    """Why the tool cannot run here ('' when it can): it needs a CUDA build of torch, Triton, C and C++
    compilers, the CUDA runtime's headers and the built extension (all present on this project's machines
    and CI)."""
    if torch.version.cuda is None:
        return "needs a CUDA build of torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs Triton"
    if not (shutil.which("c++") or shutil.which("g++")) or not (shutil.which("cc") or shutil.which("gcc")):
        return "needs C and C++ compilers"
    if not _cuda.extension_available():  # without it the graphs hold cuDNN's convolutions, not gspn2's ops
        return "needs gspn2's CUDA extension built"
    with script_module("inductor_offline") as tool:
        try:
            tool._runtime_headers(torch.version.cuda)
        except RuntimeError as e:
            return str(e)
    return ""


_MISSING = _toolchain()
needs_toolchain = pytest.mark.skipif(bool(_MISSING), reason=_MISSING or "-")


def _run(tmp_path, *args: str, **env: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPT), "--models", "gspn2_micro", "--resolution", "32", "--batch", "2",
           "--json", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env), timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gspn2_micro" in done.stdout
    (result,) = json.loads(out.read_text())["results"]
    return result


def _kernel_def(var: str, gb: float) -> str:
    """One kernel definition of a generated wrapper, as Inductor writes it (metadata abridged)."""
    meta = f"@triton_heuristics.pointwise(inductor_meta={{'kernel_num_gb': {gb}, 'kernel_name': '{var}'}})"
    return f"{var} = async_compile.triton('{var}', '''\n{meta}\n''', device_str='cuda')"


def test_wrapper_calls_counts_each_launch_with_its_kernels_bytes():
    code = "\n".join([
        _kernel_def("triton_poi_a_0", 0.5),
        _kernel_def("triton_per_b_1", 2e-3),
        "class Runner:",
        "    def call(self, args):",
        "        triton_poi_a_0.run(buf0, stream=s)",
        "        extern_kernels.mm(buf0, w, out=buf1)",
        "        triton_poi_a_0.run(buf1, stream=s)",
        "        triton_per_b_1.run(buf1, stream=s)",
        "        torch.ops.gspn2.propagate.default(buf1, buf2, buf3, None, 'auto')",
        "        # buf9 = ws[0:8].view(2, 4).sum(dim=0)  (a comment: not a call)",
        "        buf4 = ws[0 * (2) * (4) : (0 + 1) * (2) * (4)].view(2, 4).sum(dim=0).view([4])",
    ])
    with script_module("inductor_offline") as tool:
        calls = tool.wrapper_calls(code)
    assert calls["kernels"] == {"triton_poi_a_0": {"launches": 2, "gb": 1.0},
                                "triton_per_b_1": {"launches": 1, "gb": 2e-3}}
    assert calls["other"] == {"extern_kernels.mm": 1, "torch.ops.gspn2.propagate": 1, "aten.sum (wrapper)": 1}
    assert calls["addmm_matrix_gb"] == 0.0


def test_addmm_with_a_matrix_input_counts_atens_copy():
    """``addmm`` with a bias vector costs nothing beyond the GEMM; with a matrix input (a declared buffer, a
    view of one, a reused one, or a view of a custom op's output whose dtype the call's output gives) ATen
    copies it into the output and reads it back: three passes over it."""
    code = "\n".join([
        "class Runner:",
        "  def call(self, args):",
        "    buf0 = empty_strided_cuda((64, 32), (32, 1), torch.bfloat16)",
        "    buf1 = empty_strided_cuda((32,), (1,), torch.float32)",
        "    extern_kernels.addmm(buf1, a, b, alpha=1, beta=1, out=buf2)",
        "    extern_kernels.addmm(buf0, a, b, alpha=1, beta=1, out=buf3)",
        "    buf4 = buf0; del buf0  # reuse",
        "    extern_kernels.addmm(buf4, a, b, alpha=1, beta=1, out=buf5)",
        "    buf6 = buf9[0]",
        "    buf7 = reinterpret_tensor(buf6, (16, 8), (8, 1), 0); del buf6  # reuse",
        "    buf8 = empty_strided_cuda((16, 8), (8, 1), torch.float32)",
        "    extern_kernels.addmm(buf7, c, d, alpha=1, beta=1, out=buf8)",
        "    extern_kernels.addmm(unknown, c, d, alpha=1, beta=1, out=buf8)",
    ])
    with script_module("inductor_offline") as tool:
        calls = tool.wrapper_calls(code)
    assert calls["other"]["extern_kernels.addmm"] == 5
    assert calls["other"]["extern_kernels.addmm with a matrix input"] == 3
    assert calls["addmm_matrix_gb"] == pytest.approx(3 * (2 * 64 * 32 * 2 + 16 * 8 * 4) / 1e9)


def test_bad_arguments_are_refused_before_anything_is_built(capsys):
    with script_module("inductor_offline") as tool:
        for argv, message in (
            (["--batch", "0"], "--batch must be positive"),
            (["--tbps", "0"], "--tbps must be"),
            (["--child-json", "x.json"], "--child-json is internal"),
            (["--inductor", "no_such_setting=1"], "has no 'no_such_setting'"),
            (["--inductor", "combo_kernels"], "--inductor takes KEY=VALUE"),
            (["--inductor", "triton.cudagraphs=maybe"], "is not a Python literal"),
        ):
            with pytest.raises(SystemExit):
                tool.main(argv)
            assert message in capsys.readouterr().err


@needs_toolchain
def test_training_compiles_both_graphs_with_the_ops_and_the_partitioners_saved_tensors(tmp_path):
    keep = _run(tmp_path)
    kinds = [g["kind"] for g in keep["graphs"]]
    assert kinds.count("forward") == 1 and kinds.count("backward") == 1
    forward, backward = (next(g for g in keep["graphs"] if g["kind"] == k) for k in ("forward", "backward"))
    assert forward["other"]["torch.ops.gspn2.propagate"] == 5  # one mixer per block, depths (1, 1, 2, 1)
    assert backward["other"]["torch.ops.gspn2.propagate_backward"] == 5
    assert forward["other"]["torch.ops.gspn2.depthwise_conv2d"] == 15  # two 3x3 units and a 7x7 per block
    assert sum(k["launches"] for k in backward["kernels"].values()) > 0
    assert all(k["gb"] > 0 for g in keep["graphs"] for k in g["kernels"].values())
    assert forward["saved_bytes"] > 0 and backward["saved_bytes"] == 0
    # The partitioner keeps less when the model marks its GEMM inputs for recomputation.
    recompute = _run(tmp_path, GSPN2_RECOMPUTE="all")
    assert 0 < recompute["summary"]["saved_mib"] < keep["summary"]["saved_mib"]


@needs_toolchain
def test_inference_compiles_one_graph_that_keeps_nothing(tmp_path):
    result = _run(tmp_path, "--task", "infer")
    assert [g["kind"] for g in result["graphs"]] == ["forward"]
    assert result["summary"]["saved_mib"] == 0 and result["summary"]["backward_launches"] == 0
    assert "torch.ops.gspn2.propagate" in result["graphs"][0]["other"]
    # Inductor settings reach the compilation: combo kernels launch the same work in fewer kernels.
    combo = _run(tmp_path, "--task", "infer", "--inductor", "combo_kernels=True")
    assert combo["summary"]["forward_launches"] < result["summary"]["forward_launches"]
