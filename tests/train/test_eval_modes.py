"""How eval.py runs the model: the memory format (channels_last on CUDA, contiguous on the CPU by default),
``compile=true`` with the trainer's ``compile_mode`` choices, and what the log and the results JSON say."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from gspn2.train.config import ConfigError, check_eval_config
from gspn2.train.evaluate import batch_sizes, resolve_channels_last
from tests.train._helpers import CONFIGS, compose_cfg

# gspn2_micro by name (random weights, seeded per run); 40 digits in batches of 16, 16 and a partial 8
MICRO = [
    "model_name=gspn2_micro",
    "num_classes=10",
    "img_size=32",
    "data.val_subset=40",
    "data.batch_size=16",
    "data.num_workers=0",
]


def _cfg(overrides):
    return compose_cfg(overrides, config_name="eval", config_dir=CONFIGS / "eval")


def _run(eval_script, digits_root, out, *extra):
    torch.manual_seed(0)  # the same random weights in every run
    assert eval_script.run_eval(_cfg([*MICRO, f"data.root={digits_root}", f"out={out}", *extra])) == out
    return json.loads(out.read_text())


def _record_evaluate(eval_script, monkeypatch):
    """Wrap eval.py's evaluate(): what it was given (channels_last, the memory format of the conv weights)."""
    seen = {}
    real = eval_script.evaluate

    def recording(model, loader, info, precision, channels_last):
        convs = [p for p in model.parameters() if p.dim() == 4]
        seen["channels_last"] = channels_last
        seen["weights"] = (
            all(p.is_contiguous(memory_format=torch.channels_last) for p in convs),
            all(p.is_contiguous() for p in convs),
        )
        return real(model, loader, info, precision, channels_last)

    monkeypatch.setattr(eval_script, "evaluate", recording)
    return seen


def test_channels_last_default_is_on_for_cuda_only():
    assert _cfg(["model_name=resnet18"]).channels_last is None  # the schema's default: auto
    assert resolve_channels_last(None, torch.device("cpu")) is False
    assert resolve_channels_last(None, torch.device("cuda", 0)) is True
    assert resolve_channels_last(True, torch.device("cpu")) is True
    assert resolve_channels_last(False, torch.device("cuda")) is False


def test_batch_sizes_are_the_full_and_the_partial_batch():
    loader = torch.utils.data.DataLoader(list(range(40)), batch_size=16)
    assert batch_sizes(loader) == [16, 8] == sorted({len(b) for b in loader}, reverse=True)
    assert batch_sizes(torch.utils.data.DataLoader(list(range(32)), batch_size=16)) == [16]
    assert batch_sizes(torch.utils.data.DataLoader(list(range(5)), batch_size=16)) == [5]


def test_cpu_default_is_eager_and_contiguous_and_recorded(
    eval_script, digits_root, tmp_path, monkeypatch, capsys
):
    seen = _record_evaluate(eval_script, monkeypatch)
    ev = _run(eval_script, digits_root, tmp_path / "default.json")
    assert seen == {"channels_last": False, "weights": (False, True)}  # (all channels_last, all contiguous)
    assert (ev["channels_last"], ev["compile_mode"], ev["compile_s"]) == (False, None, None)
    assert "model runs eager, contiguous" in capsys.readouterr().out

    # channels_last=true on the CPU: the override reaches model and inputs, the metrics stay
    ev_cl = _run(eval_script, digits_root, tmp_path / "cl.json", "channels_last=true")
    assert seen == {"channels_last": True, "weights": (True, False)}
    assert ev_cl["channels_last"] is True and "model runs eager, channels_last" in capsys.readouterr().out
    assert (ev_cl["top1"], ev_cl["top5"], ev_cl["images"]) == (ev["top1"], ev["top5"], 40)
    assert ev_cl["loss"] == pytest.approx(ev["loss"], rel=1e-5)


@pytest.mark.parametrize("extra", [["compile=true", "compile_mode=fast"], ["compile_mode=reduce_overhead"]])
def test_an_unknown_compile_mode_is_refused_before_anything_is_written(
    eval_script, digits_root, tmp_path, extra
):
    out = tmp_path / "out" / "eval.json"
    with pytest.raises(ConfigError, match=r"^compile_mode must be one of default \| reduce-overhead \| "):
        eval_script.run_eval(_cfg([*MICRO, f"data.root={digits_root}", f"out={out}", *extra]))
    assert not (tmp_path / "out").exists()
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        check_eval_config(_cfg(["model_name=resnet18", "compile=true", f"compile_mode={mode}"]))


def _compiled_eval(digits_root, out, record):
    """eval.py with ``compile=true compile_mode=reduce-overhead`` under a recording torch.compile; writes
    what it saw to ``record`` (JSON). Run in a spawned interpreter: after TorchDynamo has run in a process,
    a backward there leaves autograd unusable in its forked children, which other trainer tests fork."""
    import contextlib
    import io

    from tests.train._helpers import load_script

    eval_script = load_script("eval")
    real_compile = torch.compile
    modes, graphs, seen = [], [], {}

    def counting_backend(gm, example_inputs):  # TorchDynamo's graphs, run as they are
        graphs.append(gm)
        return gm.forward

    def recording_compile(model, mode=None, **kwargs):
        modes.append([mode, sorted(kwargs)])  # no dynamic=...: torch's default, as the trainer compiles
        return real_compile(model, backend=counting_backend)

    real_evaluate = eval_script.evaluate

    def evaluate_counting(*args, **kwargs):
        seen["graphs_before_evaluate"] = len(graphs)
        return real_evaluate(*args, **kwargs)

    torch.compile = recording_compile
    eval_script.evaluate = evaluate_counting
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        ev = _run(eval_script, Path(digits_root), Path(out), "compile=true", "compile_mode=reduce-overhead")
    seen.update(modes=modes, graphs=len(graphs), ev=ev, log=stdout.getvalue())
    record.write_text(json.dumps(seen))


def test_compiled_evaluation_is_the_eager_one_and_compiles_outside_the_timing(
    eval_script, digits_root, tmp_path
):
    """``compile=true`` goes through torch.compile with the mode asked for; the compiled model gives the
    eager metrics, the last partial batch included, and every graph is compiled by the warm-up, none inside
    the timed evaluation. TorchDynamo runs for real (its guards on the input's shape decide which graph a
    batch runs, and a batch of another size recompiles); Inductor's code generation is replaced by the
    eager backend, as it takes over a minute per graph on a 2-core CPU."""
    eager = _run(eval_script, digits_root, tmp_path / "eager.json")
    record = tmp_path / "record.json"
    child = multiprocessing.get_context("spawn").Process(
        target=_compiled_eval, args=(str(digits_root), str(tmp_path / "compiled.json"), record)
    )
    child.start()
    child.join(300)
    assert child.exitcode == 0, f"the compiled evaluation exited with {child.exitcode} (its stderr is above)"
    seen = json.loads(record.read_text())
    ev = seen["ev"]
    assert seen["modes"] == [["reduce-overhead", []]]
    # one graph for the batches of 16, one for the partial batch of 8, both compiled before the timed loop
    assert (seen["graphs"], seen["graphs_before_evaluate"]) == (2, 2)
    assert (ev["top1"], ev["top5"], ev["images"]) == (eager["top1"], eager["top5"], 40)
    assert ev["loss"] == pytest.approx(eager["loss"], rel=1e-6)
    assert (ev["channels_last"], ev["compile_mode"]) == (False, "reduce-overhead")
    assert ev["compile_s"] > 0
    assert "model runs torch.compile(mode=reduce-overhead), contiguous" in seen["log"]
