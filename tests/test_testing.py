"""django_leases.testing: the helpers users call from their own suites, used for real."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django.db.models.functions import Now

from django_leases import testing
from django_leases.models import Job
from django_leases.states import JobState
from tests.testapp.tasks import add, boom

pytestmark = pytest.mark.django_db(transaction=True)


def test_run_burst_runs_due_jobs_through_the_real_claim_and_ack():
    """Invariants 2, 3: the job is claimed (fence 1) and acknowledged by its own claim."""
    result = add.enqueue(2, 3)
    testing.run_burst()
    job = testing.assert_ran_once(result)
    assert (job.result, job.claimed_by) == (5, "test-worker")


def test_run_burst_leaves_no_expired_claim_behind_a_higher_priority_job():
    """Invariant 3: a burst worker leaves only once a settling claim found nothing. Here its
    first claim takes the priority-10 job, and the claim woken by that handler's finish is,
    on PostgreSQL, one of due pending jobs only: without the settling claim before leaving,
    the expired claim stayed claimed by a worker that was gone."""
    gone = add.enqueue(1, 1)
    [claimed] = Job.objects.claim("gone-worker", lease=30)
    assert claimed.pk == int(gone.id) and testing.expire_lease(gone)
    first = add.using(priority=10).enqueue(2, 2)
    testing.run_burst()
    assert testing.assert_ran_once(first).result == 4
    job = Job.objects.get(pk=claimed.pk)
    assert (job.state, job.claimed_by, job.fence, job.result) == (
        JobState.SUCCEEDED,
        "test-worker",
        2,
        2,
    )


@pytest.mark.skipif(
    connection.vendor == "postgresql", reason="PostgreSQL claims in one statement: no race"
)
def test_a_burst_worker_whose_claim_lost_the_race_stays_while_jobs_are_claimable():
    """(3) On SQLite and MariaDB a claim reads its rows, then takes those still as read. A
    burst worker whose claim another took every row from (here: the row's fence moves
    between the read and the UPDATE, as another worker's claim moves it) has nothing yet
    while a job is still claimable: it stays and claims it (before: it left, "nothing
    claimable", with the job pending)."""
    result = add.enqueue(2, 3)
    raced = []

    def race(execute, sql, params, many, context):
        if not raced and sql.lstrip().upper().startswith("UPDATE") and "claim_token" in sql:
            raced.append(True)
            Job.objects.filter(pk=int(result.id)).update(fence=F("fence") + 1)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(race):
        testing.run_burst()
    assert raced
    job = Job.objects.get(pk=int(result.id))
    assert (job.state, job.result) == (JobState.SUCCEEDED, 5)


def test_assert_ran_once_fails_for_a_job_claimed_twice():
    """Invariant 4: a job whose lease ran out and that ran again is not 'ran once'."""
    result = add.enqueue(1, 1)
    Job.objects.claim("first", limit=1, lease=30)
    assert testing.expire_lease(result) is True
    testing.run_burst()
    job = Job.objects.get(pk=int(result.id))
    assert (job.state, job.fence, job.leases_lost) == (JobState.SUCCEEDED, 2, 1)
    with pytest.raises(AssertionError, match="claimed 2 times"):
        testing.assert_ran_once(result)


def test_expire_lease_makes_a_claim_claimable_and_the_stale_ack_is_refused():
    """Invariants 1, 5: the lease ends on the DB clock; the first claim's ack matches no row."""
    result = add.enqueue(4, 4)
    [stale] = Job.objects.claim("stale", limit=1, lease=30)
    assert testing.expire_lease(stale)
    job = testing.run_job(result)
    assert (job.state, job.fence) == (JobState.SUCCEEDED, 2)
    assert Job.objects.ack(stale, "late") is False
    assert testing.expire_lease(result) is False  # not claimed any more
    # The takeover's record says the lease was ended early, however long ago the last
    # renewal was (before: "lease of 9 s ran out" for a renewal 10 s old).
    [failure] = job.failures.all()
    assert failure.message == "lease was ended early, before stale acknowledged"
    again = add.enqueue(5, 5)
    [old] = Job.objects.claim("old", limit=1, lease=30)
    Job.objects.filter(pk=old.pk).update(heartbeat_at=Now() - timedelta(seconds=10))
    assert testing.expire_lease(again)
    job = testing.run_job(again)
    [failure] = job.failures.all()
    assert failure.message == "lease was ended early, before old acknowledged"


def test_assert_ran_once_reports_failures():
    """Invariant 3: a failing job is reported with its state and recorded failure."""
    result = boom.using_lease(max_attempts=1).enqueue()
    testing.run_burst()
    with pytest.raises(AssertionError, match="state is 'dead'"):
        testing.assert_ran_once(result)


def test_a_busy_workers_acks_ride_with_its_claims():
    """Invariant 3 at fewer commits: each batch of finished handlers is acknowledged in the
    statement (PostgreSQL) or the transaction (elsewhere) that claims the next jobs, never
    on its own; every job still succeeds once. In this process, so that the main thread's
    statements can be watched on its own connection."""
    from django.db import connection

    from django_leases import conf
    from django_leases.worker import Worker

    results = [add.enqueue(i, 1) for i in range(12)]
    # (is an ack, is a claim, the outermost transaction or None) per statement sent; a
    # claim's read of the due jobs counts as the claim (a portable claim that finds none
    # updates nothing).
    sent = []

    def watch(execute, sql, params, many, context):
        text = sql.lstrip()
        blocks = connection.atomic_blocks
        if text[:6].upper() in ("UPDATE", "WITH A", "WITH D", "SELECT"):
            ack = text[:6].upper() != "SELECT" and "finished_at" in text
            claim = (
                "claimed_by" in text
                if not text.upper().startswith("SELECT")
                else ("priority" in text and "DESC" in text)
            )
            sent.append((ack, claim, id(blocks[0]) if blocks else None))
        return execute(sql, params, many, context)

    options = conf.get_options("default")
    with connection.execute_wrapper(watch):
        Worker(
            alias="default",
            database=options.database,
            queues=conf.served_queues("default"),
            concurrency=3,
            heartbeat=conf.worker_heartbeat(options, None),
            # No settling claim falls due before the burst ends (but the one before leaving):
            # every claim after the first is one a finished handler woke.
            poll=30,
            burst=True,
            grace=0,
            notify=False,
            connect_handlers=False,
        ).run()
    for i, result in enumerate(results):
        assert testing.assert_ran_once(result).result == i + 1
    acks = [s for s in sent if s[0]]
    claims = {s[2] for s in sent if s[1] and s[2] is not None}
    assert len(acks) >= 4, sent  # 12 jobs, 3 at a time
    alone = [s for s in acks if not s[1] and (s[2] is None or s[2] not in claims)]
    assert alone == [], sent


def test_run_burst_leaves_no_handler_thread_or_connection_behind():
    """A user's test suite calls run_burst() again and again in one process: each call's
    handler thread ends and closes its connection before it returns. Before, one thread
    per call lived on holding a session (on PostgreSQL the test database could not be
    dropped at teardown: "being accessed by other users")."""
    import threading

    def handler_threads():
        return [t for t in threading.enumerate() if t.name.startswith("leases-handler")]

    before = handler_threads()
    sessions = _sessions()
    for i in range(3):
        add.enqueue(i, 1)  # add() reads the database (its handler opens a connection)
        testing.run_burst()
    assert handler_threads() == before
    assert _sessions() == sessions
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 3


def _sessions():
    """This database's sessions other than the test's own (PostgreSQL), else None."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"lease": 0}, "lease"),
        ({"lease": -1}, "lease"),
        ({"max_jobs": 0}, "max_jobs"),
        ({"max_jobs": -1}, "max_jobs"),
        ({"queues": "default"}, "queues"),
        ({"queues": ["nope"]}, "queues"),
        ({"backend": "immediate"}, "backend"),
        ({"worker_id": ""}, "worker_id"),
        ({"worker_id": "two\nlines"}, "worker_id"),
        ({"queues": ["*"]}, "queues"),
        ({"queues": [7]}, "queues"),
    ],
)
def test_run_burst_refuses_bad_arguments_naming_them(arguments, named):
    """(6) As run_lease_worker refuses its options: lease=0 spun forever at full CPU
    ("Heartbeat overdue ... lease 0 s"), a string of queues ran nothing, an unknown queue
    or max_jobs=0 returned silently; a worker id on two lines ran (the command refused
    it). Both check with one function (worker/options.py). Nothing is claimed."""
    from django_leases.exceptions import InvalidLeaseOption

    job = add.enqueue(1, 2)
    with pytest.raises(InvalidLeaseOption) as refused:
        testing.run_burst(**arguments)
    assert refused.value.option == named
    assert Job.objects.get(pk=job.id).state == JobState.PENDING


def test_run_burst_with_no_lease_backend_says_so():
    """Django's own test idiom, TASKS switched to its DummyBackend: a clear error, not a
    KeyError: None."""
    from django.test import override_settings

    from django_leases.exceptions import InvalidLeaseOption

    dummy = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}
    with (
        override_settings(TASKS=dummy),
        pytest.raises(InvalidLeaseOption, match="is not a django_leases backend"),
    ):
        testing.run_burst()


def test_ctrl_c_during_run_burst_reaches_the_test_runner():
    """run_burst() runs a worker, whose handlers make SIGINT and SIGTERM a graceful stop:
    Ctrl-C (or a CI's SIGTERM) during a burst stopped the burst and the test went on and
    passed, the runner never told. The burst stops as a worker does (its job released,
    pending again), then the signal goes on to the caller: KeyboardInterrupt here."""
    import os
    import signal
    import threading

    from tests.testapp.tasks import hold

    result = hold.enqueue(10)
    ctrl_c = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            testing.run_burst()
    finally:
        ctrl_c.join()
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.claimed_by) == (JobState.PENDING, "")


@pytest.mark.django_db(transaction=False)
def test_run_burst_inside_a_test_transaction_is_refused_with_the_fix():
    """Django's TestCase wraps each test in a transaction: the handler threads could not
    see what the test wrote (a job reading its Order failed) and its locks stalled them
    (SQLite: minutes of "database is locked"). It is refused, naming the transactional
    test to use; nothing is claimed."""
    from django.db.transaction import TransactionManagementError

    job = add.enqueue(1, 2)
    with pytest.raises(TransactionManagementError, match=r"django_db\(transaction=True\)"):
        testing.run_burst()
    assert Job.objects.get(pk=job.id).state == JobState.PENDING
