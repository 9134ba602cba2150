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
