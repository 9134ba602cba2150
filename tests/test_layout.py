"""The import rules of docs/layout.md, read from the package's source with ``ast``.

Imports at module level and inside functions both count; an import under ``if
TYPE_CHECKING:`` (for annotations only) does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import django_leases

PACKAGE = Path(django_leases.__file__).parent

# Modules that hold the data and the statements on it: none of them knows the worker, the
# admin, the backend or the commands.
DATA = {
    "django_leases.models",
    "django_leases.query",
    "django_leases.claiming",
    "django_leases.owner_writes",
    "django_leases.lease_statements",
    "django_leases.operators",
    "django_leases.pruning",
    "django_leases.prune_references",
    "django_leases.prune_refusals",
    "django_leases.enqueue",
    "django_leases.enqueue_options",
    "django_leases.worker_registry",
    "django_leases.states",
    "django_leases.lookups",
    "django_leases.conf",
    "django_leases.exceptions",
    "django_leases.jsonsafe",
    "django_leases.retry",
    "django_leases.storable",
    "django_leases.safe_logging",
    "django_leases.deadlocks",
    "django_leases.id_chunks",
    "django_leases.schedules",
    "django_leases.schedule_query",
}
# What only the manager (models.py's Job.objects) and the backend's enqueue may use.
STATEMENTS = {
    "django_leases.query",
    "django_leases.claiming",
    "django_leases.owner_writes",
    "django_leases.lease_statements",
    "django_leases.operators",
    "django_leases.pruning",
    "django_leases.prune_references",
    "django_leases.prune_refusals",
    "django_leases.enqueue",
    "django_leases.worker_registry",
    "django_leases.schedule_query",
}
CALLERS = (
    "django_leases.worker",
    "django_leases.admin",
    "django_leases.admin_lists",
    "django_leases.admin_actions",
    "django_leases.admin_log",
    "django_leases.worker_admin",
    "django_leases.schedule_admin",
    "django_leases.backends",
    "django_leases.management",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                skipped.update(id(inner) for inner in ast.walk(statement))
    return skipped


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules (and any other dotted names) that ``path`` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_only(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # "from . import conf" imports the module conf; "from .conf import X" conf.
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in modules else target)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts}
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


GRAPH = _graph()


def _internal(targets: set[str]) -> set[str]:
    return {t for t in targets if t in GRAPH}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(_internal(GRAPH[node])):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return components


def _under(name: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def test_the_scan_sees_the_package():
    """The rules below would pass vacuously on an empty graph."""
    assert {"django_leases.query", "django_leases.enqueue", "django_leases.worker.loop"} <= set(
        GRAPH
    )
    assert "django_leases.enqueue" in GRAPH["django_leases.query"]
    assert "django_leases.models" in GRAPH["django_leases.worker.loop"]  # a function-level import


def test_no_import_circles():
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(DATA))
def test_models_and_statements_know_nothing_of_their_callers(module):
    """models.py, the manager's statements and what they use never import the worker, the
    admin, the backend or the commands."""
    assert {t for t in GRAPH[module] if _under(t, CALLERS) or t == "django_leases.api"} == set()


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _under(m, ("django_leases.worker",))))
def test_the_worker_speaks_to_the_database_only_through_the_manager(module):
    """The worker calls Job.objects verbs: it imports no statement module and builds no
    query (django.db.models); it may hold connections (open, close, LISTEN)."""
    imported = GRAPH[module]
    assert {t for t in imported if _under(t, STATEMENTS)} == set()
    assert {t for t in imported if _under(t, ("django.db.models",))} == set()


ADMIN = (
    "django_leases.admin",
    "django_leases.admin_lists",
    "django_leases.admin_actions",
    "django_leases.admin_log",
    "django_leases.worker_admin",
    "django_leases.schedule_admin",
)


@pytest.mark.parametrize("module", ADMIN)
def test_the_admin_reads_models_and_calls_verbs(module):
    imported = GRAPH[module]
    assert {
        t
        for t in imported
        if _under(t, STATEMENTS | {"django_leases.worker", "django_leases.backends"})
    } == set()


def test_the_backend_enqueues_through_enqueue_py_not_query_internals():
    imported = GRAPH["django_leases.backends"]
    assert {t for t in imported if _under(t, STATEMENTS - {"django_leases.enqueue"})} == set()


def test_enqueue_and_operators_stand_below_query():
    """query.py composes JobQuerySet from claiming.py, owner_writes.py, operators.py and
    pruning.py and calls enqueue.py, never the other way round; the owner's writes build
    on the claim, which never imports them."""
    for module in (
        "django_leases.enqueue",
        "django_leases.enqueue_options",
        "django_leases.claiming",
        "django_leases.owner_writes",
        "django_leases.lease_statements",
        "django_leases.operators",
        "django_leases.pruning",
        "django_leases.prune_references",
        "django_leases.prune_refusals",
        "django_leases.worker_registry",
    ):
        assert "django_leases.query" not in GRAPH[module], module
    assert "django_leases.owner_writes" not in GRAPH["django_leases.claiming"]
    assert "django_leases.claiming" in GRAPH["django_leases.owner_writes"]
    assert "django_leases.models" not in GRAPH["django_leases.enqueue"]
    assert "django_leases.models" not in GRAPH["django_leases.enqueue_options"]
    # Checking options writes nothing: the insert paths build on the checks, never the
    # reverse.
    assert "django_leases.enqueue" not in GRAPH["django_leases.enqueue_options"]
    assert "django_leases.enqueue_options" in GRAPH["django_leases.enqueue"]
    # What points at a job is read apart from what deletes it.
    assert "django_leases.pruning" not in GRAPH["django_leases.prune_references"]
    assert "django_leases.pruning" not in GRAPH["django_leases.prune_refusals"]


def test_every_module_is_on_the_layout_page():
    """docs/layout.md names every module, so the page and the package cannot drift apart."""
    page = (PACKAGE.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    missing = [
        name
        for name in GRAPH
        if f"`{name.removeprefix('django_leases.').replace('.', '/')}" not in page
        and name != "django_leases"
        and not name.endswith((".management", ".commands"))
    ]
    assert missing == []
