"""Retries, dead letters, checkpoints and fencing with real worker processes.

Invariants (design.md): (1) one clock, (2) rowcount is ownership, (3) nothing is lost,
(4) duplicates only after expiry, (5) a stale owner's ack/checkpoint/fenced write is rejected.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter

import django
import pytest
from django.db.models.functions import Now

from django_leases.models import Job, JobFailure
from django_leases.states import DeadReason, FailureKind, JobState
from tests.testapp.models import Effect, ItemLog
from tests.testapp.tasks import (
    backfill,
    boom,
    checkpoint_then_refuse,
    crash_worker,
    late_fenced_write,
    refuse,
    spin,
)
from tests.worker_helpers import BEAT, FAST, LEASE, job_of, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_handler_that_crashes_its_worker_every_time_ends_dead_after_max_attempts(workers):
    """Invariant 3: each crash is a lost lease and a spent attempt; the third loss
    dead-letters the job instead of looping, with every attempt recorded."""
    result = crash_worker.using_lease(max_attempts=3).enqueue()
    for n in range(3):
        worker = workers.start(f"crash-{n}", *FAST)
        assert worker.wait_exit(timeout=LEASE * 3 + 10) == -signal.SIGKILL
    # The third expired claim is found by the next worker, which buries it.
    last = workers.start("crash-last", *FAST)
    wait_for(lambda: job_of(result).state == JobState.DEAD, LEASE + 5, "the job to be dead")
    last.kill()
    job = job_of(result)
    assert (job.dead_reason, job.attempts, job.leases_lost) == (DeadReason.ATTEMPTS, 3, 3)
    assert list(job.failures.values_list("attempt", "fence", "kind", "worker_id")) == [
        (n + 1, n + 1, FailureKind.LEASE_EXPIRED, f"crash-{n}") for n in range(3)
    ]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_backfill_killed_three_times_processes_every_item_exactly_once(workers, isolation):
    """Invariants 3 and 5: each batch's rows and checkpoint commit in one fenced transaction,
    so 10,000 items survive three kill -9s with none lost and none done twice. In process
    isolation the child sends the checkpoint on its own connection, inside that transaction
    (forwarded to the parent, it deadlocked on SQLite and committed early elsewhere)."""
    result = backfill.enqueue(10_000, 100, 0.03)
    rng = random.Random(7)
    for n in range(3):
        worker = workers.start(f"backfill-{isolation}-{n}", *FAST, "--isolation", isolation)
        # Let it get somewhere first (a few batches), then kill it at a random moment.
        seen = ItemLog.objects.count()
        wait_for(lambda s=seen: ItemLog.objects.count() >= s + 300, 30, "progress")
        time.sleep(rng.uniform(0.05, 0.4))
        worker.signal(signal.SIGKILL)
        worker.wait_exit()
        assert job_of(result).state == JobState.CLAIMED
    finisher = workers.start(f"backfill-{isolation}-final", *FAST, "--isolation", isolation)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 120, "the backfill to finish")
    finisher.kill()
    per_item = Counter(ItemLog.objects.values_list("item", flat=True))
    assert set(per_item) == set(range(10_000))
    assert set(per_item.values()) == {1}, [i for i, n in per_item.items() if n > 1][:10]
    job = job_of(result)
    assert (job.fence, job.leases_lost, job.cursor) == (4, 3, {"next": 10_000})
    # Each claim resumed where the last checkpoint left off: fences rise with the items.
    fences = list(ItemLog.objects.order_by("item").values_list("fence", flat=True))
    assert fences == sorted(fences) and set(fences) == {1, 2, 3, 4}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_checkpoint_inside_a_fenced_block_rolls_back_with_it(workers, isolation):
    """Invariants 3 and 5: a checkpoint is part of the handler's fenced transaction, in
    either isolation; when the block gives up, its writes and the cursor roll back together,
    so the next attempt would resume from where the committed work ends."""
    result = checkpoint_then_refuse.using_lease(max_attempts=1).enqueue("rollback")
    w = workers.start(f"rollback-{isolation}", *FAST, "--isolation", isolation)
    wait_for(lambda: job_of(result).state == JobState.DEAD, 60, "the job to be dead")
    w.kill()
    job = job_of(result)
    assert (job.dead_reason, job.cursor) == (DeadReason.NON_RETRYABLE, None)
    assert not Effect.objects.filter(key="rollback").exists()
    assert job.failures.get().exception_class_path == "django_leases.exceptions.NonRetryable"


def test_a_stale_workers_fenced_write_is_refused_after_sigcont(workers):
    """Invariants 4 and 5: the paused worker's handler resumes after another worker took
    the job over; its fenced transaction finds the claim gone and commits nothing."""
    result = late_fenced_write.enqueue("fenced", LEASE + 1.5)
    a = workers.start("fenced-a", *FAST)
    wait_for(lambda: job_of(result).fence == 1, 10, "the first claim")
    a.signal(signal.SIGSTOP)
    b = workers.start("fenced-b", *FAST)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, LEASE * 2 + 10, "B to finish")
    a.signal(signal.SIGCONT)
    a.wait_event("discarded", timeout=LEASE + 10)
    b.kill()
    assert list(Effect.objects.filter(key="fenced").values_list("fence", "worker_id")) == [
        (2, "fenced-b")
    ]
    assert job_of(result).fence == 2


def test_failures_retry_on_the_ladder_then_dead_letter_with_every_error(workers):
    """Invariant 3: an erroring job retries after the ladder's delays (database clock) and
    ends dead with each attempt's error, worker and fence."""
    result = boom.using_lease(max_attempts=3, retry=[0.5, 0.5]).enqueue()
    w = workers.start("ladder", *FAST)
    wait_for(lambda: job_of(result).state == JobState.DEAD, 15, "the job to be dead")
    w.kill()
    job = job_of(result)
    assert job.dead_reason == DeadReason.ATTEMPTS
    errors = list(
        job.failures.values_list("attempt", "fence", "kind", "exception_class_path", "worker_id")
    )
    assert errors == [
        (n, n, FailureKind.EXCEPTION, "builtins.ValueError", "ladder") for n in (1, 2, 3)
    ]
    assert all("ValueError: boom" in tb for tb in job.failures.values_list("traceback", flat=True))
    times = list(job.failures.order_by("id").values_list("recorded_at", flat=True))
    assert times == sorted(times)


def test_a_non_retryable_error_dead_letters_at_once(workers):
    """Invariant 3: NonRetryable ends the job dead after one attempt, with the reason."""
    result = refuse.using_lease(max_attempts=5).enqueue()
    w = workers.start("refuse", *FAST)
    wait_for(lambda: job_of(result).state == JobState.DEAD, 10, "the job to be dead")
    w.kill()
    job = job_of(result)
    assert (job.dead_reason, job.attempts) == (DeadReason.NON_RETRYABLE, 1)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(non_retryable=...) needs Django 6.1")
def test_exceptions_a_task_lists_as_non_retryable_dead_letter_at_once(workers):
    """Invariant 3: the task's own non_retryable list is honoured by the worker."""
    from tests.testapp.tasks import charge_card

    result = charge_card.using_lease(max_attempts=5).enqueue()
    w = workers.start("declined", *FAST)
    wait_for(lambda: job_of(result).state == JobState.DEAD, 10, "the job to be dead")
    w.kill()
    job = job_of(result)
    assert (job.dead_reason, job.failures.get().exception_class_path) == (
        DeadReason.NON_RETRYABLE,
        "tests.testapp.tasks.CardDeclined",
    )


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_row_naming_an_undeclared_path_ends_dead_and_is_never_imported(
    workers, tmp_path, monkeypatch, isolation
):
    """Invariant 3: a job whose task path is not a declared @task ends dead with a clear
    error; the worker never imports or calls a dotted path on a row's say-so."""
    trap = tmp_path / "trap-imported"
    monkeypatch.setenv("LEASES_TRAP", str(trap))
    job = Job.objects.enqueue("tests.testapp.trap.explode", [], max_attempts=5)
    w = workers.start(f"registry-{isolation}", *FAST, "--isolation", isolation)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == JobState.DEAD, 20, "the job to be dead")
    w.kill()
    job.refresh_from_db()
    failure = job.failures.get()
    assert (job.dead_reason, job.attempts) == (DeadReason.UNRUNNABLE, 1)
    assert failure.exception_class_path == "django_leases.exceptions.UnknownTask"
    assert "not a task declared" in failure.message
    assert not trap.exists()


def test_a_handler_spinning_in_pure_python_does_not_stop_renewals(workers):
    """Invariants 2 and 4 with a handler that really hogs its thread: a pure-Python busy
    loop (no sleep, which would release the GIL) for six heartbeat periods, in thread
    isolation. The heartbeat thread keeps renewing: seen from the database, heartbeat_at
    keeps moving and the lease never runs out (database clock), nobody takes the job over,
    and it runs once, acknowledged under its first fence."""
    spin_for = 3 * LEASE  # six heartbeat periods (BEAT = LEASE / 4)
    result = spin.enqueue("spin", spin_for)
    a = workers.start("spin-a", *FAST, "--isolation", "thread")
    wait_for(
        lambda: Effect.objects.filter(key="spin", phase="start").exists(), 20, "the spin to start"
    )
    beats, expired_seen = set(), []

    def watch():
        job = Job.objects.annotate(db_now=Now()).get(pk=int(result.id))
        if job.state == JobState.CLAIMED:
            beats.add(job.heartbeat_at)
            if job.lease_expires_at < job.db_now:
                expired_seen.append((job.lease_expires_at, job.db_now))
        return Effect.objects.filter(key="spin", phase="done").exists()

    wait_for(watch, spin_for + 20, "the spin to end", interval=0.1)
    assert not expired_seen, f"the lease ran out while the handler spun: {expired_seen[:3]}"
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the ack")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0
    # A heartbeat every BEAT: at least half of the periods the spin lasted were seen renewed.
    assert len(beats) >= spin_for / BEAT / 2, sorted(beats)
    job = job_of(result)
    assert (job.fence, job.attempts, job.leases_lost, job.claimed_by) == (1, 1, 0, "spin-a")
    assert job.result["fence"] == 1 and job.result["loops"] > 0
    assert not JobFailure.objects.exists()
    assert list(
        Effect.objects.filter(key="spin").order_by("id").values_list("fence", "worker_id", "phase")
    ) == [(1, "spin-a", "start"), (1, "spin-a", "done")]
    assert not a.events("lost")


@pytest.mark.parametrize(
    ("task_name", "exception"),
    [
        ("raise_lease_lost", "django_leases.exceptions.LeaseLost"),
        ("raise_cancelled", "asyncio.exceptions.CancelledError"),
    ],
)
def test_a_handler_raising_what_a_loss_would_on_a_held_claim_fails_the_attempt(
    workers, task_name, exception
):
    """Invariants 2 and 3: LeaseLost or CancelledError from the handler's own code, while the
    claim is still held, is recorded as a failed attempt and retried at once by the ladder,
    instead of leaving the job claimed and unrenewed until its lease runs out."""
    from tests.testapp import tasks

    result = getattr(tasks, task_name).using_lease(max_attempts=2, retry=[0], lease=60).enqueue()
    w = workers.start(f"own-{task_name}", "--heartbeat", "2", "--poll", "0.2")
    wait_for(lambda: job_of(result).state == JobState.DEAD, 20, "both attempts to fail")
    w.kill()
    job = job_of(result)
    assert (job.attempts, job.fence, job.dead_reason, job.leases_lost) == (
        2,
        2,
        DeadReason.ATTEMPTS,
        0,
    )
    assert [f.exception_class_path for f in job.failures.order_by("attempt")] == [exception] * 2
