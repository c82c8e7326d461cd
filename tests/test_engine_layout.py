"""The engine's rooms: shared machinery in ``visattn.engine``, one package per task
(``engine.cls``, ``engine.dit``); the old flat module names still import, with a warning."""

import importlib
import sys
import warnings
from pathlib import Path

import pytest
from test_metrics_imports import import_cycles, import_graph

import visattn.engine
from visattn.engine import MOVED

ENGINE = "visattn.engine"
TASKS = (f"{ENGINE}.cls", f"{ENGINE}.dit")


def task_of(module: str) -> str | None:
    return next((task for task in TASKS if module == task or module.startswith(task + ".")), None)


def test_shared_machinery_never_imports_a_task_and_tasks_never_import_each_other():
    graph = import_graph(ENGINE, Path(visattn.engine.__file__).parent)
    assert f"{ENGINE}.cls.trainer" in graph and f"{ENGINE}.launch" in graph[f"{ENGINE}.dit.trainer"]
    wrong = [(module, target) for module, targets in graph.items() for target in targets
             if task_of(target) is not None and task_of(target) != task_of(module)]
    assert not wrong, "imports across the engine's rooms: " + ", ".join(f"{m} -> {t}" for m, t in wrong)
    assert not import_cycles(graph)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_is_the_moved_module_and_says_where_it_went(old, monkeypatch):
    new = f"{ENGINE}.{MOVED[old]}"
    monkeypatch.delitem(sys.modules, f"{ENGINE}.{old}", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"{ENGINE}.{old}")
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new and module.__name__ == new
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_an_unknown_engine_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{ENGINE}.cls_nonexistent")
