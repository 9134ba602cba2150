"""Bad input: rows written straight into the table, and a database without the migrations.

Invariant 3 (nothing is lost): a row that can never run ends dead with a reason naming the
field, the worker loop carries on with the next job, and a row the database would let a
claim misread (a lease of zero or less) cannot be written at all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from django_leases.models import Job
from django_leases.states import DeadReason, FailureKind, JobState
from tests.worker_helpers import FAST, ROOT, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ADD = "tests.testapp.tasks.add"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_rows_whose_arguments_cannot_be_passed_end_dead_naming_the_field(workers, isolation):
    """args that are not an array, kwargs that are not an object, and arguments the task's
    signature does not take: each row ends dead after one attempt with an unrunnable failure
    naming the field, and a good row behind them still runs (3)."""
    bad = {
        "args": Job.objects.enqueue(ADD, [1, 2]),
        "kwargs": Job.objects.enqueue(ADD, [1, 2]),
        "args/kwargs": Job.objects.enqueue(ADD, [1, 2]),
    }
    # Straight into the table, as a hand-written INSERT or an older deploy would.
    Job.objects.filter(pk=bad["args"].pk).update(args={"a": 1, "b": 2})
    Job.objects.filter(pk=bad["kwargs"].pk).update(kwargs=["b", 2])
    Job.objects.filter(pk=bad["args/kwargs"].pk).update(args=[1], kwargs={"c": 3})
    good = Job.objects.enqueue(ADD, [2, 3])
    w = workers.start(f"vet-{isolation}", *FAST, "--isolation", isolation)
    wait_for(lambda: Job.objects.get(pk=good.pk).state == JobState.SUCCEEDED, 20, "the good job")
    wait_for(
        lambda: (
            not Job.objects.filter(
                pk__in=[j.pk for j in bad.values()], state__in=[JobState.PENDING, JobState.CLAIMED]
            ).exists()
        ),
        20,
        "the bad rows to end",
    )
    for field, job in bad.items():
        job.refresh_from_db()
        failure = job.failures.get()
        assert (job.state, job.dead_reason, job.attempts) == (
            JobState.DEAD,
            DeadReason.UNRUNNABLE,
            1,
        ), field
        assert failure.kind == FailureKind.UNRUNNABLE
        assert failure.exception_class_path == "django_leases.exceptions.InvalidJobArgument"
        assert failure.message.startswith(f"{field}: "), failure.message
    assert Job.objects.get(pk=good.pk).result == 5
    assert w.proc.poll() is None, "the worker loop must carry on"


@pytest.mark.parametrize("lease", [0, -5, 0.5, 86400])
def test_a_row_with_a_lease_out_of_range_cannot_be_written(lease):
    """A lease of zero or less would be taken over the moment it is claimed; the database
    refuses the row (a check constraint), naming the constraint, and stores nothing (3)."""
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        Job.objects.bulk_create([Job(task_path=ADD, args=[1, 2], lease_seconds=lease)])
    # MySQL names the constraint; SQLite and PostgreSQL do too, in their own words.
    assert "leases_job_lease_range" in str(refused.value)
    assert not Job.objects.exists()
    job = Job.objects.enqueue(ADD, [1, 2])
    with pytest.raises(IntegrityError, match="leases_job_lease_range"), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(lease_seconds=lease)
    assert Job.objects.get(pk=job.pk).lease_seconds == 30


def test_a_worker_refuses_a_database_missing_a_migration():
    """One django_leases migration unapplied: run_lease_worker stops with a CommandError
    naming the migration and the command that fixes it, and claims nothing (3)."""
    job = Job.objects.enqueue(ADD, [1, 2])
    call_command("migrate", "django_leases", "0001", verbosity=0)
    try:
        with pytest.raises(
            CommandError,
            match=r"lacks django_leases migrations 0002_\w+(, \w+)*; "
            r"run: manage\.py migrate django_leases",
        ):
            call_command("run_lease_worker", "--burst")
    finally:
        call_command("migrate", verbosity=0)  # with the test apps' models that need it
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING


def test_a_worker_on_an_empty_database_exits_with_the_command_to_run(tmp_path):
    """A database that never saw migrate: the worker process exits at once with status 1
    and the error, instead of logging a missing table once per poll forever (3)."""
    if connection.vendor != "sqlite":
        pytest.skip(
            "an empty database is a new file on SQLite; the unapplied-migration test "
            "above covers every database"
        )
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'empty.sqlite3'}",
        "PYTHONPATH": str(ROOT),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "run_lease_worker",
            "--settings=tests.settings",
            "--burst",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    assert "lacks django_leases migrations 0001_initial, " in run.stderr
    assert "run: manage.py migrate django_leases --database default" in run.stderr


@pytest.mark.parametrize("use_tz", [True, False])
def test_a_mysql_session_off_utc_is_an_error_and_the_worker_refuses_it(use_tz):
    """Invariant 1 on MySQL/MariaDB: Now() there is the session's local time while Django
    writes UTC, so a session off UTC moves every lease; check --database reports E015 and
    the worker will not start. With USE_TZ = False too: local time jumps at each
    daylight-saving change, and results give the rows' times as UTC made local (it passed
    unsaid, every result hours off)."""
    from django.core import checks

    if connection.vendor != "mysql":
        pytest.skip("PostgreSQL and SQLite store instants; only MySQL's Now() has a zone")
    assert checks.run_checks(tags=[checks.Tags.database], databases=["default"]) == []
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = '+02:00'")
    try:
        with override_settings(USE_TZ=use_tz):
            [error] = checks.run_checks(tags=[checks.Tags.database], databases=["default"])
        assert error.id == "django_leases.E015"
        assert "+2 h from UTC" in error.msg and "SET time_zone = '+00:00'" in error.msg
        if not use_tz:
            assert "daylight-saving" in error.msg
        with override_settings(USE_TZ=use_tz), pytest.raises(CommandError, match=r"\+2 h"):
            call_command("run_lease_worker", "--burst")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = @@global.time_zone")
