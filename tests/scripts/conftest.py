"""Fixtures of the script tests."""

from __future__ import annotations

import pytest

from tests.scripts._load import script_module


@pytest.fixture(scope="module")
def bench(request):
    """The script named by the test module's ``SCRIPT`` (e.g. ``"bench_op"``), imported once per module."""
    with script_module(request.module.SCRIPT) as module:
        yield module
