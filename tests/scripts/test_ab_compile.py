"""scripts/ab_compile.py: its variants' syntax, its refusals, and one run of the whole protocol on the CPU
(eager, gspn2_micro at 32^2): processes started in parallel, timed in turn, a failing variant reported
while the others are still timed."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts._load import script_module


def test_variant_syntax():
    with script_module("ab_compile") as module:
        assert module.parse_variant("base:") == ("base", None, {})
        assert module.parse_variant("peer@swin_tiny_patch4_window7_224:A=1,B=x") == (
            "peer", "swin_tiny_patch4_window7_224", {"A": "1", "B": "x"})
        assert module.split_settings({"inductor.triton.x": "128", "inductor.y": "abc", "GSPN2_MLP": "fused"}) == (
            {"GSPN2_MLP": "fused"}, {"triton.x": 128, "y": "abc"})
        for bad in ("base", ":A=1", "v:A"):
            with pytest.raises(SystemExit, match="--variants"):
                module.parse_variant(bad)


def test_refusals(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [
        (["--variants", "a:"], "needs a CUDA GPU"),
        (["--variants", "a:", "a:"], "names must differ"),
        (["--variants", "a:", "--rounds", "0"], "--rounds"),
        (["--variants", "a@no_such_net:", "--device", "cpu"], "unknown timm model 'no_such_net'"),
    ]
    for argv, message in cases:
        monkeypatch.setattr("sys.argv", ["ab_compile.py", *argv])
        with script_module("ab_compile") as module, pytest.raises(SystemExit, match=message):
            module.main()


def test_cpu_run_times_every_variant_and_reports_a_failing_one(monkeypatch, tmp_path, capsys):
    out = tmp_path / "ab.json"
    monkeypatch.setattr("sys.argv", [
        "ab_compile.py", "--device", "cpu", "--mode", "eager", "--model", "gspn2_micro", "--resolution", "32",
        "--batch", "2", "--warmup", "0", "--iters", "1", "--rounds", "2", "--json", str(out), "--variants",
        "base:", "gemm:GSPN2_SMALL_GEMM=gemm,inductor.triton.mix_order_reduction_split_size=64",
        "bad:inductor.no_such_setting=1",
    ])
    with script_module("ab_compile") as module:
        assert module.main() == 0
    table = capsys.readouterr().out
    assert "| bad | gspn2_micro | inductor.no_such_setting=1 | failed:" in table
    results = json.loads(out.read_text())["results"]
    for name in ("base", "gemm"):
        assert len(results[name]["ms"]) == 2 and all(ms > 0 for ms in results[name]["ms"])
        assert f"| {name} | gspn2_micro |" in table
    assert "error" in results["bad"] and not results["bad"]["ms"]
