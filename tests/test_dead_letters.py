"""Dead letters, deadlines, lost-lease policies, unique jobs, retry ladders and pruning."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction
from django.db.models.functions import Now
from django.tasks.exceptions import InvalidTask
from django.utils import timezone

from django_leases import conf
from django_leases.exceptions import DuplicateJob, InvalidLeaseOption
from django_leases.models import Job
from django_leases.states import DeadReason, FailureKind, JobState, LeaseLostPolicy

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"


def enqueue(**kw):
    return Job.objects.enqueue(TASK, [1, 2], **kw)


def test_a_job_gets_a_deadline_of_max_age_on_the_database_clock():
    """Invariant 1: the default deadline is 14 days after the database's Now()."""
    job = enqueue()
    job.refresh_from_db()
    assert job.deadline - job.enqueued_at == timedelta(days=14)
    job = enqueue(max_age=60)
    job.refresh_from_db()
    assert job.deadline - job.enqueued_at == timedelta(seconds=60)


def test_a_deferred_jobs_max_age_counts_from_when_it_is_due():
    """Invariants 1 and 3: a job deferred past MAX_AGE_DAYS (run_after 30 days out,
    default 14) was dead-lettered at its due time without ever running, its result FAILED
    with no error. The age counts from the due time now, on the database clock (Now() +
    delay, or the later of run_after and Now()), and a deadline before run_after is
    refused, naming deadline (6)."""
    from tests.testapp.tasks import add

    later = timezone.now() + timedelta(days=30)
    job = enqueue(run_after=later)
    job.refresh_from_db()
    assert job.deadline - job.available_at == timedelta(days=14)
    job = enqueue(run_after=later, max_age=5)
    job.refresh_from_db()
    assert job.deadline - job.available_at == timedelta(seconds=5)
    job = enqueue(delay=60, max_age=5)
    job.refresh_from_db()
    assert job.deadline - job.available_at == timedelta(seconds=5)
    assert job.available_at - job.enqueued_at == timedelta(seconds=60)
    job = Job.objects.get(pk=add.using(run_after=later).enqueue(1, 2).id)
    assert job.deadline - job.available_at == timedelta(days=14)
    # A run_after already past (a catch-up job): due now, so the age counts from Now(),
    # on the database clock, and the job is claimed and runs.
    Job.objects.all().delete()
    job = enqueue(run_after=timezone.now() - timedelta(days=30), max_age=60)
    job.refresh_from_db()
    assert abs(job.deadline - job.enqueued_at - timedelta(seconds=60)) < timedelta(seconds=1)
    [claimed] = Job.objects.claim("w")
    assert claimed.pk == job.pk
    # A run_after at the end of the storable range: the deadline stops there.
    job = enqueue(run_after=conf.LATEST_TIME - timedelta(days=1))
    job.refresh_from_db()
    assert job.deadline >= job.available_at
    with pytest.raises(InvalidLeaseOption, match="deadline.*before run_after") as refused:
        enqueue(run_after=later, deadline=later - timedelta(seconds=1))
    assert refused.value.option == "deadline"
    before = Job.objects.count()
    with pytest.raises(InvalidTask, match="deadline"):
        add.using_lease(deadline=later - timedelta(days=1)).using(run_after=later).enqueue(1, 2)
    assert Job.objects.count() == before


def test_a_pending_job_past_its_deadline_is_dead_lettered_instead_of_claimed():
    """Invariant 3: it ends dead with the reason, not silently dropped."""
    job = enqueue(deadline=timezone.now() - timedelta(seconds=1))
    assert Job.objects.claim("w") == []
    job.refresh_from_db()
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, DeadReason.DEADLINE, 0)


def test_a_failure_past_the_deadline_dead_letters_whatever_attempts_remain():
    job = enqueue(max_attempts=10)
    [claim] = Job.objects.claim("w")
    Job.objects.filter(pk=job.pk).update(deadline=Now() - timedelta(seconds=1))
    assert Job.objects.fail(claim, message="boom") is not None
    job.refresh_from_db()
    assert (job.state, job.dead_reason) == (JobState.DEAD, DeadReason.DEADLINE)


def test_failures_follow_the_jobs_ladder_on_the_database_clock():
    """Invariant 1: the ladder is an interval added to the database's Now()."""
    job = enqueue(retry=[15, 90], max_attempts=5)
    for expected in (15, 90, 90):
        [claim] = Job.objects.claim("w")
        Job.objects.fail(claim, message="boom")
        stored = Job.objects.get(pk=job.pk)
        failure = stored.failures.order_by("-id").first()
        assert abs((stored.available_at - failure.recorded_at).total_seconds() - expected) < 1
        Job.objects.filter(pk=job.pk).retry_now()


def test_a_non_retryable_failure_goes_straight_to_dead_with_its_reason():
    enqueue()
    [claim] = Job.objects.claim("w")
    Job.objects.fail(
        claim, exception_class_path="shop.errors.CardDeclined", message="no", retry=False
    )
    job = Job.objects.get(pk=claim.pk)
    assert (job.state, job.dead_reason) == (JobState.DEAD, DeadReason.NON_RETRYABLE)
    failure = job.failures.get()
    assert (failure.exception_class_path, failure.fence, failure.worker_id) == (
        "shop.errors.CardDeclined",
        1,
        "w",
    )


@pytest.mark.parametrize(
    ("policy", "state", "reason"),
    [
        (LeaseLostPolicy.DEAD, JobState.DEAD, DeadReason.LEASE_LOST),
        (LeaseLostPolicy.PARK, JobState.PENDING, ""),
    ],
)
def test_a_lost_lease_of_a_non_idempotent_task_is_not_run_again(policy, state, reason):
    """Invariants 3 and 4: the expired claim is not taken over; it is dead-lettered or
    parked for a person, and the loss is counted apart from failures."""
    job = enqueue(on_lease_lost=policy)
    [claim] = Job.objects.claim("w1")
    Job.objects.filter(pk=job.pk).expire_now()
    assert Job.objects.claim("w2") == []
    job.refresh_from_db()
    assert (job.state, job.dead_reason, job.leases_lost) == (state, reason, 1)
    assert job.failures.get().kind == FailureKind.LEASE_EXPIRED
    assert Job.objects.ack(claim) is False
    if policy == LeaseLostPolicy.PARK:
        assert job.available_at is None
        assert Job.objects.filter(pk=job.pk).retry_now() == 1  # a person releases it
        assert [j.pk for j in Job.objects.claim("w3")] == [job.pk]


@pytest.mark.parametrize(
    ("settings", "event", "reason"),
    [
        ({"max_attempts": 1}, "dead_lettered", DeadReason.ATTEMPTS),
        ({"on_lease_lost": LeaseLostPolicy.DEAD}, "dead_lettered", DeadReason.LEASE_LOST),
        ({"on_lease_lost": LeaseLostPolicy.PARK}, "parked", "park"),
    ],
)
def test_a_claim_that_ends_a_job_says_so_in_a_warning_once_committed(
    settings, event, reason, caplog, django_capture_on_commit_callbacks
):
    """Invariant 3, visibly: a job the claim dead-letters or parks ran no handler that
    would report it, so the claim logs it (a warning naming the job, why, and the worker
    whose lease ran out), after its transaction commits. Before, nothing said so."""
    job = enqueue(**settings)
    Job.objects.claim("w1")
    Job.objects.filter(pk=job.pk).expire_now()
    caplog.set_level("INFO", logger="django_leases.worker")
    with django_capture_on_commit_callbacks(execute=True):
        assert Job.objects.claim("w2") == []
        assert not caplog.records  # not before the commit
    [record] = caplog.records
    assert (record.levelname, record.event, record.reason) == ("WARNING", event, reason)
    assert (record.job_id, record.fence, record.worker, record.previous_worker) == (
        job.pk,
        1,
        "w2",
        "w1",
    )
    assert (record.task, record.queue) == (TASK, "default")


def test_a_claim_rolled_back_logs_no_ending(caplog, django_capture_on_commit_callbacks):
    """The line is the commit's: a claim whose transaction rolls back ended nothing."""
    job = enqueue(max_attempts=1)
    Job.objects.claim("w1")
    Job.objects.filter(pk=job.pk).expire_now()
    caplog.set_level("INFO", logger="django_leases.worker")
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            assert Job.objects.claim("w2") == []
            raise RuntimeError("rolled back")
        assert Job.objects.claim("w3") == []  # the same job, settled for good this time
    assert Job.objects.get(pk=job.pk).state == JobState.DEAD
    assert len(callbacks) == 1
    assert [(r.event, r.worker) for r in caplog.records] == [("dead_lettered", "w3")]


def test_a_job_that_keeps_losing_its_lease_ends_dead_after_max_attempts():
    """Invariant 3: an expired lease is a spent attempt, so a crash loop ends."""
    job = enqueue(max_attempts=3)
    for _ in range(3):
        [claim] = Job.objects.claim("w")
        Job.objects.filter(pk=job.pk).expire_now()
    assert Job.objects.claim("w") == []
    job.refresh_from_db()
    assert (job.state, job.dead_reason, job.leases_lost, job.attempts) == (
        JobState.DEAD,
        DeadReason.ATTEMPTS,
        3,
        3,
    )
    assert list(job.failures.values_list("attempt", "kind")) == [
        (n, FailureKind.LEASE_EXPIRED) for n in (1, 2, 3)
    ]


def test_requeue_gives_a_dead_job_a_fresh_deadline_and_clears_the_reason():
    job = enqueue(deadline=timezone.now() - timedelta(seconds=1))
    Job.objects.claim("w")
    assert Job.objects.filter(pk=job.pk).requeue() == 1
    job.refresh_from_db()
    assert (job.state, job.dead_reason) == (JobState.PENDING, "")
    assert job.deadline - job.available_at == timedelta(days=14)
    assert [j.pk for j in Job.objects.claim("w")] == [job.pk]


def test_a_second_active_job_with_the_same_unique_key_is_refused_or_merged():
    """Invariant 3: the refused enqueue writes nothing and leaves the caller's transaction usable."""
    first = enqueue(unique_key="invoice-7")
    with transaction.atomic():
        with pytest.raises(DuplicateJob) as info:
            enqueue(unique_key="invoice-7")
        assert info.value.job_id == first.pk
        assert Job.objects.count() == 1  # the transaction still works
    assert enqueue(unique_key="invoice-7", on_duplicate="merge").pk == first.pk
    assert Job.objects.count() == 1


def test_a_unique_key_is_free_again_once_its_job_finished():
    first = enqueue(unique_key="k")
    [claim] = Job.objects.claim("w")
    Job.objects.ack(claim)
    second = enqueue(unique_key="k")
    assert second.pk != first.pk
    # Requeueing the finished one would make two active jobs with one key: it stays put.
    Job.objects.filter(pk=second.pk).cancel()
    enqueue(unique_key="k")
    assert Job.objects.filter(pk=second.pk).requeue() == 0


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"on_lease_lost": "maybe"}, "on_lease_lost"),
        ({"retry": {"delays": [-1]}}, "retry.delays[0]"),
        ({"unique_key": ""}, "unique_key"),
        ({"on_duplicate": "ignore"}, "on_duplicate"),
        ({"max_age": -5}, "max_age"),
        ({"deadline": "tomorrow"}, "deadline"),
    ],
)
def test_bad_enqueue_options_are_refused_naming_the_field(kw, named):
    with pytest.raises(InvalidLeaseOption) as info:
        enqueue(**kw)
    assert info.value.option == named
    assert Job.objects.count() == 0


def finished(days_ago, state=JobState.SUCCEEDED):
    job = enqueue()
    Job.objects.filter(pk=job.pk).update(state=state, finished_at=Now() - timedelta(days=days_ago))
    return job


def test_prune_deletes_finished_jobs_past_retention_in_batches():
    old = [finished(20) for _ in range(5)]
    young = finished(1)
    dead = finished(30, JobState.DEAD)
    pending = enqueue()
    out = StringIO()
    call_command("leases_prune", "--dry-run", stdout=out)
    assert "Would delete 5 jobs" in out.getvalue()
    call_command("leases_prune", "--batch-size", "2", stdout=out)
    assert "Deleted 5 jobs" in out.getvalue()
    assert not Job.objects.filter(pk__in=[j.pk for j in old]).exists()
    assert set(Job.objects.values_list("pk", flat=True)) == {young.pk, dead.pk, pending.pk}
    call_command("leases_prune", "--include-dead", stdout=out)
    assert not Job.objects.filter(pk=dead.pk).exists()


def test_prune_dead_letters_pending_jobs_no_claim_will_reach_past_their_deadline():
    """Invariant 3: a parked job, one in a queue no worker serves and one scheduled past its
    own deadline would otherwise stay pending for ever; leases_prune ends them dead with the
    reason, and leaves a job whose deadline is still ahead (or a claimed one) alone."""
    past = timezone.now() - timedelta(seconds=1)
    parked = enqueue(deadline=past)
    Job.objects.filter(pk=parked.pk).update(available_at=None)
    unserved = enqueue(deadline=past, queue_name="nobody-serves-this")
    scheduled = enqueue(deadline=past, delay=3600)
    alive = enqueue(delay=3600)
    claimed = enqueue()
    [claim] = Job.objects.claim("w")
    assert claim.pk == claimed.pk
    Job.objects.filter(pk=claimed.pk).update(deadline=Now() - timedelta(seconds=1))
    out = StringIO()
    call_command("leases_prune", "--dry-run", stdout=out)
    assert "Would dead-letter 3 pending jobs past their deadline." in out.getvalue()
    call_command("leases_prune", "--batch-size", "2", stdout=out)
    assert "Dead-lettered 3 pending jobs past their deadline." in out.getvalue()
    for job in (parked, unserved, scheduled):
        job.refresh_from_db()
        assert (job.state, job.dead_reason, job.finished_at is not None) == (
            JobState.DEAD,
            DeadReason.DEADLINE,
            True,
        )
    assert Job.objects.get(pk=alive.pk).state == JobState.PENDING
    assert Job.objects.get(pk=claimed.pk).state == JobState.CLAIMED


def test_a_claim_without_settling_leaves_expired_claims_to_the_next_settling_claim():
    """Invariants 2 and 4: on PostgreSQL a NOTIFY-woken claim (settle=False) takes due
    pending jobs only, so an expired claim waits for the next settling claim, which takes
    it over (fence + 1, the lost lease recorded); elsewhere every claim takes it over."""
    from django.db import connection

    job = enqueue()
    [first] = Job.objects.claim("a")
    assert Job.objects.filter(pk=job.pk).expire_now() == 1
    due = enqueue()
    woken = Job.objects.claim_rows("b", limit=2, settle=False)
    if connection.vendor == "postgresql":
        assert [(c.pk, c.was_state, c.was_claimed_by, c.was_fence) for c in woken] == [
            (due.pk, "pending", "", 0)
        ]
        [taken] = Job.objects.claim_rows("b", limit=2)
    else:
        [taken] = [c for c in woken if c.pk == job.pk]
    assert (taken.pk, taken.was_state, taken.was_fence) == (job.pk, "claimed", first.fence)
    job.refresh_from_db()
    assert (job.state, job.claimed_by, job.fence) == (JobState.CLAIMED, "b", first.fence + 1)
    assert job.failures.get().kind == FailureKind.LEASE_EXPIRED


def test_a_claim_without_settling_leaves_endings_to_the_next_settling_claim():
    """Invariant 3: on PostgreSQL a NOTIFY-woken claim (settle=False) is one statement and
    skips the past-deadline job, which the next settling claim dead-letters; elsewhere every
    claim settles."""
    from django.db import connection

    job = enqueue(deadline=timezone.now() - timedelta(seconds=1))
    assert Job.objects.claim("w", settle=False) == []
    job.refresh_from_db()
    expected = JobState.PENDING if connection.vendor == "postgresql" else JobState.DEAD
    assert job.state == expected
    Job.objects.claim("w")
    job.refresh_from_db()
    assert (job.state, job.dead_reason) == (JobState.DEAD, DeadReason.DEADLINE)
