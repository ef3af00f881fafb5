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
