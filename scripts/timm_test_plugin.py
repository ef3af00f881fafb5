"""pytest plugin that runs timm's own model tests (a timm source checkout's ``tests/test_models.py``) on gspn2.

Loaded with ``-p timm_test_plugin`` (``scripts/run_timm_tests.sh`` does this), before timm's test module is
collected, it

* imports :mod:`gspn2`, which registers the ``gspn2_*`` models with timm, so the registry-driven
  parametrisations of timm's tests include them;
* adds gspn2's model module to the module filter of the tests that timm runs only for the families listed in
  its ``FEAT_INTER_FILTERS`` (``forward_intermediates`` and the ``feature_cls='getter'`` features wrapper):
  gspn2 implements both, and timm lists families by hand there. Every other selection is timm's unchanged.
"""

from __future__ import annotations

import timm
import timm.models

import gspn2  # noqa: F401  (registers the gspn2_* models)

#: timm records a model's module as the last component of its builder's ``__module__``.
GSPN2_MODULE = gspn2.models.gspn2.__name__.rsplit(".", 1)[-1]

_list_models = timm.list_models


def _list_models_with_gspn2(*args, **kwargs):
    """``timm.list_models`` that also selects gspn2's module whenever a list of modules is asked for."""
    module = kwargs.get("module", args[1] if len(args) > 1 else "")
    if isinstance(module, (list, tuple)) and module and GSPN2_MODULE not in module:
        module = [*module, GSPN2_MODULE]
        if len(args) > 1:
            args = (args[0], module, *args[2:])
        else:
            kwargs["module"] = module
    return _list_models(*args, **kwargs)


# timm's test module does ``from timm import list_models`` at import, after this plugin has run.
timm.list_models = _list_models_with_gspn2
