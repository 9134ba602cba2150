"""Through PgBouncer in transaction pooling: what the pooled pass of tests/run.sh relies on,
the verbs with every statement free to land on another server session, and LISTEN on the
direct connection LISTEN_DATABASE names. LISTEN_DATABASE's validation runs everywhere.

The pooled pass (``LEASES_DATABASES=pgbouncer bash tests/run.sh``) sets
LEASES_POOLER_DIRECT_URL; elsewhere the tests that need the pooler skip.
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from django_leases.conf import OPTIONS, LeaseOptions, validate_options
from django_leases.exceptions import InvalidLeaseOption, LeaseLost
from django_leases.fencing import fenced
from django_leases.models import Job
from django_leases.states import JobState
from tests.testapp.models import Effect
from tests.testapp.tasks import add
from tests.worker_helpers import job_of, wait_for

POOLED = bool(os.environ.get("LEASES_POOLER_DIRECT_URL"))
needs_pooler = pytest.mark.skipif(
    not POOLED,
    reason="runs in the pass through PgBouncer: LEASES_DATABASES=pgbouncer bash tests/run.sh",
)


def _dsn(dbname: str | None = None) -> str:
    s = connection.settings_dict
    return (
        f"host={s['HOST']} port={s['PORT']} user={s['USER']} "
        f"dbname={dbname or s['NAME']} connect_timeout=5"
    )


def _admin(command: str) -> list[dict]:
    """Rows of a PgBouncer console command (SHOW ...), as dicts."""
    with (
        psycopg.connect(_dsn("pgbouncer"), autocommit=True, prepare_threshold=None) as admin,
        admin.cursor() as cursor,
    ):
        cursor.execute(command)
        names = [c.name for c in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


@needs_pooler
@pytest.mark.django_db
def test_the_pass_goes_through_a_transaction_pooler_that_moves_sessions():
    """Invariants 2 and 5 hold through a pooler only if this pass really goes through one:
    PgBouncer in transaction mode, and one client connection's transactions land on more
    than one server session, so anything kept in a session between transactions is lost."""
    config = {row["key"]: row["value"] for row in _admin("SHOW CONFIG")}
    assert config["pool_mode"] == "transaction", config["pool_mode"]
    pids: set[int] = set()
    with psycopg.connect(_dsn(), autocommit=True, prepare_threshold=None) as conn:
        # PgBouncer opens its min_pool_size server sessions within a second or so.
        wait_for(
            lambda: (
                pids.add(conn.execute("SELECT pg_backend_pid()").fetchone()[0]) or len(pids) > 1
            ),
            10,
            "a second server session",
        )
    # The negative control: a statement prepared in one transaction is gone in a later one.
    with (
        psycopg.connect(_dsn(), autocommit=True, prepare_threshold=0) as conn,
        pytest.raises(
            (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)
        ),
    ):
        for _ in range(40):
            conn.execute("SELECT pg_backend_pid()")


@needs_pooler
@pytest.mark.django_db(transaction=True)
def test_the_owner_verbs_need_no_session_of_their_own():
    """Invariants 2 and 5 through the pooler, each statement in its own transaction: enqueue,
    claim, renew, checkpoint and ack answer for the owner; after a takeover the stale
    claim's renew, checkpoint, fenced() block and ack are all refused."""
    job = Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])
    [first] = Job.objects.claim("pooled-a")
    assert first.pk == job.pk
    assert Job.objects.renew([first]) == {job.pk}
    assert Job.objects.checkpoint(first, {"done": 1}) is True
    Job.objects.filter(pk=job.pk).expire_now()
    [second] = Job.objects.claim("pooled-b")
    assert second.fence == first.fence + 1
    assert Job.objects.renew([first]) == set()
    assert Job.objects.checkpoint(first, {"done": 2}) is False
    assert Job.objects.ack(first, "stale") is False
    assert Job.objects.ack(second, 3) is True
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.result, stored.cursor) == (JobState.SUCCEEDED, 3, {"done": 1})


@needs_pooler
@pytest.mark.django_db(transaction=True)
def test_fenced_commits_through_the_pooler_only_for_the_owner():
    """Invariant 5: fenced()'s owner check and the handler's writes share one transaction,
    which the pooler keeps on one server session; a stale owner's block writes nothing."""
    from tests.test_fencing import handle_for

    Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])
    [job] = Job.objects.claim("pooled-f")
    with fenced(handle=handle_for(job)):
        Effect.objects.create(key="p", job_id=job.pk, fence=job.fence, worker_id="w", pid=1)
    Job.objects.filter(pk=job.pk).expire_now()
    Job.objects.claim("pooled-g")
    with pytest.raises(LeaseLost), fenced(handle=handle_for(job)):
        Effect.objects.create(key="q", job_id=job.pk, fence=job.fence, worker_id="w", pid=1)
    assert list(Effect.objects.values_list("key", flat=True)) == ["p"]


@needs_pooler
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_behind_the_pooler_listens_on_the_direct_database(workers):
    """Invariant 2 (the job still runs under its lease): with LISTEN_DATABASE naming a direct
    connection, the LISTEN session is not one of PgBouncer's server sessions, and an enqueue
    through the pooler wakes the worker long before its 30 s poll."""
    a = workers.start("pooled-listen", "--lease", "3", "--poll", "30")
    a.wait_event("listening")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = 'LISTEN \"django_leases\"'"
        )
        listeners = {pid for (pid,) in cursor.fetchall()}
    pooled = {row["remote_pid"] for row in _admin("SHOW SERVERS")}
    assert listeners and not listeners & pooled, (listeners, pooled)
    result = add.enqueue(20, 22)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the woken worker's job")
    assert job_of(result).result == 42
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@needs_pooler
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_behind_the_pooler_without_a_direct_connection_polls(workers):
    """Invariant 3: NOTIFY off and no LISTEN_DATABASE, the worker opens no LISTEN session and
    its polls through the pooler still run every job."""
    a = workers.start(
        "pooled-poll",
        "--lease",
        "3",
        "--poll",
        "0.3",
        notify=False,
        env_extra={"LEASES_WORKER_LISTEN_DIRECT": "0"},
    )
    results = [add.enqueue(i, 1) for i in range(5)]
    wait_for(lambda: all(job_of(r).state == JobState.SUCCEEDED for r in results), 20, "five jobs")
    assert not a.events("listening")
    assert [job_of(r).result for r in results] == [1, 2, 3, 4, 5]
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def _problems(value):
    return [p for p in validate_options({"LISTEN_DATABASE": value}) if p.option != "DATABASE"]


def test_listen_database_names_a_postgresql_alias():
    """Invariant 6: LISTEN_DATABASE is None or a PostgreSQL alias of DATABASES; anything
    else is refused with an error naming the field (an alias of another engine would never
    be woken)."""
    assert OPTIONS["LISTEN_DATABASE"].check_id == "django_leases.E019"
    assert _problems(None) == []
    [unknown] = _problems("nowhere")
    assert unknown.option == "LISTEN_DATABASE" and "settings.DATABASES" in unknown.reason
    on_postgres = connection.vendor == "postgresql"
    assert (_problems("queue") == []) is on_postgres
    options = LeaseOptions.from_dict({})
    assert options.listen_database == options.database
    if on_postgres:
        assert LeaseOptions.from_dict({"LISTEN_DATABASE": "queue"}).listen_database == "queue"
    else:
        with pytest.raises(InvalidLeaseOption, match="not a PostgreSQL database"):
            LeaseOptions.from_dict({"LISTEN_DATABASE": "queue"})


@given(
    st.one_of(
        st.text(max_size=20),
        st.integers(),
        st.lists(st.text(max_size=3), max_size=2),
        st.booleans(),
        st.floats(allow_nan=True),
    )
)
def test_any_listen_database_value_is_accepted_or_refused_by_name(value):
    """Invariant 6: whatever the setting holds, validation answers with problems naming
    LISTEN_DATABASE (or none, for an alias of a PostgreSQL database), never an exception."""
    problems = _problems(value)
    assert all(p.option == "LISTEN_DATABASE" for p in problems)
    assert len(problems) <= 1
    if value not in ("default", "queue"):
        assert problems
