"""Import a file of scripts/ as a module for the tests (scripts are not part of the package)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Iterator
from types import ModuleType

from tests._helpers import REPO

SCRIPTS = REPO / "scripts"


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` imported as module ``name``, registered in ``sys.modules`` while in use
    (dataclasses resolve a module's annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
