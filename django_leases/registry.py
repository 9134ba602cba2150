"""Tasks declared for each lease backend: the only code a worker will run.

A job row names its task by dotted path, but that path is only looked up here, never
imported on its own say-so: a row that names anything else ends dead. The modules imported
to find the declarations are each installed app's ``tasks`` module and the modules a
backend's ``OPTIONS["TASK_MODULES"]`` lists (a package with every module in it): code the
project chose, not the row.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
import threading
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.tasks.exceptions import InvalidTask
from django.utils.module_loading import module_has_submodule

if TYPE_CHECKING:
    from django.tasks import Task

_declared: dict[str, dict[str, Task[..., Any]]] = {}
_lock = threading.Lock()
# Which module discover() was importing when each task was declared: a task of shop/jobs.py
# that shop/tasks.py imports is declared in every worker, though its own module is not one
# discover() names.
_declared_by_discovery: dict[str, str] = {}
# Tasks a worker runs for another backend's declaration (runnable()), by (alias, path,
# queue): apart from _declared.
_moved: dict[tuple[str, str, str], Task[..., Any]] = {}
_discovering = threading.local()
# The modules discover() imported for each discovered module: the module itself and, for a
# package, every module in it (_import_tree()). is_discovered() counts these, and a task
# in a module of the package that discovery left out (a test module, a folder with no
# __init__.py) is refused at enqueue, as no worker would declare it.
_trees: dict[str, frozenset[str]] = {}
# Modules of a tasks package that discovery does not import: its tests, migrations and
# ``python -m`` entry point are no place for tasks, and may not even import in a worker.
_NOT_TASK_MODULES = frozenset({"__main__", "conftest", "migrations", "tests"})
# (alias, path) declared by a copy carrying another backend's schedule (own_schedule()).
_inherited: set[tuple[str, str]] = set()


def declare(alias: str, task: Task[..., Any]) -> None:
    """Remember ``task`` as runnable by the backend ``alias`` (the first declaration wins,
    unless it was a copy carrying another backend's schedule and this one brings a
    schedule of its own: see own_schedule()). Another function at a declared path (a name
    bound twice, two lambdas of one module) is refused: a worker finds a job's code by its
    path alone, and would run the first. The same definition again, unchanged (its module
    reloaded), takes the old one's place."""
    path = task.module_path
    schedule = getattr(task, "schedule", None)
    with _lock:
        first = _declared.get(alias, {}).get(path)
        if first is not None and first.func is not task.func:
            if not _same_definition(first.func, task.func):
                raise InvalidTask(
                    f"{path}: another task is declared at this path ({_where(first.func)}); "
                    "a worker finds a job's code by its path alone, so each task needs a "
                    "function of its own name"
                )
            _declared[alias][path] = task
        inherited = schedule is not None and any(
            getattr(tasks.get(path), "schedule", None) is schedule
            for other, tasks in _declared.items()
            if other != alias
        )
        declared = _declared.setdefault(alias, {})
        if path not in declared or (
            (alias, path) in _inherited and schedule is not None and not inherited
        ):
            declared[path] = task
            if inherited:
                _inherited.add((alias, path))
            else:
                _inherited.discard((alias, path))
        root = getattr(_discovering, "module", None)
        if root is not None:
            _declared_by_discovery.setdefault(path, root)


def _same_definition(one: Any, other: Any) -> bool:
    """Whether two functions come from the same lines of the same file, unchanged: one
    module's declaration imported again (importlib.reload()), not a second definition.
    Decorated functions are compared by what they wrap (functools.wraps): one decorator's
    wrappers share its code."""
    first = getattr(_unwrapped(one), "__code__", None)
    second = getattr(_unwrapped(other), "__code__", None)
    if first is None or second is None:
        return False
    return bool(
        (first.co_filename, first.co_firstlineno, first.co_code)
        == (second.co_filename, second.co_firstlineno, second.co_code)
    )


def _unwrapped(func: Any) -> Any:
    try:
        return inspect.unwrap(func)
    except ValueError:  # a __wrapped__ chain that loops
        return func


def _where(func: Any) -> str:
    """Where ``func`` is defined, for a message: file:line, else its qualified name."""
    code = getattr(_unwrapped(func), "__code__", None)
    if code is None:
        return getattr(func, "__qualname__", repr(func))
    return f"{code.co_filename}:{code.co_firstlineno}"


def own_schedule(alias: str, task: Task[..., Any]) -> Any:
    """The schedule option of ``task``, declared for ``alias``, as that backend's: None
    for a copy that carries the very schedule of a declaration for another backend.
    ``nightly.using(backend="bulk")`` made at import is declared for "bulk" too; were its
    schedule "bulk"'s, both backends' workers would tick nightly. A declaration of its
    own for "bulk" (``task(backend="bulk", schedule=Periodic(..., name=...))``, a Periodic
    of its own) ticks there."""
    if (alias, task.module_path) in _inherited:
        return None
    return getattr(task, "schedule", None)


def lookup(alias: str, task_path: str) -> Task[..., Any] | None:
    return _declared.get(alias, {}).get(task_path)


def runnable(alias: str, task_path: str, queue_name: str) -> Task[..., Any] | None:
    """The task a worker of ``alias`` runs for a job of ``task_path`` in ``queue_name``:
    the one declared for ``alias``, else one declared for another lease backend (sent here
    with ``Task.using(backend=alias)``, which declares the copy in the process that made
    it only, or enqueued by path on this backend's database), else a task of any other
    backend that a discovered module holds (``Task.using(backend=alias)`` of a task
    declared for Django's ImmediateBackend, say: no lease backend declares it), moved to
    ``alias`` and the job's queue so that its results and signals are this backend's. A
    moved task is kept apart, never declared: lookup() and the schedules still see only
    what each backend declares."""
    task = lookup(alias, task_path)
    if task is not None:
        return task
    key = (alias, task_path, queue_name)
    with _lock:
        moved = _moved.get(key)
        elsewhere = [t[task_path] for a, t in sorted(_declared.items()) if task_path in t]
    if moved is not None:
        return moved
    if not elsewhere:
        held = _held_by_discovered(task_path)
        if held is None:
            return None
        elsewhere = [held]
    moved = _moved_to(elsewhere[0], alias, queue_name)
    with _lock:
        if len(_moved) >= 1024:  # paths from rows: bounded
            _moved.clear()
        return _moved.setdefault(key, moved)


def _held_by_discovered(task_path: str) -> Task[..., Any] | None:
    """A Task (of any backend) named ``task_path`` that a module discovery imported holds:
    read from the namespaces of modules already imported, never imported on the row's
    say-so (the rule is_discovered() applies at enqueue)."""
    from django.tasks import Task

    tree = discovered_tree()
    own, _, attribute = task_path.rpartition(".")
    if own in tree:
        # The task under its own name first: a module may also hold variants of it
        # (``quick = nightly.using_lease(lease=5)``), which are not what the path names.
        module = sys.modules.get(own)
        declared = None if module is None else vars(module).get(attribute)
        if isinstance(declared, Task) and declared.module_path == task_path:
            return declared
    for name in sorted(tree):
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Task) and value.module_path == task_path:
                return value
    return None


def _moved_to(task: Task[..., Any], alias: str, queue_name: str) -> Task[..., Any]:
    """A copy of ``task`` on backend ``alias`` and queue ``queue_name``, without its
    schedules (those of the backend it was declared for). Not validated again: the job
    was enqueued with these, and a worker of ``alias`` serves the queue."""
    changes: dict[str, Any] = {"backend": alias, "queue_name": queue_name}
    if hasattr(task, "schedule"):
        changes["schedule"] = None
    return copied_task(task, **changes)


def copied_task(task: Task[..., Any], **changes: Any) -> Task[..., Any]:
    """``task`` with ``changes``, field by field, neither validated nor declared:
    dataclasses.replace() and copy.copy() make a Task anew, which its backend validates
    and declares, so a copy describing one job (its queue, priority, run_after) would
    become what the backend runs for every job of the path."""
    from dataclasses import fields

    copy = object.__new__(type(task))
    for field in fields(task):
        object.__setattr__(copy, field.name, changes.get(field.name, getattr(task, field.name)))
    return copy


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


def discovered_tree() -> set[str]:
    """The discovered modules and every module discover() imported in them (packages)."""
    found = discovered_modules()
    return found.union(*(_trees.get(name, ()) for name in found))


def _import_tree(name: str, seen: set[str]) -> list[str]:
    """Import ``name`` and, if it is a package, every module in it (but its tests,
    migrations and ``__main__``); return their names. An error in one is raised, as one
    in a ``tasks.py`` is. ``seen``: the package directories walked (a symlink loop)."""
    module = importlib.import_module(name)
    names = [name]
    # From the module's own dict: a module __getattr__ must not invent a __path__.
    spec = vars(module).get("__spec__")
    locations = getattr(spec, "submodule_search_locations", None)
    if locations is None:
        return names
    places = [os.path.realpath(place) for place in locations if isinstance(place, str)]
    if not places or seen.intersection(places):
        return names
    seen.update(places)
    for sub in pkgutil.iter_modules(places, prefix=f"{name}."):
        leaf = sub.name.rpartition(".")[2]
        if leaf not in _NOT_TASK_MODULES and not leaf.startswith("test_"):
            names += _import_tree(sub.name, seen)
    return names


def is_test_module(name: str) -> bool:
    """Whether module ``name`` is a test module by its name: ``tests``, ``test``,
    ``conftest``, ``test_*`` and ``tests_*`` (Django's runner), ``*_test`` and ``*_tests``
    (pytest's), or a module inside an app's ``tests`` package (``shop.tests.factories``).
    A task declared there is one a test declares for itself, not one for workers."""
    parts = name.split(".")
    leaf = parts[-1]
    return (
        leaf in ("tests", "test", "conftest")
        or leaf.startswith(("test_", "tests_"))
        or leaf.endswith(("_test", "_tests"))
        or "tests" in parts[1:-1]
    )


def is_discovered(task: Task[..., Any]) -> bool:
    """Whether a worker (and any reader) of this project declares ``task`` when it imports
    the discovered modules, and so knows the task: one declared in a discovered module or
    a module discovery imported in one (an app's ``tasks`` package), declared while
    discover() imported a discovered module (shop/tasks.py importing shop/jobs.py), or
    named by one (imported from a module loaded before discovery ran). Call discover()
    first: only the discovered modules themselves count before it has run."""
    module = task.func.__module__
    tree = discovered_tree()
    if module in tree:
        return True
    path = getattr(task, "module_path", None)
    if path is None:
        return False
    if _declared_by_discovery.get(path) in discovered_modules():
        return True
    from django.tasks import Task

    return any(
        isinstance(value, Task) and value.module_path == path
        for name in tree
        if name in sys.modules
        for value in list(vars(sys.modules[name]).values())
    )


def discover() -> None:
    """Import each installed app's ``tasks`` module and every TASK_MODULES entry, where
    @task declarations live (a package with every module in it), noting which of them
    declared each task. A module walked once is not walked again."""
    modules = [(config.module, f"{config.name}.tasks") for config in apps.get_app_configs()]
    modules += [(None, module) for module in task_modules()]
    for package, module in modules:
        if module in _trees:
            continue
        outer = getattr(_discovering, "module", None)
        _discovering.module = module
        try:
            _trees[module] = frozenset(_import_tree(module, set()))
        except Exception:
            # An app without a tasks module is skipped; an error inside one is raised (as
            # autodiscover_modules() does).
            if package is not None and not module_has_submodule(package, "tasks"):
                _trees[module] = frozenset()
                continue
            raise
        finally:
            _discovering.module = outer
