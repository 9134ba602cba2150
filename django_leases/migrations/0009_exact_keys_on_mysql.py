"""MySQL and MariaDB: the columns that identify something compare exactly, as on PostgreSQL
and SQLite.

Their default collations compare text without case, accents and (MariaDB's) trailing
spaces, and take every character outside the Basic Multilingual Plane (an emoji) as equal
to every other. A job keyed "invoice-AB" then collided with "invoice-Ab"'s: refused as a
duplicate, or, with ``on_duplicate="merge"``, answered with the other key's job and never
created. Schedule names, worker ids (and the columns naming a worker), queue names and
effect keys had the same trouble. A binary collation without padding compares them as the
code does: MariaDB's ``utf8mb4_nopad_bin``, MySQL's ``utf8mb4_0900_bin`` (``utf8mb4_bin``
where neither exists, MySQL before 8.0.17: trailing spaces still ignored there).

One ALTER TABLE per table, so a table is changed whole or not at all, and each column is
looked at first, so a migration interrupted between tables runs again. The job table's
generated ``active_key`` (its unique index is the key's guard) follows ``unique_key`` only
if declared with the collation: it is dropped and added again in the same statement
(MySQL refuses to change a column a generated column reads). Going back refuses, changing
nothing, while rows differ only in what the default collation ignores: its unique indexes
could not hold them.

The model state is left as it is (a collation name is one database's), so ``sqlmigrate``
shows nothing for this migration, and a later migration that alters one of these fields
must keep the collation on MySQL. On the other databases this migration does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import migrations, models
from django.db.models.sql import Query

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

# Per model, the columns that compare exactly (Job's generated active_key with them).
EXACT = {
    "job": ("queue_name", "unique_key", "claimed_by"),
    "jobfailure": ("worker_id",),
    "schedule": ("name",),
    "workerprocess": ("worker_id",),
    "jobeffect": ("key",),
}
# What each model's unique indexes over these columns hold, checked before going back.
UNIQUE = {"job": ("active_key",), "schedule": ("name",), "workerprocess": ("worker_id",)}
UNIQUE_TOGETHER = {"jobeffect": ("job_id", "key")}
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


def _collations(schema_editor: BaseDatabaseSchemaEditor, table: str) -> dict[str, str | None]:
    """Each column of ``table`` and its collation (None for a column that holds no text)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            [table],
        )
        return dict(cursor.fetchall())


def _with_collation(field: Any, collation: str | None, *, unique: bool) -> Any:
    """A copy of ``field`` declaring ``collation`` (None: the table's); ``unique=False``
    for a MODIFY, which would add a second unique index."""
    _, path, args, kwargs = field.deconstruct()
    kwargs["unique"] = unique and field.unique
    if isinstance(field, models.GeneratedField):
        output: Any = field.output_field
        output = output.clone()
        output.db_collation = collation
        kwargs["output_field"] = output
    else:
        kwargs["db_collation"] = collation
    copy = type(field)(*args, **kwargs)
    copy.set_attributes_from_name(field.name)
    copy.model = field.model
    if isinstance(copy, models.GeneratedField):
        # What contribute_to_class() sets, without adding the copy to the model.
        copy._query = Query(model=field.model, alias_cols=False)
    return copy


def _alter(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor, to: str | None, model_name: str
) -> None:
    """Give ``model_name``'s EXACT columns collation ``to`` (None: the table's) in one
    ALTER TABLE, if one of them has another."""
    model = apps.get_model("django_leases", model_name)
    table = model._meta.db_table
    now = _collations(schema_editor, table)
    fields = [model._meta.get_field(name) for name in EXACT[model_name]]
    if to is None:
        default = _table_collation(schema_editor, table)
        if all(now.get(f.column) == default for f in fields):
            return
    elif all(now.get(f.column) == to for f in fields):
        return
    quote = schema_editor.quote_name
    parts: list[str] = []
    params: list[Any] = []
    generated = model_name == "job"
    if generated:
        # Its unique index by name too: dropped with the column alone, the one added in
        # the same statement would be a second (active_key_2).
        parts += [f"DROP INDEX {quote(name)}" for name in _indexes_on(schema_editor, table)]
        parts.append(f"DROP COLUMN {quote('active_key')}")
    for field in fields:
        sql, field_params = schema_editor.column_sql(
            model, _with_collation(field, to, unique=False)
        )
        parts.append(f"MODIFY {quote(field.column)} {sql}")
        params.extend(field_params or [])
    if generated:
        active = model._meta.get_field("active_key")
        sql, field_params = schema_editor.column_sql(
            model, _with_collation(active, to, unique=True)
        )
        parts.append(f"ADD COLUMN {quote('active_key')} {sql}")
        params.extend(field_params or [])
    schema_editor.execute(f"ALTER TABLE {quote(table)} {', '.join(parts)}", params)


def _indexes_on(schema_editor: BaseDatabaseSchemaEditor, table: str) -> list[str]:
    """The indexes of ``table`` over active_key (its unique index)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
            [table, "active_key"],
        )
        return [row[0] for row in cursor.fetchall()]


def _table_collation(schema_editor: BaseDatabaseSchemaEditor, table: str) -> str:
    """``table``'s default collation: what its columns had before, and get back."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_COLLATION FROM information_schema.TABLES "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            [table],
        )
        return str(cursor.fetchone()[0])


def _refuse_rows_the_default_would_merge(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor
) -> None:
    """Raise, naming the table and columns, if going back would break a unique index."""
    quote = schema_editor.quote_name
    for model_name, columns in {**UNIQUE, **UNIQUE_TOGETHER}.items():
        model = apps.get_model("django_leases", model_name)
        table = model._meta.db_table
        collation = _table_collation(schema_editor, table)
        charset = collation.split("_", 1)[0]
        text = EXACT[model_name] + ("active_key",)
        grouped = ", ".join(
            f"CONVERT({quote(c)} USING {charset}) COLLATE {collation}" if c in text else quote(c)
            for c in columns
        )
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(*) FROM {quote(table)} "  # noqa: S608 -- names quoted, no input
                f"WHERE {quote(columns[-1])} IS NOT NULL "
                f"GROUP BY {grouped} HAVING COUNT(*) > 1 LIMIT 1"
            )
            if cursor.fetchone() is not None:
                raise RuntimeError(
                    f"Cannot unapply 0009_exact_keys_on_mysql: rows of {table} differ only in "
                    f"what collation {collation} ignores in {', '.join(columns)} (case, "
                    "accents, trailing spaces), which its unique index could not hold. "
                    "Rename or delete one of each such pair first."
                )


def set_exact_collations(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """Forward: the EXACT columns compare as spelled (MySQL and MariaDB only)."""
    if schema_editor.connection.vendor != "mysql":
        return
    collation = exact_collation(schema_editor)
    for model_name in EXACT:
        _alter(apps, schema_editor, collation, model_name)


def reset_collations(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """Backward: the table's collation again, once no row would break a unique index."""
    if schema_editor.connection.vendor != "mysql":
        return
    _refuse_rows_the_default_would_merge(apps, schema_editor)
    for model_name in EXACT:
        _alter(apps, schema_editor, None, model_name)


class Migration(migrations.Migration):
    atomic = False  # MySQL's DDL commits at once: nothing to wrap

    dependencies = [
        ("django_leases", "0008_worker_process_key"),
    ]

    operations = [
        migrations.RunPython(set_exact_collations, reset_collations, atomic=False, elidable=False)
    ]
