"""pytest plugin (``-p timm_conformance_plugin``) that narrows timm's own ``tests/test_models.py`` to
visattn's models, leaving its assertions untouched.

timm's test file builds its parametrised model lists at import time from ``timm.list_models`` and
``timm.list_pretrained``; this plugin is imported first, registers visattn's models (``import
visattn``) and wraps both functions so they return only names matching ``VISATTN_TIMM_MODELS``
(fnmatch pattern, default ``visattn_*``). timm sorts its models into families by name patterns
(``NON_STD_FILTERS`` holds ``vit_*``: ViTs have no spatial ``forward_features`` and are checked by
``test_model_default_cfgs_non_std``); a visattn model answers those patterns also under its name
without the ``visattn_`` prefix, so ``visattn_vit_*`` is tested as timm tests its ``vit_*``.
Tests with hard-coded timm model names are deselected with ``-k visattn`` by the runner
(tests/test_timm_conformance.py). Not collected by our own suite.
"""

import fnmatch
import os
from collections.abc import Iterable

import timm
import timm.models

import visattn  # noqa: F401  (registers visattn_* with timm)

PATTERN = os.environ.get("VISATTN_TIMM_MODELS", "visattn_*")
_list_models = timm.list_models


def _patterns(value: str | Iterable[str]) -> list[str]:
    return [p for p in ([value] if isinstance(value, str) else list(value)) if p]


def _matches(name: str, patterns: list[str]) -> bool:
    family_name = name.removeprefix("visattn_")
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(family_name, p) for p in patterns)


def list_models(filter="", module="", pretrained=False, exclude_filters="", name_matches_cfg=False,
                include_tags=None):
    names = _list_models(module=module, pretrained=pretrained, name_matches_cfg=name_matches_cfg,
                         include_tags=include_tags)
    names = [n for n in names if fnmatch.fnmatch(n, PATTERN)]
    include, exclude = _patterns(filter), _patterns(exclude_filters)
    return [n for n in names if (not include or _matches(n, include)) and not _matches(n, exclude)]


def list_pretrained(filter="", exclude_filters=""):
    return list_models(filter, pretrained=True, exclude_filters=exclude_filters, include_tags=True)


for _module in (timm, timm.models):
    _module.list_models = list_models
    _module.list_pretrained = list_pretrained
