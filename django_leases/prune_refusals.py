"""What the collector or the database would refuse when prune deletes jobs, found while
the batch can still be kept: a RESTRICT that no cascade lets through, a foreign key a
caller's transaction would only check at its commit.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, connections, models
from django.db.models.deletion import Collector, RestrictedError

from .prune_references import DATABASE_ON_DELETE, made_here


class ProjectRowsCollector(Collector):
    """Django's collector for the project's rows that point at jobs prune deletes. A row
    of a project's subclass of Job (or of a subclass of that) is collected without its
    parents: without the job, which prune's own DELETE takes, and without the job's
    relations, which prune follows itself (a schedule's last job never, as a collector
    would, with an UPDATE of the schedule table)."""

    def __init__(self, job: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job

    def collect(self, objs: Any, *args: Any, **kwargs: Any) -> None:
        model = getattr(objs, "model", None) or (type(objs[0]) if objs else None)
        if model is not None and self.job in model._meta.get_parent_list():
            kwargs["keep_parents"] = True
        super().collect(objs, *args, **kwargs)


def refuse_restricted(collector: Collector) -> None:
    """Raise RestrictedError for what a RESTRICT relation holds and no CASCADE collected,
    as Collector.collect() does at its top level (the on_delete calls here are not)."""
    for model, instances in collector.data.items():
        collector.clear_restricted_objects_from_set(model, set(instances))
    for qs in collector.fast_deletes:
        collector.clear_restricted_objects_from_queryset(qs.model, qs)
    held = {
        obj
        for fields in collector.restricted_objects.values()
        for objs in fields.values()
        for obj in objs
    }
    if held:
        raise RestrictedError("rows a RESTRICT relation holds would be deleted", held)


def check_foreign_keys_now(db: str, gone: set[Any]) -> None:
    """Raise IntegrityError now for a row left pointing at one deleted from the tables of
    ``gone`` (models), which PostgreSQL and SQLite would report only at the commit (MySQL
    checks each statement). Only inside a caller's transaction. On PostgreSQL in a
    savepoint rolled back after, which leaves the constraints' mode as the caller had it;
    that runs every deferred check of the transaction so far (the caller's pending rows
    too, whose refusal keeps the batch's jobs), and again at the next batch: prune in a
    transaction of its own, as leases_prune does, checks each batch once at its commit."""
    connection = connections[db]
    if connection.vendor == "postgresql":
        checked = connection.savepoint()
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        finally:
            if checked is not None:  # always, inside the batch's atomic block
                connection.savepoint_rollback(checked)
    elif connection.vendor == "sqlite":
        gone = with_database_cascades(gone)
        deleted = {model._meta.db_table for model in gone}
        tables = {
            rel.related_model._meta.db_table
            for model in gone
            for rel in model._meta.get_fields(include_hidden=True)
            if isinstance(rel, models.ForeignObjectRel)
            and getattr(rel.field, "db_constraint", False)
            and made_here(db, rel.related_model)
        }
        quote = connection.ops.quote_name
        with connection.cursor() as cursor:
            for table in sorted(tables):
                cursor.execute(f"PRAGMA foreign_key_check({quote(table)})")
                for _, rowid, parent, _ in cursor.fetchall():
                    if parent in deleted:
                        raise IntegrityError(f"{table} row {rowid} points at a deleted {parent}")


def with_database_cascades(gone: set[Any]) -> set[Any]:
    """``gone`` and the models whose rows the database deletes with theirs (DB_CASCADE)."""
    found = set(gone)
    todo = list(gone)
    while todo:
        for rel in todo.pop()._meta.get_fields(include_hidden=True):
            if (
                isinstance(rel, models.ForeignObjectRel)
                and isinstance(rel.on_delete, DATABASE_ON_DELETE)
                and getattr(rel.on_delete, "operation", "") == "CASCADE"
                and rel.related_model not in found
            ):
                found.add(rel.related_model)
                todo.append(rel.related_model)
    return found
