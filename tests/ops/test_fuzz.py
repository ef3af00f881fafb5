"""scripts/fuzz_op.py: its cases on a small fixed subset (in this process), its classifier, and its process
runner (a real case in a child process; a child that aborts or hangs is reported as CRASH / HANG)."""

from __future__ import annotations

import faulthandler
import os
import time

import pytest

from tests.scripts._load import script_module

# One or two of each kind: bad chunk on both entries, sparse, mkldnn, nested and jagged tensors, integer and
# mixed dtypes, broadcastable gates on the raw op, empty dims, the backward ops' own arguments, the kernel
# argument's type, a non-finite logit outside the line, a valid half-precision call, a raw op whose bad
# argument torch's schema refuses, and a bad chunk under torch.compile(fullgraph=True).
SUBSET = {
    "prop/chunk-2^64": "OK-CLEAR",
    "rawprop/chunk-neg1": "OK-CLEAR",
    "prop/x-nested": "OK-CLEAR",
    "rawprop/x-nested-jagged": "OK-CLEAR",
    "rawprop/all-int64": "OK-CLEAR",
    "prop/kernel-int": "OK-CLEAR",
    "rawprop/outside-line-nan-5x6": "OK-RESULT",
    "prop/dtype-bfloat16": "OK-RESULT",
    "rawbwd/grad_h-shape": "OK-CLEAR",
    "rawdw/empty-C": "OK-CLEAR",
    "dw/x-int64": "OK-CLEAR",
    "dw/add_input-str": "OK-CLEAR",
    "rawdwbwd/grad_y-shape": "OK-CLEAR",
    "rawprop/chunk-2^63": "OK-SCHEMA",
    "rawprop/bcast-gates-B1": "OK-CLEAR",
    "rawprop/x-f32-lam-f64": "OK-CLEAR",
    "rawprop/x-mkldnn": "OK-CLEAR",
    "prop/x-sparse": "OK-CLEAR",
    "compile/prop-chunk-neg1": "OK-CLEAR",
}


@pytest.fixture(scope="module")
def fuzz():
    with script_module("fuzz_op") as module:
        yield module


@pytest.fixture(scope="module")
def cases(fuzz):
    return {c.name: c for c in fuzz.build_cases()}


def test_the_fuzz_has_a_few_hundred_cases_with_every_target(cases):
    assert len(cases) >= 300
    prefixes = {name.split("/")[0] for name in cases}
    assert {"prop", "rawprop", "rawbwd", "dw", "rawdw", "rawdwbwd", "compile", "options"} <= prefixes


@pytest.mark.parametrize("name", sorted(SUBSET))
def test_subset_case_is_not_flagged(fuzz, cases, name):
    case = cases[name]
    label, why = fuzz.classify(case, fuzz.run_case(case, "cpu"))
    assert label == SUBSET[name], why


def _case(fuzz, expect="error", names=("chunk",), raw=False):
    return fuzz.Case("synthetic", lambda dev: None, expect, names, raw=raw)


def test_classifier_flags_every_bad_outcome(fuzz):
    err = _case(fuzz)
    classify = fuzz.classify
    assert classify(err, {"status": "raised", "type": "ValueError", "message": "`chunk` must be >= 1"})[0] == "OK-CLEAR"
    assert classify(err, {"status": "raised", "type": "RuntimeError", "message": "`chunk` must be >= 1"})[0] == "CRYPTIC"
    assert classify(err, {"status": "raised", "type": "ValueError", "message": "bad value"})[0] == "CRYPTIC"
    schema = {"status": "raised", "type": "RuntimeError", "message": "Expected int for argument 'chunk'"}
    assert classify(err, schema)[0] == "CRYPTIC"  # public entries must check types themselves
    assert classify(_case(fuzz, raw=True), schema)[0] == "OK-SCHEMA"
    assert classify(err, {"status": "returned", "result": "tensor"})[0] == "SILENT"
    assert classify(err, {"status": "ok"})[0] == "SILENT"
    valid = _case(fuzz, expect="result")
    assert classify(valid, {"status": "ok"})[0] == "OK-RESULT"
    assert classify(valid, {"status": "wrong", "message": "max abs error"})[0] == "WRONG"
    assert classify(valid, {"status": "raised", "type": "ValueError", "message": "`chunk`"})[0] == "WRONG"
    assert classify(valid, {"status": "crash", "exitcode": -6})[0] == "CRASH"
    assert classify(valid, {"status": "hang", "timeout": 1})[0] == "HANG"
    comp = fuzz.Case("synthetic", lambda dev: None, "error", ("chunk",), compile=True)
    eager = {"status": "raised", "type": "ValueError", "message": "gspn2: `chunk` must be >= 1"}
    hidden = {"status": "raised", "type": "Unsupported", "message": "Observed exception", "eager": eager}
    shown = {"status": "raised", "type": "Unsupported", "message": "... ValueError('gspn2: `chunk` must be >= 1')",
             "eager": eager}
    assert classify(comp, hidden)[0] == "CRYPTIC"
    assert classify(comp, shown)[0] == "OK-CLEAR"


def test_a_case_in_a_child_process(fuzz, cases):
    names = list(cases)
    i = names.index("rawprop/x-nested")
    results = fuzz.run_all(list(cases.values()), [i], "cpu", jobs=1, timeout=120, start="fork")
    assert fuzz.classify(cases["rawprop/x-nested"], results[i])[0] == "OK-CLEAR"


def test_child_abort_and_hang_are_caught(fuzz):
    def abort(dev):
        faulthandler.disable()  # pytest's handler would print the child's traceback into the suite's log
        os.abort()

    def hang(dev):
        time.sleep(60)

    crash = fuzz.Case("aborts", abort, "error", ("x",))
    stuck = fuzz.Case("hangs", hang, "error", ("x",))
    t0 = time.monotonic()
    results = fuzz.run_all([crash, stuck], [0, 1], "cpu", jobs=2, timeout=3, start="fork")
    assert fuzz.classify(crash, results[0])[0] == "CRASH"
    assert fuzz.classify(stuck, results[1])[0] == "HANG"
    assert time.monotonic() - t0 < 30
