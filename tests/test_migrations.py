"""The migrations build the schema the models describe, under the names code and docs use,
and unapply cleanly."""

from __future__ import annotations

import importlib
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from django_leases.models import Job

# Named in claiming.py's claim plans, tests/test_explain.py, tests/test_bad_input.py and the
# docs: renaming any of them is a breaking change (docs/releases.md).
PARTIAL_INDEXES = {"leases_job_due_idx", "leases_job_claimed_idx", "leases_job_token_idx"}
INDEXES = {"leases_job_finished_idx", "leases_job_census_idx"}
MYSQL_INDEXES = {"leases_job_due_mysql_idx", "leases_job_lease_mysql_idx"}
CHECKS = {"leases_job_claimed_has_lease", "leases_job_priority_range", "leases_job_lease_range"}
TRIGGER = "django_leases_job_enqueued"


@pytest.mark.django_db
def test_models_and_migrations_agree():
    """makemigrations --check is clean: no model change is left without a migration."""
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)


def job_table_names() -> set[str]:
    with connection.cursor() as cursor:
        names = set(connection.introspection.get_constraints(cursor, Job._meta.db_table))
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
                [Job._meta.db_table],
            )
            names |= {row[0] for row in cursor.fetchall()}
    return names


def expected_names() -> set[str]:
    names = INDEXES | PARTIAL_INDEXES | CHECKS
    if connection.vendor == "mysql":
        # Django builds the partial indexes there without their condition (models.W037);
        # 0002 adds plain ones that lead with the state.
        return names | MYSQL_INDEXES
    return names | {TRIGGER} if connection.vendor == "postgresql" else names


def foreign_names() -> set[str]:
    return (set() if connection.vendor == "mysql" else MYSQL_INDEXES) | (
        set() if connection.vendor == "postgresql" else {TRIGGER}
    )


@pytest.mark.django_db(transaction=True)
def test_the_schema_has_its_named_indexes_constraints_and_trigger_and_unapplies_cleanly():
    """Every index, check constraint and (PostgreSQL) trigger exists under its lasting name on
    this database, none of another database's; unapplying every django_leases migration
    drops the table and the trigger, and applying them again builds the same schema."""
    names = job_table_names()
    assert expected_names() <= names, sorted(expected_names() - names)
    assert not foreign_names() & names, sorted(foreign_names() & names)

    call_command("migrate", "django_leases", "zero", verbosity=0)
    try:
        assert Job._meta.db_table not in connection.introspection.table_names()
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_proc WHERE proname = 'django_leases_notify_enqueued'"
                )
                assert cursor.fetchone()[0] == 0
    finally:
        call_command("migrate", verbosity=0)  # with the test app's models that need it
    assert job_table_names() == names


def job_storage() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [Job._meta.db_table]
        )
        options = cursor.fetchone()[0] or []
    return dict(option.split("=", 1) for option in options)


@pytest.mark.django_db(transaction=True)
def test_the_job_tables_storage_parameters_are_set_on_postgresql_and_reset_when_unapplied():
    """0004 gives the job table on PostgreSQL the fillfactor and fixed autovacuum thresholds
    docs/scale.md measures; unapplying it gives back PostgreSQL's defaults; other databases
    have nothing to set."""
    from importlib import import_module

    if connection.vendor != "postgresql":
        pytest.skip("storage parameters are PostgreSQL's")
    wanted = import_module("django_leases.migrations.0004_job_storage").JOB_STORAGE
    assert job_storage() == wanted
    call_command("migrate", "django_leases", "0003", verbosity=0)
    try:
        assert job_storage() == {}
    finally:
        call_command("migrate", verbosity=0)  # with the test app's models that need it
    assert job_storage() == wanted


def active_key_indexes() -> dict[str, str]:
    """Each index of the job table on active_key, with its definition (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
            [Job._meta.db_table, "%(active_key%"],
        )
        return dict(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_the_unique_key_has_its_unique_index_only_and_no_like_index_on_postgresql():
    """0005 drops the varchar_pattern_ops index Django built beside active_key's unique
    constraint (every row version of a job had an entry in it, which no query reads) and
    leaves the constraint, which ON CONFLICT infers; unapplying 0005 builds the LIKE index
    again under its old name."""
    if connection.vendor != "postgresql":
        pytest.skip("Django builds LIKE indexes on PostgreSQL only")
    indexes = active_key_indexes()
    assert len(indexes) == 1, indexes
    assert "UNIQUE" in next(iter(indexes.values()))
    call_command("migrate", "django_leases", "0004", verbosity=0)
    try:
        before = active_key_indexes()
        assert len(before) == 2, before
        assert [n for n, d in before.items() if "varchar_pattern_ops" in d] == [
            connection.schema_editor()._create_index_name(
                Job._meta.db_table, ["active_key"], suffix="_like"
            )
        ]
    finally:
        call_command("migrate", verbosity=0)  # with the test app's models that need it
    assert active_key_indexes() == indexes


mysql_only = pytest.mark.skipif(
    connection.vendor != "mysql", reason="MySQL's and MariaDB's collations"
)
m0009 = importlib.import_module("django_leases.migrations.0009_exact_keys_on_mysql")


def collations() -> dict[tuple[str, str], str]:
    """(table, column) -> collation, of the text columns 0009 looks after."""
    from django.apps import apps

    wanted = {
        (apps.get_model("django_leases", model)._meta.db_table, column)
        for model, columns in m0009.EXACT.items()
        for column in (*columns, *(("active_key",) if model == "job" else ()))
    }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE()"
        )
        found = {(t, c): coll for t, c, coll in cursor.fetchall()}
    return {key: found[key] for key in sorted(wanted)}


@mysql_only
@pytest.mark.django_db(transaction=True)
def test_keys_and_names_have_a_binary_collation_without_padding_on_mysql():
    """Migration 0009: each column that identifies something, and active_key with
    unique_key, compares as spelled (a later migration altering one would reset it: this
    says so); its unique indexes are there once each."""
    [exact] = set(collations().values())
    assert exact in (*m0009.PREFERRED, "utf8mb4_bin"), collations()  # MySQL's, MariaDB's
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = "
            "DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = 'active_key'",
            [Job._meta.db_table],
        )
        assert [row[0] for row in cursor.fetchall()] == ["active_key"]


@mysql_only
@pytest.mark.django_db(transaction=True)
def test_unapplying_0009_with_keys_the_default_collation_merges_refuses_and_changes_nothing():
    """Two active jobs keyed "inv-a" and "inv-A" cannot stand under the default
    collation's unique index: going back refuses, naming the table, before any change
    (it dropped active_key, then failed to add it again, and the table was left without
    its guard, 0009 still recorded as applied). Without them, it goes back and forth."""
    first = Job.objects.enqueue("tests.testapp.tasks.add", [1, 1], unique_key="inv-a")
    Job.objects.enqueue("tests.testapp.tasks.add", [1, 1], unique_key="inv-A")
    before = collations()
    try:
        with pytest.raises(RuntimeError, match="rows of django_leases_job differ only"):
            call_command("migrate", "django_leases", "0008", verbosity=0)
        assert collations() == before
        Job.objects.filter(pk=first.pk).cancel()
        call_command("migrate", "django_leases", "0008", verbosity=0)
        assert all(
            collation == table_collation(table) for (table, _), collation in collations().items()
        ), collations()
    finally:
        call_command("migrate", verbosity=0)
    assert collations() == before


def table_collation(table: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_COLLATION FROM information_schema.TABLES "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            [table],
        )
        return cursor.fetchone()[0]
