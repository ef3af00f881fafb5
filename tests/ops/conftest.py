"""Every op test leaves gspn2's process options (gspn2.ops.options) as it found them."""

from __future__ import annotations

import pytest

from gspn2.ops import options


@pytest.fixture(autouse=True)
def _restore_options():
    saved = options.current()
    yield
    options.set_options(**{f: getattr(saved, f) for f in saved.__dataclass_fields__})
