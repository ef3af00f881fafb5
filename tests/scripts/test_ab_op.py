"""scripts/ab_op.py: the comparison of two builds' files (CPU) and the refusal of `run` without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.scripts._load import script_module


def _file(path, rows, outputs, launch=None):
    torch.save({"rows": rows, "outputs": outputs, "launch_us": launch, "device": "test"}, path)
    return str(path)


def test_compare_reports_times_ratios_and_bitwise_equality(tmp_path):
    t = torch.arange(6.0)
    a = _file(tmp_path / "a.pt", {"s1": (10.0, 20.0), "s2": (4.0, 8.0)}, {"s1": [t, t], "s2": [t]}, launch=0.7)
    b = _file(tmp_path / "b.pt", {"s1": (5.0, 30.0), "s2": (4.0, 8.0)},
              {"s1": [t.clone(), t.clone()], "s2": [t + torch.tensor(1e-7)]}, launch=0.8)
    with script_module("ab_op") as ab:
        table = ab.compare(a, b).splitlines()
    assert table[0].startswith("one-element copy kernel") and "0.70 / 0.80" in table[0]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in table if r.startswith("| s")}
    assert rows["s1"] == ["10.00", "5.00", "0.50", "20.00", "30.00", "1.50", "yes"]
    assert rows["s2"][-1] == "NO"  # one ulp off is not the same bits


def test_compare_exits_nonzero_when_outputs_differ(tmp_path, monkeypatch, capsys):
    t = torch.zeros(3)
    a = _file(tmp_path / "a.pt", {"s": (1.0, 1.0)}, {"s": [t]})
    b = _file(tmp_path / "b.pt", {"s": (1.0, 1.0)}, {"s": [t + 1]})
    with script_module("ab_op") as ab, pytest.raises(SystemExit) as e:
        ab.main(["compare", a, b])
    assert e.value.code == 1 and "| NO |" in capsys.readouterr().out


def test_run_refuses_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with script_module("ab_op") as ab, pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["run", str(tmp_path / "x.pt")])
