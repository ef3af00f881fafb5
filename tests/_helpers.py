"""Helpers shared by every test folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (a script, not part of the package) imported as a module called ``name``.
    The module is not registered in ``sys.modules``; :func:`tests.scripts._load.script_module` does that
    where a script needs it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
