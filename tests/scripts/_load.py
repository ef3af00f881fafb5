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


def jpeg_folder(tmp_path_factory, name: str, classes: int, train_per_class: int, val_per_class: int = 1):
    """A small ImageNet-like JPEG folder (``train/`` and ``val/``) written by scripts/make_image_folder.py
    under a fresh temporary directory ``name``; returns its root."""
    root = tmp_path_factory.mktemp(name) / "fake"
    with script_module("make_image_folder") as make:
        make.make_image_folder(
            root, classes=classes, train_per_class=train_per_class, val_per_class=val_per_class
        )
    return root
