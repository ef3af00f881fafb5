"""The CPU-testable parts of scripts/bench_fast_path.py (the comparison and timing need a GPU)."""

from __future__ import annotations

import torch

SCRIPT = "bench_fast_path"  # the `bench` fixture (tests/scripts/conftest.py) imports it


def test_errors_are_relative_to_the_reference(bench):
    t = torch.tensor
    ref = (t([2.0, -4.0]), t([1.0]), {"a": t([10.0]), "b": t([1.0])})
    got = (t([2.0, -3.0]), t([1.0]), {"a": t([10.0]), "b": t([1.5])})
    errs = bench._errors(got, ref)
    assert errs["logits"] == 0.25 and errs["input_grad"] == 0.0
    assert errs["worst_param"] == "b" and errs["worst_param_grad"] == 0.5

