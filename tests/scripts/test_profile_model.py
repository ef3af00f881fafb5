"""scripts/profile_model.py needs a GPU; on CPU it must refuse clearly (not crash inside timm or CUDA)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_model.py"


def _run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    runpy.run_path(str(SCRIPT), run_name="__main__")


def test_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _run(monkeypatch)


def test_unknown_model_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--model: unknown timm model 'no_such_net'"):
        _run(monkeypatch, "--model", "no_such_net")


def test_operator_table_counts_each_kernel_once():
    """A kernel appears as a device event and in its launching operator's self time: the total takes the
    device events, the table the operators, so nothing is counted twice (the earlier table did)."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    module = runpy.run_path(str(SCRIPT))  # not __main__: defines the functions only
    events = [
        E(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=30.0, count=2),
        E(key="aten::sum", device_type=DeviceType.CPU, self_device_time_total=10.0, count=1),
        E(key="aten::view", device_type=DeviceType.CPU, self_device_time_total=0.0, count=5),
        E(key="gemm_kernel", device_type=DeviceType.CUDA, self_device_time_total=30.0, count=2),
        E(key="reduce_kernel", device_type=DeviceType.CUDA, self_device_time_total=10.0, count=1),
    ]
    total, rows = module["operator_table"](events)
    assert total == 40.0
    assert [e.key for e in rows] == ["aten::mm", "aten::sum"]


def test_print_stacks_lists_one_operator_by_shape_largest_first(capsys):
    """--stacks OP: the groups of OP's calls (by input shape and frames) with CUDA ms and calls per step."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    module = runpy.run_path(str(SCRIPT))
    groups = [
        E(key="aten::sum", device_type=DeviceType.CPU, self_device_time_total=2000.0, count=4,
          input_shapes=[[16, 8], [], [], []], stack=["a.py(1): f", "b.py(2): g"]),
        E(key="aten::sum", device_type=DeviceType.CPU, self_device_time_total=6000.0, count=2,
          input_shapes=[[32, 8], [], [], []], stack=[]),
        E(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=9000.0, count=2,
          input_shapes=[[4, 4], [4, 4]], stack=[]),
        E(key="aten::sum", device_type=DeviceType.CUDA, self_device_time_total=8000.0, count=6,
          input_shapes=[], stack=[]),
    ]
    prof = E(key_averages=lambda **kw: groups)
    module["print_stacks"](prof, "aten::sum", steps=2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "aten::sum: 2 groups"
    assert lines[1].split()[:4] == ["3.000", "ms/step", "1.0", "calls/step"] and "[32, 8]" in lines[1]
    assert lines[2].split()[:4] == ["1.000", "ms/step", "2.0", "calls/step"] and "[16, 8]" in lines[2]
    assert lines[3].strip() == "a.py(1): f" and lines[4].strip() == "b.py(2): g"
