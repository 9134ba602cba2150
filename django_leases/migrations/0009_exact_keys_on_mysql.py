"""MySQL and MariaDB: the columns that identify something compare exactly, as on PostgreSQL
and SQLite.

Their default collations compare text without case, accents and (MariaDB's) trailing
spaces, and take every character outside the Basic Multilingual Plane (an emoji) as equal
to every other. A job keyed "invoice-AB" then collided with "invoice-Ab"'s: refused as a
duplicate, or, with ``on_duplicate="merge"``, answered with the other key's job and never
created. Schedule names, worker ids, queue names and effect keys had the same trouble. A
binary collation without padding compares them as the code does: MariaDB's
``utf8mb4_nopad_bin``, MySQL 8's ``utf8mb4_0900_bin`` (``utf8mb4_bin`` where neither exists:
trailing spaces still ignored there).

The model state is left as it is (a collation name is one database's), so a later
migration that alters one of these fields must keep the collation on MySQL. The generated
``active_key`` follows ``unique_key``'s collation only if declared with it: it is removed
and added again around ``unique_key``'s change (MySQL refuses to change a column a
generated column reads). On the other databases this migration does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import migrations, models
from django.db.models.sql import Query

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

# (model, field) whose column compares exactly; Job's active_key is handled with unique_key.
EXACT = (
    ("job", "queue_name"),
    ("job", "unique_key"),
    ("schedule", "name"),
    ("workerprocess", "worker_id"),
    ("jobeffect", "key"),
)
PREFERRED = ("utf8mb4_nopad_bin", "utf8mb4_0900_bin")


def exact_collation(schema_editor: BaseDatabaseSchemaEditor) -> str:
    """The server's binary utf8mb4 collation without padding, else its padded one."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT COLLATION_NAME FROM information_schema.COLLATIONS "
            "WHERE COLLATION_NAME IN (%s, %s)",
            list(PREFERRED),
        )
        found = {row[0] for row in cursor.fetchall()}
    return next((name for name in PREFERRED if name in found), "utf8mb4_bin")


def _with_collation(model: Any, name: str, collation: str | None) -> Any:
    """A copy of ``model``'s field ``name`` declaring ``collation`` (None: the table's)."""
    old = model._meta.get_field(name)
    _, path, args, kwargs = old.deconstruct()
    if isinstance(old, models.GeneratedField):
        output: Any = old.output_field
        output = output.clone()
        output.db_collation = collation
        kwargs["output_field"] = output
        new = models.GeneratedField(*args, **kwargs)
        new.set_attributes_from_name(name)
        new.model = model
        new._query = Query(model=model, alias_cols=False)  # as contribute_to_class sets it
        return new
    kwargs["db_collation"] = collation
    new = type(old)(*args, **kwargs)
    new.set_attributes_from_name(name)
    new.model = model
    return new


def _collate(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor, was: str | None, to: str | None
) -> None:
    """Move the EXACT columns (and active_key) from collation ``was`` to ``to``."""
    job = apps.get_model("django_leases", "Job")
    schema_editor.remove_field(job, _with_collation(job, "active_key", was))
    for model_name, name in EXACT:
        model = apps.get_model("django_leases", model_name)
        schema_editor.alter_field(
            model, _with_collation(model, name, was), _with_collation(model, name, to)
        )
    schema_editor.add_field(job, _with_collation(job, "active_key", to))


def exact(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "mysql":
        _collate(apps, schema_editor, None, exact_collation(schema_editor))


def default(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "mysql":
        _collate(apps, schema_editor, exact_collation(schema_editor), None)


class Migration(migrations.Migration):
    atomic = False  # MySQL's DDL commits at once: nothing to wrap

    dependencies = [
        ("django_leases", "0008_worker_process_key"),
    ]

    operations = [migrations.RunPython(exact, default, atomic=False, elidable=False)]
