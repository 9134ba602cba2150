"""The manager verbs: claims, renewals and every write out of 'claimed', by rowcount."""

from __future__ import annotations

import copy
import os
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from django_leases import enqueue as inserts
from django_leases.exceptions import InvalidJobArgument, InvalidLeaseOption
from django_leases.jsonsafe import ensure_json
from django_leases.models import Job, JobFailure, WorkerProcess
from django_leases.owner_writes import RecordedFailure
from django_leases.states import DeadReason, FailureKind, JobState
from django_leases.worker.listener import listen
from tests.worker_helpers import held_open

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"


def enqueue(**kw):
    return Job.objects.enqueue(TASK, kw.pop("args", [1, 2]), **kw)


def stale_copy(job):
    """The claim as its first owner remembers it, after someone else took the job over."""
    return copy.copy(job)


def db_now():
    return Job.objects.annotate(now=Now()).values_list("now", flat=True).first()


# -- enqueue ------------------------------------------------------------------------------


def test_enqueue_writes_a_pending_job_due_now_on_the_database_clock():
    """Invariant 1: enqueued_at and available_at come from the database clock."""
    job = enqueue()
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert job.enqueued_at == job.available_at
    assert job.lease_seconds == 30
    assert job.max_attempts == 5
    assert job.claim_token is None and job.fence == 0 and job.attempts == 0


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ([1, {2, 3}], {}, "args[1]"),
        ([], {"when": object()}, "kwargs['when']"),
        ([{"a": [1, float("nan")]}], {}, "args[0]['a'][1]"),
        ([{1: "x"}], {}, "args[0][1]"),
        # PostgreSQL's jsonb has no NUL; nothing stores a lone surrogate.
        (["a\x00b"], {}, "args[0]"),
        ([], {"k\x00": 1}, "kwargs['k\\x00']"),
        (["\ud800"], {}, "args[0]"),
    ],
)
def test_enqueue_refuses_what_json_would_change_and_names_it(args, kwargs, named):
    """Invariant 3: a refused job is refused whole, with the argument named; nothing written."""
    with pytest.raises(InvalidJobArgument) as info:
        Job.objects.enqueue(TASK, args, kwargs)
    assert info.value.path == named
    assert named in str(info.value)
    assert Job.objects.count() == 0


def test_enqueue_keeps_tuples_as_lists_like_django_tasks():
    job = Job.objects.enqueue(TASK, ((1, 2),), {"t": (3,)})
    job.refresh_from_db()
    assert job.args == [[1, 2]] and job.kwargs == {"t": [3]}


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("lease_seconds", {"lease_seconds": 0.5}),
        ("lease_seconds", {"lease_seconds": 12 * 3600 + 1}),
        ("max_attempts", {"max_attempts": 0}),
        ("priority", {"priority": 101}),
        ("queue_name", {"queue_name": ""}),
        ("delay", {"delay": -1}),
        ("lease_seconds", {"lease_seconds": float("nan")}),
        ("delay", {"delay": float("nan")}),
        ("retry.delays[0]", {"retry": [float("nan")]}),
        ("retry.delays[1]", {"retry": [10, 1e9]}),
        ("retry.factor", {"retry": {"factor": float("nan")}}),
    ],
)
def test_enqueue_refuses_bad_options_naming_the_field(field, kw):
    with pytest.raises(InvalidLeaseOption) as info:
        enqueue(**kw)
    assert info.value.option == field
    assert Job.objects.count() == 0


def test_enqueue_with_delay_is_not_claimable_until_the_database_clock_says_so():
    """Invariant 1: a delay counts from the database clock."""
    job = enqueue(delay=60)
    job.refresh_from_db()
    assert timedelta(seconds=59) < job.available_at - job.enqueued_at < timedelta(seconds=61)
    assert Job.objects.claim("w") == []


# -- enqueue: PostgreSQL's constant INSERT writes what the ORM writes ---------------------

on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="the constant INSERT is PostgreSQL's; elsewhere the ORM path runs",
)
AHEAD = timezone.now() + timedelta(hours=1)
OPTIONS = [
    {},
    {
        "queue_name": "emails",
        "priority": 7,
        "lease_seconds": 45,
        "max_attempts": 3,
        "retry": [5, 50],
        "on_lease_lost": "park",
    },
    {"delay": 60, "retry": {"base": 2, "factor": 3, "cap": 60, "jitter": 0}},
    {"delay": timedelta(seconds=1.25), "max_age": 3600, "on_lease_lost": "dead"},
    {"run_after": AHEAD, "deadline": AHEAD + timedelta(days=2), "priority": -100},
    {"unique_key": "invoice-7"},
]
ARGS = [1, "quote ' \" back \\ é ☃", {"nested": [1.5, None, True, 2**62]}, ()]
KWARGS = {"t": (3, 4), "n": None, "": {}}


def stored(pk, options):
    """Every column of job ``pk``; a time counted from the database clock as its distance
    from the INSERT's own clock (enqueued_at), so that two inserts can be compared."""
    row = Job.objects.filter(pk=pk).values().get()
    del row["id"]
    enqueued = row.pop("enqueued_at")
    if "run_after" not in options:
        row["available_at"] -= enqueued
    if "deadline" not in options:
        row["deadline"] -= enqueued
    return row


def in_memory(job):
    return {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}


def as_stored(job):
    return Job.objects.filter(pk=job.pk).values().get()


def insert_both_ways(insert_fast, insert_orm, options):
    """Insert with each path; return the stored rows. The first job is cancelled between the
    two, so that a unique key is free again for the second."""
    fast = insert_fast()
    fast_row, fast_job = stored(fast.pk, options), fast
    assert in_memory(fast) == as_stored(fast)
    Job.objects.filter(pk=fast.pk).cancel()
    orm = insert_orm()
    assert in_memory(orm) == as_stored(orm)
    return fast_row, stored(orm.pk, options), fast_job


@on_postgres
@pytest.mark.parametrize("options", OPTIONS)
def test_the_postgresql_insert_writes_the_row_the_orm_writes(options):
    """Every column but id and enqueued_at is the same, and the times counted from the
    database clock (delay, max_age, MAX_AGE_DAYS) are the same distance from the INSERT's
    own clock; the returned job holds the row as stored."""
    fields = inserts.EnqueueOptions(**options).check(TASK)
    args, kwargs = ensure_json(ARGS, "args"), ensure_json(KWARGS, "kwargs")
    fast, orm, job = insert_both_ways(
        lambda: inserts._pg_insert_one(Job, "default", fields, args, kwargs),
        lambda: inserts._insert_one(Job, "default", fields, args, kwargs),
        options,
    )
    assert fast == orm
    assert job.state == JobState.PENDING and job.args[1] == ARGS[1] and job.kwargs["t"] == [3, 4]


@on_postgres
@pytest.mark.parametrize("options", [o for o in OPTIONS if "unique_key" not in o])
def test_the_postgresql_bulk_insert_writes_the_rows_bulk_create_writes(options):
    fields = inserts.EnqueueOptions(**options).check(TASK)
    bounds: list[int] = []
    calls = inserts.checked_calls(
        [([i, *ARGS], {**KWARGS, "i": i}) for i in range(5)], bounds=bounds
    )

    def rows_of(jobs):
        return [stored(j.pk, options) for j in jobs]

    fast = inserts.insert_jobs(Job, "default", fields, calls, batch_size=2)
    orm = inserts._insert_many(Job, "default", fields, calls, bounds, batch_size=2)
    assert rows_of(fast) == rows_of(orm)
    assert [j.args[0] for j in fast] == list(range(5))  # in the order of the calls
    assert [in_memory(j) for j in fast] == [as_stored(j) for j in fast]


@on_postgres
def test_a_bulk_batch_past_the_json_document_limit_goes_in_halves_in_call_order(monkeypatch):
    """(3) PostgreSQL refuses a jsonb document past 256 MB, so a batch whose JSON passes
    CALLS_DOCUMENT_LIMIT is sent in halves (down to one call per statement): every job is
    written once, in the order of the calls, each with its own arguments."""
    from django.test.utils import CaptureQueriesContext

    fields = inserts.EnqueueOptions().check(TASK)
    calls = [([i, "x" * (i * 7)], {"i": i}) for i in range(7)]
    one_call = len(inserts.json.dumps([calls[-1]]))
    monkeypatch.setattr(inserts, "CALLS_DOCUMENT_LIMIT", 2 * one_call)
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        jobs = inserts.insert_jobs(Job, "default", fields, calls, batch_size=None)
    inserts_sent = [q for q in queries.captured_queries if "INSERT" in q["sql"]]
    assert 1 < len(inserts_sent) < len(calls)  # halves, not one statement per call
    assert [(j.args, j.kwargs) for j in jobs] == [(a, k) for a, k in calls]
    stored_rows = Job.objects.order_by("pk").values_list("pk", "args", "kwargs")
    assert list(stored_rows) == [(j.pk, j.args, j.kwargs) for j in jobs]


def test_the_rows_a_bulk_enqueue_answers_are_the_stored_ones():
    """What the Django Tasks backend reads back from a bulk enqueue (id, enqueued_at, args,
    kwargs), in the order of the calls, without model instances."""
    fields = inserts.EnqueueOptions(delay=5).check(TASK)
    rows = inserts.insert_job_rows(
        Job, "default", fields, [([i], {"k": (i,)}) for i in range(5)], batch_size=2
    )
    assert [(pk, enqueued_at) for pk, enqueued_at, _, _ in rows] == list(
        Job.objects.order_by("pk").values_list("pk", "enqueued_at")
    )
    assert [(args, kwargs) for _, _, args, kwargs in rows] == [([i], {"k": [i]}) for i in range(5)]


def test_enqueue_returns_the_job_as_stored_on_every_database():
    for options in OPTIONS:
        job = enqueue(args=ARGS, kwargs=KWARGS, **options)
        assert in_memory(job) == as_stored(job)
        assert not job._state.adding and job._state.db == "default"
        Job.objects.filter(pk=job.pk).cancel()


@pytest.mark.parametrize("options", OPTIONS[:5])
def test_enqueue_many_writes_what_enqueue_writes_on_every_database(options):
    one = enqueue(args=ARGS, kwargs=KWARGS, **options)
    [many] = Job.objects.enqueue_many(TASK, [(ARGS, KWARGS)], **options)
    assert stored(one.pk, options) == stored(many.pk, options)
    assert (many.args, many.kwargs) == (one.args, one.kwargs)


def test_the_database_clock_sets_the_due_time_and_the_deadline_of_a_bulk_enqueue():
    """Invariant 1: a delay counts from the database clock, and the deadline is
    MAX_AGE_DAYS from the due time so reached, however many rows one INSERT writes."""
    jobs = Job.objects.enqueue_many(TASK, [([i], {}) for i in range(3)], delay=30)
    for job in Job.objects.filter(pk__in=[j.pk for j in jobs]):
        assert job.deadline - job.available_at == timedelta(days=14)
        assert job.available_at - job.enqueued_at == timedelta(seconds=30)
    assert Job.objects.claim("w") == []


def test_a_refused_call_of_a_later_batch_writes_nothing():
    """Invariant 3: every call is checked before the first INSERT, so the batches before the
    bad call are not written either."""
    calls = [([i, i], {}) for i in range(5)]
    calls[3] = ([3, {1, 2}], {})
    with pytest.raises(InvalidJobArgument) as info:
        Job.objects.enqueue_many(TASK, calls, batch_size=2)
    assert info.value.path == "calls[3].args[1]"
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"priority": 101}, "priority"),
        ({"delay": -1}, "delay"),
        ({"max_age": "long"}, "max_age"),
        ({"unique_key": "k"}, "unique_key"),
    ],
)
def test_enqueue_many_refuses_bad_options_naming_the_field(kw, named):
    with pytest.raises(InvalidLeaseOption) as info:
        Job.objects.enqueue_many(TASK, [([1], {})], **kw)
    assert info.value.option == named
    assert Job.objects.count() == 0


def test_enqueue_many_refuses_a_batch_size_that_is_not_positive():
    with pytest.raises(ValueError, match="batch_size"):
        Job.objects.enqueue_many(TASK, [([1], {})], batch_size=0)
    assert Job.objects.count() == 0
    assert len(Job.objects.enqueue_many(TASK, [([i], {}) for i in range(3)], batch_size=None)) == 3


def test_an_unknown_enqueue_option_is_a_type_error():
    with pytest.raises(TypeError, match="colour"):
        Job.objects.enqueue(TASK, [1], colour="red")
    assert Job.objects.count() == 0


@on_postgres
def test_a_held_unique_key_leaves_the_callers_transaction_usable_without_a_savepoint():
    """On PostgreSQL the INSERT skips a held key (ON CONFLICT DO NOTHING): no error, so the
    caller's transaction goes on, and the second enqueue sends no SAVEPOINT."""
    from django.test.utils import CaptureQueriesContext

    from django_leases.exceptions import DuplicateJob

    first = enqueue(unique_key="k")
    with transaction.atomic(), CaptureQueriesContext(connection) as sent:
        with pytest.raises(DuplicateJob):
            enqueue(unique_key="k")
        assert enqueue(unique_key="k", on_duplicate="merge").pk == first.pk
        assert Job.objects.count() == 1
    assert [q["sql"].split()[0] for q in sent] == ["INSERT", "SELECT", "INSERT", "SELECT", "SELECT"]


@on_postgres
@pytest.mark.skipif(
    bool(os.environ.get("LEASES_POOLER_DIRECT_URL")),
    reason="LISTEN needs a session of its own: through a transaction pooler it hears nothing "
    "(tests/test_pooler.py listens on the direct connection)",
)
@pytest.mark.django_db(transaction=True)
def test_both_postgresql_inserts_still_wake_listeners():
    """The statement trigger (migration 0002) sends one NOTIFY per queue and INSERT, whether
    one job or a bulk enqueue wrote it, when the inserting transaction commits."""
    listener = listen("default")
    try:
        with transaction.atomic():
            # Two INSERTs of one queue in one transaction: PostgreSQL folds their NOTIFYs.
            Job.objects.enqueue_many(
                TASK, [([i], {}) for i in range(3)], queue_name="reports", batch_size=2
            )
            assert list(listener.notifies(timeout=0.2)) == []  # nothing before the commit
        enqueue(queue_name="emails")
        payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
    finally:
        listener.close()
    assert payloads == ["reports", "emails"]


# -- claim --------------------------------------------------------------------------------


def test_claim_gives_a_fresh_token_fence_and_lease_from_the_database_clock():
    """Invariants 1 and 2: the lease ends at Now() + lease on the database clock."""
    enqueue(lease_seconds=45)
    [job] = Job.objects.claim("w1")
    assert job.state == JobState.CLAIMED
    assert isinstance(job.claim_token, uuid.UUID)
    assert (job.fence, job.attempts, job.claimed_by) == (1, 1, "w1")
    stored = Job.objects.get(pk=job.pk)
    assert stored.claim_token == job.claim_token
    assert stored.lease_expires_at - stored.heartbeat_at == timedelta(seconds=45)
    assert stored.started_at == stored.last_attempted_at == stored.heartbeat_at
    # The returned instance loads the database's lease end, never a local guess.
    assert job.lease_expires_at == stored.lease_expires_at


@pytest.mark.django_db(transaction=True)
def test_nothing_of_claim_rows_can_fail_after_its_claim_has_committed():
    """Invariant 3: a claim that committed is answered; a statement after the commit could
    fail (a dropped connection) and leave the row claimed, its attempt spent, unrun."""
    enqueue()
    claimed_at_commit: list[bool] = []

    def outage_once_claimed(execute, sql, params, many, context):
        if claimed_at_commit and not connection.in_atomic_block:
            raise OperationalError("connection dropped (injected after the claim committed)")
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith(("UPDATE", "WITH")) and "claim_token" in sql:
            claimed_at_commit.append(True)
        return result

    with connection.execute_wrapper(outage_once_claimed):
        [row] = Job.objects.claim_rows("w")
    assert claimed_at_commit
    stored = Job.objects.get(pk=row.pk)
    assert (stored.state, stored.claim_token, stored.attempts) == (
        JobState.CLAIMED,
        row.claim_token,
        1,
    )
    assert (row.started_at, row.last_attempted_at) == (stored.started_at, stored.last_attempted_at)


@pytest.mark.django_db(transaction=True)
def test_ack_and_claim_rows_acks_the_owners_and_claims_the_due_in_one_commit():
    """Invariants 2 and 5: the owner's ack lands, a stale owner's is rejected and the due
    jobs are claimed, all in one statement on PostgreSQL and one transaction elsewhere."""
    from django.test.utils import CaptureQueriesContext

    for _ in range(4):
        enqueue()
    mine, theirs = Job.objects.claim_rows("w1", limit=2)
    stale = stale_copy(theirs)
    stale.claim_token = uuid.uuid4()
    # The outermost transaction each statement ran in (None: its own, autocommit).
    transactions = []

    def watch(execute, sql, params, many, context):
        if sql.lstrip()[:6].upper() in ("SELECT", "UPDATE", "INSERT", "WITH A"):
            blocks = connection.atomic_blocks
            transactions.append(id(blocks[0]) if blocks else None)
        return execute(sql, params, many, context)

    with CaptureQueriesContext(connection) as sent, connection.execute_wrapper(watch):
        acked, claimed = Job.objects.ack_and_claim_rows(
            [(mine, {"n": 1}), (stale, 2)], "w2", limit=5
        )
    assert acked == {mine.pk}
    assert Job.objects.get(pk=mine.pk).state == JobState.SUCCEEDED
    assert Job.objects.get(pk=mine.pk).result == {"n": 1}
    stored = Job.objects.get(pk=theirs.pk)
    assert (stored.state, stored.claim_token, stored.claimed_by) == (
        JobState.CLAIMED,
        theirs.claim_token,
        "w1",
    )
    assert len(claimed) == 2 and {r.claimed_by for r in claimed} == {"w2"}
    assert {r.was_state for r in claimed} == {"pending"}
    for row in claimed:
        assert Job.objects.get(pk=row.pk).claim_token == row.claim_token
    if connection.vendor == "postgresql":
        assert len(sent.captured_queries) == 1, sent.captured_queries
    else:
        assert len(sent.captured_queries) > 2, sent.captured_queries
        assert len(set(transactions)) == 1 and None not in transactions, sent.captured_queries
    # Nothing due: the acks still land, and nothing is claimed.
    acked, claimed = Job.objects.ack_and_claim_rows([(r, None) for r in claimed], "w2", limit=3)
    assert len(acked) == 2 and claimed == []


def test_a_refused_ack_and_claim_writes_neither():
    """Invariant 3: a result JSON cannot hold refuses the whole call before anything is
    sent: no ack, no claim. (A result the database itself refuses fails the one statement
    or transaction whole: tests/test_hostile_handlers.py drives the worker through it.)"""
    enqueue()
    enqueue()
    [job] = Job.objects.claim_rows("w")
    with pytest.raises(InvalidJobArgument, match="result"):
        Job.objects.ack_and_claim_rows([(job, object())], "w", limit=1)
    assert Job.objects.get(pk=job.pk).state == JobState.CLAIMED
    assert Job.objects.filter(state=JobState.PENDING).count() == 1


def test_claim_orders_by_priority_then_due_time_and_respects_limit_and_queue():
    low = enqueue(priority=-5)
    first = enqueue()
    second = enqueue()
    high = enqueue(priority=50)
    enqueue(queue_name="other", priority=100)
    claimed = Job.objects.claim("w", ["default"], limit=3)
    assert [j.pk for j in claimed] == [high.pk, first.pk, second.pk]
    assert [j.pk for j in Job.objects.claim("w", ["default"], limit=5)] == [low.pk]


def test_a_valid_lease_is_never_claimed_twice():
    """Invariant 4: while the lease is valid, no second claim."""
    enqueue()
    assert len(Job.objects.claim("w1")) == 1
    assert Job.objects.claim("w2") == []


def test_an_expired_claim_is_taken_over_and_the_old_token_can_do_nothing():
    """Invariants 2, 4 and 5: after expiry the job is claimed again; the stale owner's
    renew, ack, fail, release and checkpoint all answer False and change nothing."""
    enqueue()
    [old] = Job.objects.claim("w1")
    assert Job.objects.filter(pk=old.pk).expire_now() == 1
    [new] = Job.objects.claim("w2")
    assert new.pk == old.pk and new.claim_token != old.claim_token
    assert (new.fence, new.attempts) == (2, 2)
    before = Job.objects.filter(pk=old.pk).values().get()

    assert Job.objects.renew([old]) == set()
    assert Job.objects.ack(old, "stale") is False
    assert Job.objects.fail(old, message="stale") is None
    assert Job.objects.release(old) is False
    assert Job.objects.checkpoint(old, {"at": 99}) is False

    assert Job.objects.filter(pk=old.pk).values().get() == before
    assert Job.objects.renew([new]) == {new.pk}
    assert Job.objects.ack(new, "fresh") is True
    done = Job.objects.get(pk=old.pk)
    assert (done.state, done.result, done.leases_lost) == (JobState.SUCCEEDED, "fresh", 1)
    [lost] = JobFailure.objects.filter(job=done)
    assert (lost.kind, lost.attempt, lost.fence, lost.worker_id) == (
        FailureKind.LEASE_EXPIRED,
        1,
        1,
        "w1",
    )


def test_renew_is_one_statement_for_many_claims_and_reports_which_are_held():
    """Invariant 2: the ids missing from the answer are the lost claims."""
    for _ in range(5):
        enqueue()
    claims = Job.objects.claim("w", limit=5)
    Job.objects.filter(pk=claims[0].pk).cancel()
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as ctx:
        held = Job.objects.renew(claims)
    assert held == {c.pk for c in claims[1:]}
    # On PostgreSQL one UPDATE behind a WITH that locks the rows no transaction holds.
    updates = [
        q for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith(("UPDATE", "WITH"))
    ]
    assert len(updates) == 1


@pytest.mark.django_db(transaction=True)
def test_a_renewal_skips_a_row_a_transaction_holds_and_reads_it_back_as_held():
    """Invariant 2 on PostgreSQL: a row locked by a transaction still open (a handler's
    fenced() block) is skipped by the heartbeat's renewal (skip_locked), not waited for (the
    renewal of every other claim waited behind it); held_by_their_claims() reads it back as
    still held, by a plain read that waits for no lock. A cancelled claim is neither renewed
    nor held. The default renewal (fenced()'s own, at the end of its block) still waits."""
    if connection.vendor != "postgresql":
        pytest.skip("the renewal skips locked rows on PostgreSQL; elsewhere it waits")
    for _ in range(3):
        enqueue(lease_seconds=10)
    locked, free, cancelled = Job.objects.claim("w", limit=3)
    Job.objects.filter(pk=cancelled.pk).cancel()
    with held_open(lambda: Job.objects.checkpoint(locked, {"at": 1})):
        claims = [locked, free, cancelled]
        assert Job.objects.renew(claims, skip_locked=True) == {free.pk}
        assert Job.objects.held_by_their_claims([locked, free, cancelled]) == {locked.pk, free.pk}
    assert Job.objects.renew([locked, free, cancelled]) == {locked.pk, free.pk}
    assert Job.objects.get(pk=locked.pk).cursor == {"at": 1}


def test_a_renewal_miss_is_read_back_as_the_claims_own_ack_only_at_its_fence():
    """Invariant 2 and 5: of the claims a renewal missed, only a job that succeeded at the
    claim's own fence was acknowledged by that claim; cancelled, or taken over and acked by
    the next claim, it is lost."""
    for _ in range(3):
        enqueue(lease_seconds=10)
    own, cancelled, taken = Job.objects.claim("w", limit=3)
    assert Job.objects.ack(own, {"ok": 1})
    Job.objects.filter(pk=cancelled.pk).cancel()
    Job.objects.filter(pk=taken.pk).expire_now()
    [again] = Job.objects.claim("other", settle=True)
    assert (again.pk, again.fence) == (taken.pk, taken.fence + 1)
    assert Job.objects.ack(again)
    assert Job.objects.renew([own, cancelled, taken]) == set()
    assert Job.objects.acked_by_their_claims([own, cancelled, taken]) == {own.pk}
    assert Job.objects.acked_by_their_claims([]) == set()


def test_renew_moves_the_lease_forward_on_the_database_clock():
    """Invariant 1: the renewed lease ends lease_seconds after the renewal's Now()."""
    enqueue(lease_seconds=10)
    [job] = Job.objects.claim("w")
    Job.objects.filter(pk=job.pk).update(lease_expires_at=Now())
    assert Job.objects.renew([job]) == {job.pk}
    stored = Job.objects.get(pk=job.pk)
    assert stored.lease_expires_at - stored.heartbeat_at == timedelta(seconds=10)


def test_renew_of_an_expired_but_untaken_claim_keeps_it():
    """Invariant 2: ownership is the rowcount, not the clock: nobody else claimed it."""
    enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.filter(pk=job.pk).expire_now()
    assert Job.objects.renew([job]) == {job.pk}
    assert Job.objects.claim("other") == []


def test_release_returns_the_job_without_counting_the_attempt():
    enqueue()
    [job] = Job.objects.claim("w")
    assert Job.objects.release(job) is True
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.attempts, stored.fence, stored.claim_token) == (
        JobState.PENDING,
        0,
        1,
        None,
    )
    [again] = Job.objects.claim("w2")
    assert (again.attempts, again.fence) == (1, 2)


def test_releases_at_stops_are_bounded_and_a_checkpoint_starts_the_count_again():
    """A job whose handler stops its own worker (a signal to it, the memory that gets its
    pod evicted) was given back at every stop, its attempt never counted: workers restarted
    forever and the job never ended (3). After UNCOUNTED_RELEASES releases at a stop with
    no checkpoint moving its cursor between, release(at_stop=True) refuses, the claim
    untouched, and over_release_limit() says why (the worker fails the attempt instead). A
    checkpoint that moves the cursor starts the count again, one that saves it again does
    not; another release (a handler that could not connect: not the job's doing) is not
    counted."""
    from django_leases import conf

    enqueue()
    for n in range(conf.UNCOUNTED_RELEASES):
        [job] = Job.objects.claim("w")
        if n == 3:  # the same cursor saved again (a keepalive) is no progress
            assert Job.objects.checkpoint(job, None, moved=False) is True
        assert Job.objects.release(job, at_stop=True) is True
        stored = Job.objects.get(pk=job.pk)
        assert (stored.state, stored.attempts, stored.releases) == (JobState.PENDING, 0, n + 1)
    [job] = Job.objects.claim("w")
    assert Job.objects.release(job) is True  # not at a stop: not counted
    assert Job.objects.get(pk=job.pk).releases == conf.UNCOUNTED_RELEASES
    [job] = Job.objects.claim("w")
    assert Job.objects.release(job, at_stop=True) is False
    assert Job.objects.over_release_limit(job) is True
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.claim_token, stored.attempts) == (
        JobState.CLAIMED,
        job.claim_token,
        1,
    )
    assert Job.objects.checkpoint(job, {"done_up_to": 7}) is True
    assert Job.objects.get(pk=job.pk).releases == 0
    assert Job.objects.over_release_limit(job) is False
    assert Job.objects.release(job, at_stop=True) is True
    assert Job.objects.get(pk=job.pk).releases == 1
    assert Job.objects.over_release_limit(job) is False  # a claim no longer held


def test_fail_retries_until_max_attempts_then_dead_letters_with_history():
    """Invariant 3: a failing job ends dead, each attempt recorded, never lost."""
    enqueue(max_attempts=2)
    [job] = Job.objects.claim("w1")
    # fail() says where the job went: the worker logs a retry and a dead letter apart.
    assert Job.objects.fail(
        job,
        exception_class_path="builtins.ValueError",
        message="boom",
        traceback="Traceback ...",
        retry_in=0,
    ) == RecordedFailure(attempt=1, state=JobState.PENDING, dead_reason="", retry_in=0.0)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    [job] = Job.objects.claim("w2")
    assert Job.objects.fail(
        job, exception_class_path="builtins.KeyError", message="again"
    ) == RecordedFailure(
        attempt=2, state=JobState.DEAD, dead_reason=DeadReason.ATTEMPTS, retry_in=None
    )
    dead = Job.objects.get(pk=job.pk)
    assert dead.state == JobState.DEAD and dead.finished_at is not None
    history = list(
        dead.failures.values_list("attempt", "fence", "worker_id", "exception_class_path")
    )
    assert history == [(1, 1, "w1", "builtins.ValueError"), (2, 2, "w2", "builtins.KeyError")]


def test_fail_with_retry_delay_counts_on_the_database_clock():
    """Invariant 1: the retry is due retry_in seconds after the database's Now()."""
    enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="later", retry_in=120)
    stored = Job.objects.get(pk=job.pk)
    failure = stored.failures.get()
    assert (
        timedelta(seconds=119) < stored.available_at - failure.recorded_at < timedelta(seconds=121)
    )
    assert Job.objects.claim("w") == []


def test_fail_without_retry_goes_straight_to_dead():
    enqueue(max_attempts=5)
    [job] = Job.objects.claim("w")
    assert Job.objects.fail(job, message="unrunnable", retry=False, kind=FailureKind.UNRUNNABLE)
    assert Job.objects.get(pk=job.pk).state == JobState.DEAD


def test_an_expired_claim_with_no_attempts_left_is_dead_lettered_not_claimed():
    """Invariant 3: a job that keeps killing its worker ends dead instead of looping."""
    enqueue(max_attempts=1)
    [job] = Job.objects.claim("w1")
    Job.objects.filter(pk=job.pk).expire_now()
    assert Job.objects.claim("w2") == []
    dead = Job.objects.get(pk=job.pk)
    assert (dead.state, dead.leases_lost, dead.claim_token) == (JobState.DEAD, 1, None)
    assert dead.failures.get().kind == FailureKind.LEASE_EXPIRED
    assert Job.objects.ack(job) is False


def test_ack_refuses_a_result_json_cannot_hold_and_keeps_the_claim():
    """Invariant 3: nothing is written; the owner can still fail the job."""
    enqueue()
    [job] = Job.objects.claim("w")
    with pytest.raises(InvalidJobArgument, match="result"):
        Job.objects.ack(job, object())
    assert Job.objects.get(pk=job.pk).state == JobState.CLAIMED
    assert Job.objects.fail(job, message="bad result") is not None


def test_checkpoint_stores_the_cursor_and_renews_for_the_owner_only():
    """Invariants 2 and 5: a checkpoint is a conditional write."""
    enqueue()
    [job] = Job.objects.claim("w")
    assert Job.objects.checkpoint(job, {"after_id": 42}) is True
    assert Job.objects.get(pk=job.pk).cursor == {"after_id": 42}
    intruder = copy.copy(job)
    intruder.claim_token = uuid.uuid4()
    assert Job.objects.checkpoint(intruder, {"after_id": 0}) is False
    assert Job.objects.get(pk=job.pk).cursor == {"after_id": 42}


# -- operator actions ----------------------------------------------------------------------


def test_cancel_of_a_claimed_job_makes_its_owner_lose_at_the_next_renewal():
    """Invariant 2: cancel is seen by the owner as a renewal that touches no row."""
    enqueue()
    enqueue()
    [job] = Job.objects.claim("w")
    assert Job.objects.all().cancel() == 2
    assert Job.objects.renew([job]) == set()
    assert Job.objects.ack(job) is False
    assert Job.objects.all().cancel() == 0


def test_requeue_puts_dead_and_cancelled_back_and_says_how_many():
    """Attempts reset, and the releases at a stop with them: a job dead of too many
    (ReleasedTooOften) starts afresh at stops too."""
    enqueue(max_attempts=1)
    enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="x")
    Job.objects.filter(pk=job.pk).update(releases=10)
    Job.objects.filter(state=JobState.PENDING).cancel()
    assert Job.objects.all().requeue() == 2
    assert set(Job.objects.values_list("state", "attempts", "releases")) == {
        (JobState.PENDING, 0, 0)
    }


def test_requeue_keeping_attempts_leaves_room_for_one_more_try():
    enqueue(max_attempts=1)
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="x")
    assert Job.objects.all().requeue(reset_attempts=False) == 1
    stored = Job.objects.get()
    assert (stored.attempts, stored.max_attempts) == (1, 2)
    [again] = Job.objects.claim("w")
    assert again.attempts == 2


def ended_with_key(key, state=JobState.CANCELLED):
    job = enqueue(unique_key=key)
    Job.objects.filter(pk=job.pk).cancel()
    if state == JobState.DEAD:
        Job.objects.filter(pk=job.pk).update(state=JobState.DEAD)
    return job


def test_requeue_of_jobs_sharing_a_unique_key_puts_the_newest_back_and_leaves_the_rest():
    """Invariant 3: two ended jobs of one unique key, requeued together, made one UPDATE
    give both the key the unique active_key allows one active job to hold: an
    IntegrityError, nothing requeued (a 500 in the admin). The newest of each key goes
    back; the others stay ended, as a job whose key an active job holds does; jobs
    without a key all go back."""
    older = ended_with_key("nightly", JobState.DEAD)
    newer = ended_with_key("nightly")
    alone = ended_with_key("weekly", JobState.DEAD)
    unkeyed = [enqueue(), enqueue()]
    Job.objects.filter(pk__in=[j.pk for j in unkeyed]).cancel()
    held = ended_with_key("held")
    enqueue(unique_key="held")
    assert Job.objects.all().requeue() == 4
    state = dict(Job.objects.values_list("pk", "state"))
    assert [state[j.pk] for j in (older, newer, alone, *unkeyed, held)] == [
        JobState.DEAD,
        JobState.PENDING,
        JobState.PENDING,
        JobState.PENDING,
        JobState.PENDING,
        JobState.CANCELLED,
    ]
    # Again: every key is held now, and the unkeyed jobs are pending.
    assert Job.objects.all().requeue() == 0


@pytest.mark.django_db(transaction=True)
def test_a_key_enqueued_while_requeue_runs_keeps_its_ended_job_and_not_the_others():
    """Invariant 3: a job enqueued with a key after requeue() read the keys held (not yet
    committed then) made requeue's UPDATE wait on it and then fail on the unique
    active_key. Only that key's ended job stays; the other keys' jobs go back."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's IMMEDIATE transactions take turns: no lock to wait on")
    taken, free = ended_with_key("taken"), ended_with_key("free")
    outcome = []

    def requeue():
        try:
            outcome.append(Job.objects.all().requeue())
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            outcome.append(e)
        finally:
            connection.close()

    with held_open(lambda: enqueue(unique_key="taken")) as held:
        requeuer = threading.Thread(target=requeue)
        requeuer.start()
        # Without this wait the test could pass with no race at all.
        assert held.until_it_blocks_another(), "the requeue never waited: no race"
    requeuer.join(30)
    assert outcome == [1]
    state = dict(Job.objects.values_list("pk", "state"))
    assert (state[taken.pk], state[free.pk]) == (JobState.CANCELLED, JobState.PENDING)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("on_duplicate", ["refuse", "merge"])
def test_a_key_taken_after_a_repeatable_read_transaction_began_is_a_duplicate(on_duplicate):
    """Under REPEATABLE READ (MariaDB's own default when set in OPTIONS), a key another
    session took and committed after the caller's transaction began: the INSERT
    conflicted, the plain read of the holder saw the transaction's old snapshot, and
    after three tries enqueue raised IntegrityError "kept conflicting; try again". The
    holder is read with a locking read: DuplicateJob naming it, or the job to merge into."""
    if connection.vendor != "mysql":
        pytest.skip("a plain read of MySQL's REPEATABLE READ keeps its snapshot")
    from django_leases.exceptions import DuplicateJob

    enqueue()
    [running] = Job.objects.claim("w-other")
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    taken, renewed = [], []

    def take():
        taken.append(enqueue(unique_key="rr"))
        connection.close()

    def renew_the_other_claim():
        # The locking read must lock the holder alone, not every job it scanned: another
        # worker's renewal goes through while the caller's transaction is still open.
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 2")
        try:
            renewed.append(Job.objects.renew([running]))
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            renewed.append(e)
        finally:
            connection.close()

    try:
        with transaction.atomic():
            assert not Job.objects.filter(unique_key="rr").exists()  # the snapshot begins
            other = threading.Thread(target=take)
            other.start()
            other.join(30)
            [holder] = taken
            if on_duplicate == "merge":
                assert enqueue(unique_key="rr", on_duplicate="merge").pk == holder.pk
            else:
                with pytest.raises(DuplicateJob) as refused:
                    enqueue(unique_key="rr")
                assert str(holder.pk) in str(refused.value)
            renewer = threading.Thread(target=renew_the_other_claim)
            renewer.start()
            renewer.join(30)
            assert renewed == [{running.pk}]
    finally:
        connection.close()  # the next session reads committed again
    assert Job.objects.filter(unique_key="rr").count() == 1


def test_lease_views_split_claimed_jobs_into_healthy_stalled_and_expired():
    """Invariant 1: the views compare with the database clock only."""
    enqueue()
    enqueue()
    enqueue()
    a, b, c = Job.objects.claim("w", limit=3)
    Job.objects.filter(pk=b.pk).update(heartbeat_at=Now() - timedelta(seconds=25))
    Job.objects.filter(pk=c.pk).expire_now()
    # Heartbeat every 10 s: b, silent for 25 s, is stalled (more than two periods).
    status = dict(
        Job.objects.with_lease_status(heartbeat_seconds=10).values_list("pk", "lease_status")
    )
    assert status == {a.pk: "healthy", b.pk: "stalled", c.pk: "expired"}
    assert set(Job.objects.stalled_claims(heartbeat_seconds=10).values_list("pk", flat=True)) == {
        b.pk
    }
    assert set(Job.objects.expired().values_list("pk", flat=True)) == {c.pk}


def test_stalled_and_gone_are_judged_by_the_heartbeat_each_worker_registered():
    """Invariant 4: a worker started with ``--heartbeat 60`` while the settings the admin
    reads say 10 is live after 30 s of silence, and its claim healthy: "Expire stalled
    claims now" must not end a running handler's lease. Past two of its own periods it is
    gone. A claim whose worker has no row is judged by the period the caller gives."""
    for worker_id, beat in (("slow", 60.0), ("quick", 10.0)):
        WorkerProcess.objects.register(
            worker_id,
            instance=worker_id,
            hostname="h",
            pid=1,
            queues=["*"],
            heartbeat_seconds=beat,
        )
    claims = {}
    for worker_id in ("slow", "quick", "no-row"):
        enqueue()
        [claims[worker_id]] = Job.objects.claim(worker_id)

    def silence(seconds):
        WorkerProcess.objects.update(last_seen_at=Now() - timedelta(seconds=seconds))
        Job.objects.update(heartbeat_at=Now() - timedelta(seconds=seconds))

    def stalled(period=10):
        by_pk = {job.pk: w for w, job in claims.items()}
        return {by_pk[pk] for pk in Job.objects.stalled_claims(period).values_list("pk", flat=True)}

    silence(30)
    assert set(WorkerProcess.objects.gone().values_list("worker_id", flat=True)) == {"quick"}
    assert stalled() == {"quick", "no-row"}
    assert stalled(period=60) == {"quick"}
    status = dict(Job.objects.with_lease_status(10).values_list("pk", "lease_status"))
    assert status[claims["slow"].pk] == "healthy"
    assert Job.objects.expire_stalled_now(10) == 2
    assert Job.objects.lease_valid().get().pk == claims["slow"].pk
    silence(122)
    assert set(WorkerProcess.objects.gone().values_list("worker_id", flat=True)) == {
        "slow",
        "quick",
    }
    assert stalled() == {"slow"}


def test_a_0_1_0_workers_row_is_judged_by_the_settings_heartbeat(settings):
    """Invariant 4: a 0.1.0 worker writes no period, and the database fills in 10 s. With a
    300 s lease (a 100 s heartbeat) it read as gone after 20 s and its claims as stalled
    while a rolling upgrade ran, and "Expire stalled claims now" ended them. Its row is
    judged by the settings' period, as every row was before."""
    default = settings.TASKS["default"]
    settings.TASKS = {**settings.TASKS, "default": {**default, "OPTIONS": {"LEASE_SECONDS": 300}}}
    WorkerProcess.objects.create(worker_id="old", hostname="h", pid=1)  # as 0.1.0 inserts
    assert WorkerProcess.objects.values_list("instance", "heartbeat_seconds").get() == ("", 10.0)
    enqueue()
    Job.objects.claim("old")

    def silence(seconds):
        WorkerProcess.objects.update(last_seen_at=Now() - timedelta(seconds=seconds))
        Job.objects.update(heartbeat_at=Now() - timedelta(seconds=seconds))

    silence(30)
    assert not WorkerProcess.objects.gone().exists()
    assert not Job.objects.stalled_claims(100).exists()
    silence(202)
    assert WorkerProcess.objects.gone().exists()
    assert Job.objects.stalled_claims(100).exists()


def test_prune_deletes_only_finished_jobs_past_retention():
    enqueue()
    done = enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.ack(job)
    Job.objects.filter(pk=job.pk).update(finished_at=Now() - timedelta(days=20))
    assert Job.objects.all().prune(older_than_days=14) == 1
    assert Job.objects.filter(pk=done.pk).exists()


def test_the_claimed_state_cannot_exist_without_a_lease():
    """Invariant 2: a database constraint backs the manager."""
    from django.db import IntegrityError, transaction

    job = enqueue()
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(state=JobState.CLAIMED, attempts=F("attempts") + 1)


def test_each_claim_is_renewed_by_its_own_lease_in_one_statement():
    """Invariant 1: claims held under different leases keep their own, on the DB clock."""
    from django_leases.api import _ClaimRef

    enqueue(lease_seconds=10)
    enqueue(lease_seconds=50)
    short, long_ = Job.objects.claim("w", limit=2)
    # A worker's --lease override travels with the claim, not with the row.
    refs = [
        _ClaimRef(short.pk, short.claim_token, 4.0),
        _ClaimRef(long_.pk, long_.claim_token, 50.0),
    ]
    assert Job.objects.renew(refs) == {short.pk, long_.pk}
    ends = {j.pk: j.lease_expires_at - j.heartbeat_at for j in Job.objects.all()}
    assert ends == {short.pk: timedelta(seconds=4), long_.pk: timedelta(seconds=50)}


def test_an_owner_write_that_changes_nothing_still_counts_as_owned():
    """Invariant 2 on MySQL/MariaDB: the rowcount is rows matched (CLIENT.FOUND_ROWS), not
    rows changed, so an UPDATE that writes equal values still proves ownership."""
    enqueue()
    [job] = Job.objects.claim("w")
    assert (
        Job.objects.filter(pk=job.pk, claim_token=job.claim_token).update(priority=F("priority"))
        == 1
    )
    assert Job.objects.checkpoint(job, {"at": 1}) is True
    assert Job.objects.checkpoint(job, {"at": 1}) is True


@pytest.mark.parametrize("lease", [0, -5, float("nan"), float("inf"), 12 * 3600 + 1])
def test_a_lease_override_out_of_range_is_refused_by_every_owner_verb(lease):
    """Invariant 2: a claim given a lease of zero or less would be open to takeover at once;
    claim, renew and checkpoint refuse it naming ``lease``, and change nothing."""
    job = enqueue()
    with pytest.raises(InvalidLeaseOption, match="^lease: "):
        Job.objects.claim("w", lease=lease)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    [claim] = Job.objects.claim("w", lease=30)
    before = Job.objects.get(pk=job.pk).lease_expires_at
    with pytest.raises(InvalidLeaseOption, match="^lease: "):
        Job.objects.renew([claim], lease=lease)
    with pytest.raises(InvalidLeaseOption, match="^lease: "):
        Job.objects.checkpoint(claim, 7, lease=lease)
    after = Job.objects.get(pk=job.pk)
    assert (after.lease_expires_at, after.cursor) == (before, None)


@pytest.mark.django_db(transaction=True)
def test_a_deadlock_victim_is_sent_again_only_outside_the_callers_transaction():
    """(3) InnoDB rolls back the whole transaction of a deadlock victim. A verb called on its
    own is sent again; one called inside the caller's transaction (autocommit off, or an
    atomic block) raises at once, so the caller's earlier writes are never silently lost."""
    from django.db import OperationalError

    from django_leases.deadlocks import MYSQL_DEADLOCK, TRIES, retry_deadlock_victims
    from django_leases.query import JobQuerySet

    calls = []

    class Verbs(JobQuerySet):
        @retry_deadlock_victims
        def victim(self):
            calls.append(self.count())  # a real statement, then the database's answer
            raise OperationalError(MYSQL_DEADLOCK, "Deadlock found when trying to get lock")

    with pytest.raises(OperationalError):
        Verbs(model=Job).victim()
    assert len(calls) == TRIES
    for inside in ("autocommit off", "atomic"):
        calls.clear()
        if inside == "atomic":
            with pytest.raises(OperationalError), transaction.atomic():
                Verbs(model=Job).victim()
        else:
            transaction.set_autocommit(False)
            try:
                with pytest.raises(OperationalError):
                    Verbs(model=Job).victim()
            finally:
                transaction.rollback()
                transaction.set_autocommit(True)
        assert len(calls) == 1, inside


def test_large_results_acknowledged_together_go_in_statements_every_database_takes():
    """(3) ack_many() of results each within the limit but past MariaDB's packet together
    (16 MiB by default) acknowledges them all with their results (before: one UPDATE, and
    the server dropped the connection: to the worker an outage, the same batch sent again
    at every settle while the heartbeat kept the claims)."""
    from django_leases.jsonsafe import SENT_LIMIT as RESULT_LIMIT

    for n in range(3):
        Job.objects.enqueue(TASK, [n, n])
    claimed = Job.objects.claim_rows("w", limit=3)
    results = {row.pk: {"n": row.pk, "text": "x" * (RESULT_LIMIT - 100)} for row in claimed}
    acked = Job.objects.ack_many([(row, results[row.pk]) for row in claimed])
    assert acked == set(results)
    for pk, result in results.items():
        assert Job.objects.values_list("state", "result").get(pk=pk) == ("succeeded", result)


def test_a_result_is_measured_as_sent():
    """(6) A result's limit counts its JSON as a database is sent it, each backslash and
    quote twice (MySQL's client escapes them): a result of backslashes that is 8 MiB of
    JSON is refused, naming the size (before: accepted, and 16 MiB sent to MariaDB)."""
    from django_leases.jsonsafe import SENT_LIMIT as RESULT_LIMIT
    from django_leases.storable import storable_result

    fits = "x" * (RESULT_LIMIT - 4)  # its quotes count twice
    assert storable_result(fits) == fits
    with pytest.raises(TypeError, match=r"too large to store: result: .* as sent"):
        storable_result(["\\" * (RESULT_LIMIT // 4)])
    with pytest.raises(TypeError, match=r"too large to store: result: .* as sent"):
        storable_result({"said": "'" * (RESULT_LIMIT // 2)})
    with pytest.raises(TypeError, match=r"too large to store"):
        storable_result(["x" * (RESULT_LIMIT - 4)])  # four more for the list's brackets


def shared_twice(levels: int) -> list:
    """A list holding one list twice, ``levels`` deep: small in memory, 2**levels copies
    of its leaf once written out."""
    value: list = ["a" * 100]
    for _ in range(levels):
        value = [value, value]
    return value


@pytest.mark.parametrize("where", ["enqueue", "result"])
def test_a_value_huge_once_written_out_is_refused_without_writing_it_out(where):
    """(6) A handler returned a list holding one list twice, 23 deep (2**23 copies of its
    leaf as JSON): its check walked and copied every copy, then dumps() held the GIL for
    the whole text, 40 seconds and 2.5 GB, and the worker's heartbeat starved: the jobs
    beside it lost their leases and ran again. The check stops once what it read passes
    the limit, so the refusal says it read no further (here 2**18 copies: before, all of
    them read and the size measured)."""
    from django_leases.exceptions import InvalidJobArgument
    from django_leases.storable import storable_result

    value = shared_twice(18)
    said = r"has a JSON form over twice the limit of 8,388,608 characters as sent \(read no"
    if where == "enqueue":
        with pytest.raises(InvalidJobArgument, match=rf"^args: {said}"):
            enqueue(args=[value])
        assert not Job.objects.exists()
    else:
        with pytest.raises(TypeError, match=rf"too large to store: result: {said}"):
            storable_result(value)


def test_the_owner_verbs_refuse_a_document_past_the_limit_and_write_nothing():
    """(3, 6) ack(), ack_many(), ack_and_claim_rows() and checkpoint() (so fenced(ack=True)
    too) hold a result or cursor to the limit every database takes, as the worker's own
    outcome is (before: any size, and MariaDB dropped the connection past its packet):
    InvalidJobArgument naming it, the claim still held, nothing written."""
    from django_leases.exceptions import InvalidJobArgument
    from django_leases.jsonsafe import SENT_LIMIT

    Job.objects.enqueue(TASK, [1, 1])
    Job.objects.enqueue(TASK, [2, 2])
    claimed = Job.objects.claim_rows("w", limit=2)
    big = {"said": "'" * (SENT_LIMIT // 2)}  # within by characters, past as sent
    said = r"its JSON form is 8,388,6\d\d characters as sent"
    for call in (
        lambda: Job.objects.ack(claimed[0], big),
        lambda: Job.objects.ack_many([(claimed[0], 1), (claimed[1], big)]),
        lambda: Job.objects.ack_and_claim_rows([(claimed[0], big)], "w", limit=1),
    ):
        with pytest.raises(InvalidJobArgument, match=rf"^result: {said}"):
            call()
    with pytest.raises(InvalidJobArgument, match=rf"^cursor: {said}"):
        Job.objects.checkpoint(claimed[0], big)
    rows = Job.objects.filter(pk__in=[c.pk for c in claimed])
    assert set(rows.values_list("state", "cursor", "result")) == {("claimed", None, None)}
    assert Job.objects.checkpoint(claimed[0], {"at": 1}) and Job.objects.ack(claimed[1], 2)
