"""MAC/parameter counting: fvcore with our op handle, the paper's sizes and scripts/count.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.counting import (
    MAC_TOLERANCE,
    PAPER_COUNTS,
    PARAM_TOLERANCE,
    PROPAGATE_MACS_PER_ELEMENT,
    count_model,
)
from tests._helpers import REPO, load_module
from tests.models._models import BIG_MODELS
from tests.models._reference import reference

# fvcore does not count elementwise ops and views (by design); anything else unsupported is a bug.
ZERO_MAC_OPS = {
    "aten::add", "aten::addcmul", "aten::mul", "aten::gelu", "aten::silu", "aten::sigmoid", "aten::unflatten"
}


def _expected_propagate_macs(model: torch.nn.Module, H: int, W: int) -> int:
    """Independent of fvcore: 4 MACs x (B=1, 4 directions, P, h, w) output elements for every mixer."""
    total = 0
    h, w = (H + 1) // 2, (W + 1) // 2  # stem conv 1 (3x3, stride 2, pad 1)
    h, w = (h + 1) // 2, (w + 1) // 2  # stem conv 2
    for i, stage in enumerate(model.stages):
        if i > 0:
            h, w = h // 2, w // 2  # 2x2 stride-2 downsampling
        for block in stage.blocks:
            total += PROPAGATE_MACS_PER_ELEMENT * 4 * block.mixer.proxy_dim * h * w
    return total


def test_count_micro_small_input():
    model = timm.create_model("gspn2_micro", num_classes=10).train()
    c = count_model(model, input_size=(3, 32, 32))
    assert model.training  # mode restored
    assert c.params == sum(p.numel() for p in model.parameters())
    assert c.by_module[""] == c.macs > 0
    assert c.propagate_macs == _expected_propagate_macs(model, 32, 32) > 0
    assert set(c.unsupported_ops) <= ZERO_MAC_OPS, c.unsupported_ops
    rows = dict((label, (p, m)) for label, p, m in c.grouped())
    assert rows["other"] == (0, 0)  # the component rules cover the whole model exactly once
    assert rows["mixers"][1] > c.propagate_macs
    table = c.table(max_depth=1)
    assert "stages" in table and "not counted by fvcore" in table
    # MACs scale with batch size, params do not.
    c2 = count_model(model, input_size=(3, 32, 32), batch_size=2)
    assert c2.macs == 2 * c.macs and c2.params == c.params


def test_count_equals_the_oracles():
    """The GEMM 1x1 convolutions and the fused depthwise op count as the convolutions they stand for: the
    model's MACs, per component too, are those of its module-by-module oracle (nn.Conv2d, timm's layers).
    (The depthwise op takes the conv's weight, so fvcore books its MACs on the LPU or mixer calling it.)"""
    model = timm.create_model("gspn2_micro", num_classes=10)
    c, ref = count_model(model, (3, 64, 64)), count_model(reference(model), (3, 64, 64))
    assert c.macs == ref.macs and c.params == ref.params
    assert c.grouped() == ref.grouped()
    assert c.by_operator["depthwise_conv2d"] > 0 and "depthwise_conv2d" not in ref.by_operator
    assert c.by_operator["linear"] > ref.by_operator["linear"]  # the 1x1 convolutions (and the head, in both)


def test_count_non_square():
    model = timm.create_model("gspn2_micro", num_classes=10)
    c = count_model(model, input_size=(3, 33, 47))
    assert c.propagate_macs == _expected_propagate_macs(model, 33, 47)


@pytest.mark.parametrize("bad", [(3, 32), (3, 0, 32), (3.0, 32, 32)])
def test_count_bad_input_size(bad):
    with pytest.raises(ValueError, match="input_size"):
        count_model(timm.create_model("gspn2_micro"), input_size=bad)


@pytest.mark.parametrize("name", BIG_MODELS)
def test_paper_counts_within_tolerance(name, default_models):
    model = default_models[name]
    c = count_model(model, input_size=(3, 224, 224))
    paper = PAPER_COUNTS[name]
    assert abs(c.params / paper.params - 1) <= PARAM_TOLERANCE, (name, c.params)
    assert abs(c.macs / paper.macs - 1) <= MAC_TOLERANCE, (name, c.macs)
    assert c.propagate_macs == _expected_propagate_macs(model, 224, 224)
    assert set(c.unsupported_ops) <= ZERO_MAC_OPS, c.unsupported_ops


def test_count_script_runs():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "count.py"), "--model", "gspn2_micro", "--img-size", "32", "--breakdown"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gspn2_micro" in proc.stdout and "32x32" in proc.stdout
    assert "mixers" in proc.stdout and "gspn2::propagate" in proc.stdout


def _load_count_script():
    return load_module(REPO / "scripts" / "count.py", "count_script")


def test_count_script_arguments(capsys):
    script = _load_count_script()
    assert script.parse_img_size("224x320") == (224, 320)
    assert script.parse_img_size("96") == (96, 96)
    with pytest.raises(SystemExit) as exc:  # --check only makes sense at the paper's size
        script.main(["--model", "gspn2_micro", "--img-size", "64", "--check"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        script.main(["--model", "gspn2_nope"])
    assert exc.value.code == 2
    assert script.main(["--model", "gspn2_micro", "--img-size", "40x56", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| gspn2_micro |" in out and "40x56" in out


def test_count_script_check_flags_out_of_tolerance(monkeypatch):
    """--check returns 1 when a model misses the paper figure (here: a paper figure it cannot meet)."""
    script = _load_count_script()
    monkeypatch.setitem(script.PAPER_COUNTS, "gspn2_micro", script.PAPER_COUNTS["gspn2_tiny"])
    assert script.main(["--model", "gspn2_micro", "--check"]) == 1


def test_import_and_run_without_fvcore():
    """fvcore is needed to count, not to build or run a model: with fvcore unimportable, ``import gspn2``
    works, a model runs, and count_model fails with fvcore's ImportError (not at import)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fvcore' or name.startswith('fvcore.'):\n"
        "            raise ImportError('fvcore blocked by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import timm, torch, gspn2\n"
        "from gspn2.counting import count_model, fvcore_available\n"
        "m = timm.create_model('gspn2_micro', num_classes=3).eval()\n"
        "assert m(torch.randn(1, 3, 32, 32)).shape == (1, 3)\n"
        "try:\n"
        "    count_model(m, (3, 32, 32))\n"
        "except ImportError as e:\n"
        "    print('count:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "count: fvcore blocked by the test" in proc.stdout
