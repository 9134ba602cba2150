"""The manager verbs: claims, renewals and every write out of 'claimed', by rowcount."""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django.db.models.functions import Now

from django_leases.exceptions import InvalidJobArgument, InvalidLeaseOption
from django_leases.models import Job, JobFailure
from django_leases.states import FailureKind, JobState

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
    assert Job.objects.fail(old, message="stale") is False
    assert Job.objects.release(old) is False
    assert Job.objects.checkpoint(old, {"at": 99}) is False

    assert Job.objects.filter(pk=old.pk).values().get() == before
    assert Job.objects.renew([new]) == {new.pk}
    assert Job.objects.ack(new, "fresh") is True
    done = Job.objects.get(pk=old.pk)
    assert (done.state, done.result, done.leases_lost) == (JobState.SUCCEEDED, "fresh", 1)
    [lost] = JobFailure.objects.filter(job=done)
    assert (lost.kind, lost.attempt, lost.fence, lost.worker_id) == (FailureKind.LEASE_EXPIRED, 1, 1, "w1")


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
    updates = [q for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1


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
    assert (stored.state, stored.attempts, stored.fence, stored.claim_token) == (JobState.PENDING, 0, 1, None)
    [again] = Job.objects.claim("w2")
    assert (again.attempts, again.fence) == (1, 2)


def test_fail_retries_until_max_attempts_then_dead_letters_with_history():
    """Invariant 3: a failing job ends dead, each attempt recorded, never lost."""
    enqueue(max_attempts=2)
    [job] = Job.objects.claim("w1")
    assert Job.objects.fail(job, exception_class_path="builtins.ValueError", message="boom",
                            traceback="Traceback ...", retry_in=0) is True
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    [job] = Job.objects.claim("w2")
    assert Job.objects.fail(job, exception_class_path="builtins.KeyError", message="again") is True
    dead = Job.objects.get(pk=job.pk)
    assert dead.state == JobState.DEAD and dead.finished_at is not None
    history = list(dead.failures.values_list("attempt", "fence", "worker_id", "exception_class_path"))
    assert history == [(1, 1, "w1", "builtins.ValueError"), (2, 2, "w2", "builtins.KeyError")]


def test_fail_with_retry_delay_counts_on_the_database_clock():
    """Invariant 1: the retry is due retry_in seconds after the database's Now()."""
    enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="later", retry_in=120)
    stored = Job.objects.get(pk=job.pk)
    failure = stored.failures.get()
    assert timedelta(seconds=119) < stored.available_at - failure.recorded_at < timedelta(seconds=121)
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
    assert Job.objects.fail(job, message="bad result") is True


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
    enqueue(max_attempts=1)
    enqueue()
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="x")
    Job.objects.filter(state=JobState.PENDING).cancel()
    assert Job.objects.all().requeue() == 2
    assert set(Job.objects.values_list("state", "attempts")) == {(JobState.PENDING, 0)}


def test_requeue_keeping_attempts_leaves_room_for_one_more_try():
    enqueue(max_attempts=1)
    [job] = Job.objects.claim("w")
    Job.objects.fail(job, message="x")
    assert Job.objects.all().requeue(reset_attempts=False) == 1
    stored = Job.objects.get()
    assert (stored.attempts, stored.max_attempts) == (1, 2)
    [again] = Job.objects.claim("w")
    assert again.attempts == 2


def test_lease_views_split_claimed_jobs_into_healthy_stalled_and_expired():
    """Invariant 1: the views compare with the database clock only."""
    enqueue()
    enqueue()
    enqueue()
    a, b, c = Job.objects.claim("w", limit=3)
    Job.objects.filter(pk=b.pk).update(heartbeat_at=Now() - timedelta(seconds=25))
    Job.objects.filter(pk=c.pk).expire_now()
    assert set(Job.objects.healthy(silent_for=20).values_list("pk", flat=True)) == {a.pk}
    assert set(Job.objects.stalled(silent_for=20).values_list("pk", flat=True)) == {b.pk}
    assert set(Job.objects.expired().values_list("pk", flat=True)) == {c.pk}


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
    refs = [_ClaimRef(short.pk, short.claim_token, 4.0), _ClaimRef(long_.pk, long_.claim_token, 50.0)]
    assert Job.objects.renew(refs) == {short.pk, long_.pk}
    ends = {j.pk: j.lease_expires_at - j.heartbeat_at for j in Job.objects.all()}
    assert ends == {short.pk: timedelta(seconds=4), long_.pk: timedelta(seconds=50)}


def test_an_owner_write_that_changes_nothing_still_counts_as_owned():
    """Invariant 2 on MySQL/MariaDB: the rowcount is rows matched (CLIENT.FOUND_ROWS), not
    rows changed, so an UPDATE that writes equal values still proves ownership."""
    enqueue()
    [job] = Job.objects.claim("w")
    assert Job.objects.filter(pk=job.pk, claim_token=job.claim_token).update(priority=F("priority")) == 1
    assert Job.objects.checkpoint(job, {"at": 1}) is True
    assert Job.objects.checkpoint(job, {"at": 1}) is True
