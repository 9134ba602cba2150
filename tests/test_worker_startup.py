"""run_lease_worker started against a database that is down, full, or too small for it.

Real worker processes against PostgreSQL (and MySQL/MariaDB): through a TCP proxy that refuses connections
until healed (the database down at start), and as a role of their own with a CONNECTION
LIMIT (a connection budget), so the shared server is never disturbed. Invariant (3):
nothing is lost, and no attempt is spent on the worker's own trouble.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid

import pytest
from django.db import connection

from django_leases.models import Job, JobFailure
from django_leases.states import JobState
from tests.chaos.proxy import Proxy
from tests.testapp.models import Effect
from tests.testapp.tasks import add
from tests.worker_helpers import FAST, ON_POSTGRES, PG_ONLY, job_of, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
pg_only = pytest.mark.skipif(not ON_POSTGRES, reason=PG_ONLY)
over_tcp = pytest.mark.skipif(connection.vendor == "sqlite", reason="a database server over TCP")


@pytest.fixture
def down_database():
    """A proxy to the test server that refuses every connection until ``heal()``."""
    default_port = 5432 if connection.vendor == "postgresql" else 3306
    proxy = Proxy(int(connection.settings_dict["PORT"] or default_port))
    proxy.cut()
    yield proxy
    proxy.close()
    proxy._thread.join(5)
    proxy._loop.close()  # Proxy.close() stops its loop; closing it frees its sockets


@over_tcp
def test_a_worker_started_while_the_database_is_down_waits_then_runs_a_job(workers, down_database):
    """No traceback from the system checks: one warning per attempt, with back-off, and
    once the database answers the checks pass and the worker serves as usual (3)."""
    env = {"LEASES_WORKER_DB_PORT": str(down_database.port)}
    w = workers.start("down-a", *FAST, ready=False, env_extra=env)
    w.wait_event("db_wait", attempt=3, timeout=20)
    assert w.proc.poll() is None, w.log()
    assert "Traceback" not in w.log() and not w.events("started")
    waits = w.events("db_wait", worker="down-a")
    assert [wait["attempt"] for wait in waits[:3]] == [1, 2, 3], w.log()
    result = add.enqueue(2, 3)
    down_database.heal()
    w.wait_event("started", timeout=20)
    assert w.events("db_back", worker="down-a")
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 10, "the job")
    assert (job_of(result).result, job_of(result).attempts) == (5, 1)
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0


@over_tcp
def test_sigterm_while_waiting_for_the_database_exits_0(workers, down_database):
    """A stop signal ends the wait at once: exit status 0, nothing claimed."""
    result = add.enqueue(1, 1)
    env = {"LEASES_WORKER_DB_PORT": str(down_database.port)}
    w = workers.start("down-term", *FAST, ready=False, env_extra=env)
    w.wait_event("db_wait", timeout=20)
    w.signal(signal.SIGTERM)
    assert w.wait_exit(timeout=5) == 0
    assert w.events("stopped", signal="SIGTERM") and "Traceback" not in w.log(), w.log()
    assert (job_of(result).state, job_of(result).attempts) == (JobState.PENDING, 0)


@over_tcp
def test_a_stop_while_the_database_is_down_ends_within_its_bound_with_status_1(
    workers, down_database
):
    """SIGTERM with a handler running and the database gone: the last writes (the
    release, the worker row) are retried for LAST_WRITES_SECONDS, not five backed-off
    tries each (the grace + 41 s, past any process manager's stop timeout), and the
    status is 1: the job could not be released and stays claimed until its lease ends,
    which a process manager should see (3)."""
    from tests.testapp.models import Effect
    from tests.testapp.tasks import stubborn

    down_database.heal()
    key = f"down-stop-{uuid.uuid4().hex[:8]}"
    result = stubborn.enqueue(key, 60)
    env = {"LEASES_WORKER_DB_PORT": str(down_database.port)}
    w = workers.start(
        "down-stop", "--lease", "30", "--heartbeat", "2", "--grace", "1", env_extra=env
    )
    wait_for(lambda: Effect.objects.filter(key=key).exists(), 30, "the handler to start")
    down_database.cut()
    w.signal(signal.SIGTERM)
    # The grace (1 s), the notice (1 s), the last writes (8 s), and a loaded machine's margin.
    assert w.wait_exit(timeout=18) == 1, w.log()[-3000:]
    assert w.events("release_failed", job_id=int(result.id)), w.log()[-3000:]
    assert job_of(result).state == JobState.CLAIMED


@over_tcp
def test_a_stop_after_its_claims_ran_out_in_an_outage_ends_with_status_1(workers, down_database):
    """SIGTERM during an outage longer than the lease: the watchdog had given the claim up
    (its lease ran out by the worker's clock), so nothing was left to release, and the
    worker row could not be marked stopped; the worker exited 0, as after a clean stop.
    A last write that never went is status 1, for the process manager to see (3)."""
    from tests.testapp.models import Effect
    from tests.testapp.tasks import hold

    down_database.heal()
    key = f"down-lost-{uuid.uuid4().hex[:8]}"
    result = hold.enqueue(60, key)
    env = {"LEASES_WORKER_DB_PORT": str(down_database.port)}
    w = workers.start(
        "down-lost", "--lease", "3", "--heartbeat", "1", "--grace", "2", env_extra=env
    )
    wait_for(lambda: Effect.objects.filter(key=key).exists(), 30, "the handler to start")
    down_database.cut()
    w.wait_event("lost", timeout=20, job_id=int(result.id))
    w.signal(signal.SIGTERM)
    assert w.wait_exit(timeout=30) == 1, w.log()[-3000:]
    assert w.events("stopped"), w.log()[-3000:]
    assert job_of(result).state == JobState.CLAIMED


@over_tcp
def test_an_outage_is_told_once_per_trouble_and_when_it_ends(workers, down_database):
    """Eight seconds without the database: the claim loop, the renewals (every 0.5 s), the
    wake-up connection (PostgreSQL) and the schedule ticker (of a backend that declares a
    schedule: one that declares none sends nothing for schedules) each log one warning,
    not one per try (about 200 lines a minute per worker before), and each says when it is
    over; a job enqueued during the outage runs after it (3)."""
    down_database.heal()
    hourly = {"hourly": {"task": "tests.testapp.tasks.add", "every": 3600, "args": [1, 1]}}
    env = {
        "LEASES_WORKER_DB_PORT": str(down_database.port),
        "LEASES_WORKER_SCHEDULES": json.dumps(hourly),
    }
    w = workers.start("outage-a", "--heartbeat", "0.5", "--poll", "0.2", env_extra=env)
    down_database.cut()
    wait_for(lambda: w.events("renewal_failed") and w.events("db_trouble"), 10, "the outage")
    troubles = ["db_trouble", "renewal_failed", "schedules_trouble"]
    if connection.vendor == "postgresql":
        troubles.append("listen_failed")
    wait_for(lambda: all(w.events(t) for t in troubles), 10, "every kind of trouble")
    time.sleep(6)  # the outage goes on: renewals alone would fail a dozen times more
    result = add.enqueue(4, 4)
    down_database.heal()
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the job after it")
    for trouble in troubles:
        # The listener's is over once its new connection stayed up STEADY_SECONDS (5 s).
        w.wait_event("trouble_over", trouble=trouble, timeout=30)
        assert len(w.events(trouble)) == 1, (trouble, w.log()[-3000:])
        [over] = w.events("trouble_over", trouble=trouble)
        assert over["failures"] > 1, over
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0


@over_tcp
def test_an_outage_of_a_worker_no_longer_claiming_is_over_once_its_ack_goes_out(
    workers, down_database
):
    """A worker that ran its --max-jobs claims no more: the main loop's trouble, told
    over only by a claim, was never over although its ack went out when the database
    came back. An ack sent ends it as a claim does (3). The cut waits for the handler to
    run: before it, the handler could not connect and its job was released."""
    from tests.testapp.tasks import hold

    down_database.heal()
    result = hold.enqueue(3, "outage-max")
    env = {"LEASES_WORKER_DB_PORT": str(down_database.port)}
    w = workers.start("outage-max", "--max-jobs", "1", "--heartbeat", "0.5", env_extra=env)
    wait_for(
        lambda: Effect.objects.filter(key="outage-max", phase="start").exists(), 30, "the handler"
    )
    down_database.cut()
    w.wait_event("db_trouble", timeout=20)  # the ack, once the handler returned
    down_database.heal()
    assert w.wait_exit(timeout=30) == 0, w.log()[-3000:]
    assert job_of(result).state == JobState.SUCCEEDED
    [over] = w.events("trouble_over", trouble="db_trouble")
    assert over["failures"] >= 1, over


@contextlib.contextmanager
def limited_role(limit: int):
    """A login role of its own with CONNECTION LIMIT ``limit`` and the rights the worker
    needs on the test database; dropped afterwards (its sessions ended first)."""
    role = f"leases_budget_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as c:
        c.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT {limit}')
        c.execute(
            f'GRANT CONNECT, TEMPORARY ON DATABASE "{connection.settings_dict["NAME"]}" TO "{role}"'
        )
        c.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        c.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
        c.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
    try:
        yield role
    finally:
        with connection.cursor() as c:
            c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role]
            )
            c.execute(f'DROP OWNED BY "{role}"')
            wait_for(lambda: not sessions_of(role), 10, "the role's sessions to end")
            c.execute(f'DROP ROLE "{role}"')


def sessions_of(role: str) -> int:
    with connection.cursor() as c:
        c.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role])
        return c.fetchone()[0]


@pg_only
def test_a_concurrency_the_connection_limit_cannot_serve_is_refused_with_the_numbers(workers):
    """--concurrency 10 needs 13 connections (main, heartbeat, listener, 10 handlers); a role
    limited to 6 is refused at start, before any claim, with the numbers and the way out."""
    result = add.enqueue(1, 2)
    with limited_role(6) as role:
        w = workers.start(
            "budget-refused",
            *FAST,
            "--concurrency",
            "10",
            ready=False,
            env_extra={"LEASES_WORKER_DB_USER": role},
        )
        assert w.wait_exit(timeout=30) == 1
        log = w.log()
        assert (
            "--concurrency 10 needs up to 13 connections to database 'default' (main 1, "
            "heartbeat 1, listener 1, handlers 10)"
        ) in log, log
        assert (
            f"role '{role}' CONNECTION LIMIT allows 6 and other sessions hold 0: 6 free" in log
        ), log
        assert "Lower --concurrency to 3 or less" in log and "--skip-connection-check" in log, log
        assert not w.events("started")
        # --skip-connection-check starts it anyway (behind a pooler the server's limit is
        # not the worker's).
        w2 = workers.start(
            "budget-skipped",
            *FAST,
            "--concurrency",
            "10",
            "--skip-connection-check",
            env_extra={"LEASES_WORKER_DB_USER": role},
        )
        wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 10, "the job")
        w2.signal(signal.SIGTERM)
        assert w2.wait_exit() == 0


def connect_as(role: str):
    import psycopg

    db = connection.settings_dict
    return psycopg.connect(
        host=db["HOST"] or None,
        port=db["PORT"] or None,
        dbname=db["NAME"],
        user=role,
        autocommit=True,
    )


@pg_only
def test_a_worker_started_while_its_connection_limit_is_full_waits_then_starts(workers):
    """A database "full" for the worker's role refuses its first connection: it waits as
    for a database that is down, then checks its budget and starts once sessions close."""
    result = add.enqueue(6, 1)
    with limited_role(5) as role:
        others = [connect_as(role) for _ in range(5)]
        try:
            w = workers.start(
                "full-a",
                *FAST,
                "--concurrency",
                "1",
                ready=False,
                env_extra={"LEASES_WORKER_DB_USER": role},
            )
            wait = w.wait_event("db_wait", attempt=2, timeout=20)
            assert "too many connections for role" in wait["error"], wait
            assert w.proc.poll() is None, w.log()
        finally:
            for other in others:
                other.close()
        w.wait_event("started", timeout=30)
        wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 10, "the job")
        w.signal(signal.SIGTERM)
        assert w.wait_exit() == 0


@pg_only
def test_a_job_released_because_its_handler_could_not_connect_is_not_among_max_jobs(workers):
    """--max-jobs 1 with the handlers' share of the role's limit taken: the claim released
    unrun is not the worker's one job (it left with the job pending, status 0); once a
    connection is free it claims again, runs the job and leaves (3)."""
    with limited_role(4) as role:
        w = workers.start(
            "budget-max",
            *FAST,
            "--concurrency",
            "1",
            "--max-jobs",
            "1",
            env_extra={"LEASES_WORKER_DB_USER": role},
        )
        w.wait_event("listening")
        wait_for(lambda: sessions_of(role) == 3, 10, "the worker's three connections")
        other = connect_as(role)
        try:
            result = add.enqueue(2, 2)
            w.wait_event("paused", timeout=10)
            assert w.proc.poll() is None, w.log()[-3000:]
        finally:
            other.close()
        assert w.wait_exit(timeout=30) == 0, w.log()[-3000:]
    job = job_of(result)
    assert (job.state, job.result, job.attempts) == (JobState.SUCCEEDED, 4, 1), job.state
    assert w.events("max_jobs"), w.log()[-3000:]


@pg_only
def test_a_handler_that_cannot_connect_is_released_without_spending_an_attempt(workers):
    """The worker fits its role's limit at start (3 handlers + 3 = 6), then other sessions
    take the handlers' share: a handler that cannot open its connection is released, the
    attempt not counted and no failure recorded, and runs once a connection is free (3)."""
    with limited_role(6) as role:
        w = workers.start(
            "budget-full", *FAST, "--concurrency", "3", env_extra={"LEASES_WORKER_DB_USER": role}
        )
        w.wait_event("listening")
        # Main, heartbeat and listener connections, then others fill the role's limit.
        wait_for(lambda: sessions_of(role) == 3, 10, "the worker's three connections")
        others = [connect_as(role) for _ in range(3)]
        try:
            result = add.enqueue(4, 5)
            paused = w.wait_event("paused", timeout=10)
            assert "too many connections for role" in paused["error"], paused
            job = job_of(result)
            assert job.state in (JobState.PENDING, JobState.CLAIMED), job.state
            assert not JobFailure.objects.filter(job=job).exists()
        finally:
            for other in others:
                other.close()
        wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the job")
        job = job_of(result)
        # Every release gave its attempt back: the one that ran is the only one counted,
        # and none is among the releases at a stop (UNCOUNTED_RELEASES).
        assert (job.result, job.attempts) == (9, 1), (job.result, job.attempts, job.fence)
        assert job.releases == 0
        assert job.fence > 1
        assert not JobFailure.objects.filter(job=job).exists()
        w.signal(signal.SIGTERM)
        assert w.wait_exit() == 0
    assert Job.objects.filter(state=JobState.CLAIMED).count() == 0


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL/MariaDB's per-account limit")
def test_a_concurrency_past_max_user_connections_is_refused_on_mysql(workers):
    """MySQL/MariaDB: an account WITH MAX_USER_CONNECTIONS 5 cannot serve --concurrency 10
    (12 connections: no LISTEN there); refused with the numbers."""
    user = f"leases_budget_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as c:
        for host in ("%", "localhost"):
            c.execute(f"CREATE USER '{user}'@'{host}' WITH MAX_USER_CONNECTIONS 5")
            c.execute(f"GRANT ALL ON `{connection.settings_dict['NAME']}`.* TO '{user}'@'{host}'")
    try:
        w = workers.start(
            "budget-mysql",
            *FAST,
            "--concurrency",
            "10",
            ready=False,
            env_extra={"LEASES_WORKER_DB_USER": user},
        )
        assert w.wait_exit(timeout=30) == 1
        log = w.log()
        assert (
            "--concurrency 10 needs up to 12 connections to database 'default' (main 1, "
            "heartbeat 1, listener 0, handlers 10)"
        ) in log, log
        assert (
            "max_user_connections of " in log
            and "allows 5 and other sessions hold 0: 5 free" in log
        ), log
        assert "Lower --concurrency to 3 or less" in log, log
    finally:
        with connection.cursor() as c:
            for host in ("%", "localhost"):
                c.execute(f"DROP USER IF EXISTS '{user}'@'{host}'")
