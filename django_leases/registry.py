"""Tasks declared for each lease backend: the only code a worker will run.

A job row names its task by dotted path, but that path is only looked up here, never
imported on its own say-so: a row that names anything else ends dead.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from django.utils.module_loading import autodiscover_modules

if TYPE_CHECKING:
    from django.tasks import Task

_declared: dict[str, dict[str, Task]] = {}
_lock = threading.Lock()


def declare(alias: str, task: Task) -> None:
    """Remember ``task`` as runnable by the backend ``alias`` (the first declaration wins)."""
    with _lock:
        _declared.setdefault(alias, {}).setdefault(task.module_path, task)


def lookup(alias: str, task_path: str) -> Task | None:
    return _declared.get(alias, {}).get(task_path)


def declared(alias: str) -> list[str]:
    return sorted(_declared.get(alias, {}))


def discover() -> None:
    """Import each installed app's ``tasks`` module, where @task declarations live."""
    autodiscover_modules("tasks")
