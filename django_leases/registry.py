"""Tasks declared for each lease backend: the only code a worker will run.

A job row names its task by dotted path, but that path is only looked up here, never
imported on its own say-so: a row that names anything else ends dead. The modules imported
to find the declarations are each installed app's ``tasks`` module and the modules a
backend's ``OPTIONS["TASK_MODULES"]`` lists: code the project chose, not the row.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.utils.module_loading import autodiscover_modules

if TYPE_CHECKING:
    from django.tasks import Task

_declared: dict[str, dict[str, Task[..., Any]]] = {}
_lock = threading.Lock()


def declare(alias: str, task: Task[..., Any]) -> None:
    """Remember ``task`` as runnable by the backend ``alias`` (the first declaration wins)."""
    with _lock:
        _declared.setdefault(alias, {}).setdefault(task.module_path, task)


def lookup(alias: str, task_path: str) -> Task[..., Any] | None:
    return _declared.get(alias, {}).get(task_path)


def declared(alias: str) -> list[str]:
    return sorted(_declared.get(alias, {}))


def declared_tasks(alias: str) -> list[Task[..., Any]]:
    """The tasks declared for ``alias`` so far, by dotted path."""
    with _lock:
        return [task for _, task in sorted(_declared.get(alias, {}).items())]


def task_modules() -> list[str]:
    """Every module listed in a lease backend's ``OPTIONS["TASK_MODULES"]`` (checked
    lists only: a bad value is the system check's to report)."""
    from django.conf import settings

    from .conf import lease_backend_aliases

    modules: list[str] = []
    for alias in lease_backend_aliases():
        listed = (settings.TASKS[alias].get("OPTIONS") or {}).get("TASK_MODULES") or []
        if isinstance(listed, list | tuple):
            modules.extend(m for m in listed if isinstance(m, str) and m not in modules)
    return modules


def discovered_modules() -> set[str]:
    """The modules discover() imports: each installed app's ``tasks`` and TASK_MODULES."""
    return {f"{config.name}.tasks" for config in apps.get_app_configs()} | set(task_modules())


def is_discovered(task: Task[..., Any]) -> bool:
    """Whether a worker (and any reader) of this project imports the module ``task`` is
    declared in, and so knows the task: a discovered module, or a submodule of one (an
    app's ``tasks`` package that imports its submodules)."""
    module = task.func.__module__
    return any(module == found or module.startswith(f"{found}.") for found in discovered_modules())


def discover() -> None:
    """Import each installed app's ``tasks`` module and every TASK_MODULES entry, where
    @task declarations live."""
    autodiscover_modules("tasks")
    for module in task_modules():
        importlib.import_module(module)
