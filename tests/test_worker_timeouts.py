"""Run timeouts and hung handlers: run_lease_worker as real processes.

A handler past its timeout (the task's ``timeout``, else the queue's or the backend's
TIMEOUT_SECONDS) is told to stop and its attempt fails under the claim's token (2, 5);
a process-isolated one that does not stop is killed, a thread-isolated one abandoned and
its slot replaced, its job's retry then waiting a lease (4). A hung thread-isolated handler
whose claim was cancelled no longer keeps its slot for good (6).
"""

from __future__ import annotations

import json
import os
import signal
import time

import django
import pytest
from django.db import connection
from django.tasks.exceptions import InvalidTask

from django_leases import conf
from django_leases.checks import check_backend
from django_leases.exceptions import InvalidLeaseOption
from django_leases.models import Job, JobFailure
from django_leases.states import JobState
from django_leases.worker.executors import START_ALLOWANCE_SECONDS
from django_leases.worker.timeouts import timeout_of
from tests.testapp.models import Effect
from tests.testapp.tasks import add, returns_leaving_a_thread, returns_when_told, stubborn
from tests.worker_helpers import Workers, wait_for

LEASE, BEAT, POLL = 3.0, 0.5, 0.2
FAST = ["--lease", str(LEASE), "--heartbeat", str(BEAT), "--poll", str(POLL)]
TIMEOUT = 2.0
TIMEOUT_CLASS = "django_leases.exceptions.HandlerTimeout"


@pytest.fixture
def workers(tmp_path):
    pool = Workers(tmp_path)
    yield pool
    pool.close()


def _options(**options) -> dict[str, str]:
    return {"LEASES_WORKER_OPTIONS": json.dumps(options)}


def _job(result) -> Job:
    return Job.objects.get(pk=int(result.id))


def _phases(key: str) -> list[str]:
    return list(Effect.objects.filter(key=key).order_by("id").values_list("phase", flat=True))


def _failure(result) -> JobFailure:
    wait_for(
        lambda: JobFailure.objects.filter(job_id=int(result.id)).exists(),
        TIMEOUT + 15,
        "the timed-out attempt to be recorded",
    )
    return JobFailure.objects.get(job_id=int(result.id))


def _start(workers, worker_id: str, *args: str, timeout: float | None = TIMEOUT):
    """A worker of the test's fast lease, with TIMEOUT_SECONDS ``timeout`` (None: unset)."""
    env = None if timeout is None else _options(TIMEOUT_SECONDS=timeout)
    return workers.start(worker_id, *FAST, *args, env_extra=env)


def _next_job_runs(within: float = 20) -> None:
    """A job enqueued now succeeds: the worker still has a slot to run it."""
    after = add.enqueue(2, 3)
    wait_for(lambda: _job(after).state == JobState.SUCCEEDED, within, "the next job to run")


def _stops_cleanly(worker) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_hung_thread_handler_past_its_timeout_fails_its_attempt_and_frees_its_slot(workers):
    """Invariants 2, 4, 6: a thread-isolated handler deaf to being told, past TIMEOUT_SECONDS,
    has its attempt failed under the claim's token (HandlerTimeout), is abandoned a second
    later with its slot replaced (one slot: the next job still runs), and its job's retry
    waits at least the lease, as a takeover would have (before: no timeout at all, the
    lease renewed for good, the slot taken for good)."""
    result = stubborn.using_lease(retry=[0], max_attempts=3).enqueue("hung", seconds=60)
    worker = _start(workers, "timeout-thread", "--concurrency", "1")
    wait_for(lambda: _phases("hung") == ["start"], 20, "the handler to start")
    started = time.monotonic()
    failure = _failure(result)
    # Told at the timeout (looked at twice a second), abandoned a second later; slack for
    # a loaded machine (before, no failure came at all: the lease was renewed for good).
    assert time.monotonic() - started <= TIMEOUT + 0.5 + 1.0 + 6.0
    assert failure.exception_class_path == TIMEOUT_CLASS
    assert f"timeout of {TIMEOUT:g} s" in failure.message
    assert "abandoned" in failure.message
    job = _job(result)
    assert (job.state, job.attempts, job.claim_token) == (JobState.PENDING, 1, None)
    # The ladder says 0 s; the retry waits the lease (both times on the database clock).
    assert (job.available_at - failure.recorded_at).total_seconds() >= LEASE - 0.05
    assert worker.events("timed_out", job_id=job.pk, timeout=TIMEOUT), worker.log()
    assert worker.events("handler_abandoned", job_id=job.pk), worker.log()
    # Its one slot was replaced: the next job runs while the hung handler still sleeps.
    _next_job_runs()
    assert _phases("hung") == ["start"]
    _stops_cleanly(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_handler_that_stops_when_told_at_its_timeout_is_not_abandoned(workers):
    """Invariants 2, 6: told at the timeout, a handler that heeds ``current_job().lost``
    returns; whatever it returned, its attempt fails as timed out, retried by its ladder,
    and no slot is abandoned."""
    result = returns_when_told.enqueue("heeds")
    worker = _start(workers, "timeout-heeds")
    failure = _failure(result)
    assert failure.exception_class_path == TIMEOUT_CLASS
    assert failure.message.endswith("it stopped when told")
    assert _phases("heeds") == ["start", "done"]
    job = _job(result)
    assert (job.state, job.attempts, job.result) == (JobState.PENDING, 1, None)
    assert not worker.events("handler_abandoned"), worker.log()
    _stops_cleanly(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_hung_process_handler_past_its_timeout_is_killed(workers):
    """Invariants 2, 4, 6: in process isolation the handler's process is killed a second
    after it was told; the attempt fails as timed out, and the worker carries on."""
    result = stubborn.enqueue("hung-child", seconds=60)
    worker = _start(workers, "timeout-process", "--isolation", "process", "--concurrency", "1")
    wait_for(lambda: _phases("hung-child") == ["start"], 30, "the child to start")
    child = Effect.objects.get(key="hung-child").pid
    failure = _failure(result)
    assert failure.exception_class_path == TIMEOUT_CLASS
    assert "its process did not stop when told and was killed" in failure.message
    assert _ended(child)
    assert worker.events("process_killed", pid=child, reason="timeout"), worker.log()
    _next_job_runs(30)
    assert _phases("hung-child") == ["start"]
    _stops_cleanly(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_cancelling_a_hung_thread_handler_frees_its_slot(workers):
    """Invariant 6: with no timeout at all, a cancelled job whose thread-isolated handler
    never returns is abandoned a lease after its claim was found lost: the worker's one
    slot serves the next job (before: the slot stayed taken for good and nothing more was
    claimed)."""
    # Told about 0.5 s after the cancel, abandoned a lease later, back at 9 s.
    result = stubborn.enqueue("cancelled-hung", seconds=9)
    worker = _start(workers, "cancel-hung", "--concurrency", "1", timeout=None)
    wait_for(lambda: _phases("cancelled-hung") == ["start"], 20, "the handler to start")
    Job.objects.filter(pk=int(result.id)).cancel()
    _next_job_runs(LEASE + 15)
    assert worker.events("handler_abandoned", job_id=int(result.id)), worker.log()
    # Back at last, its result is discarded and said so, as any lost claim's.
    worker.wait_event("discarded", timeout=20, job_id=int(result.id))
    assert _job(result).state == JobState.CANCELLED
    assert not JobFailure.objects.filter(job_id=int(result.id)).exists()
    _stops_cleanly(worker)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(timeout=...) needs Django 6.1")
@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_tasks_own_timeout_wins_over_the_backends(workers):
    """Invariant 6: @task(timeout=1.5) ends its handler at 1.5 s though the backend allows
    30 s."""
    from tests.testapp.tasks import hangs_briefly

    result = hangs_briefly.enqueue("own-timeout", 60)
    _start(workers, "timeout-own", timeout=30)
    failure = _failure(result)
    assert failure.exception_class_path == TIMEOUT_CLASS
    assert "timeout of 1.5 s" in failure.message


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_slots_stay_whole_through_abandonments_whose_threads_end(workers):
    """Invariants 3, 6: a first abandoned handler returns and its thread ends, a second is
    abandoned; the next job still runs (before: the new slot thread got the ended one's
    ident, still marked retired, dropped that job's outcome and ended: the job claimed and
    renewed for good, the worker wedged)."""
    once = stubborn.using_lease(max_attempts=1)
    # Abandoned at about 3.2 s, back at 5 s: its thread ends before the second abandonment
    # (about 6.5 s) starts a thread, which then gets the ended one's ident.
    first = once.enqueue("returns-late", seconds=5)
    second = once.enqueue("hangs-on", seconds=60)
    worker = _start(workers, "timeout-twice", "--concurrency", "1")
    for result in (first, second):
        wait_for(lambda r=result: _job(r).state == JobState.DEAD, 30, "the timeout to end it")
    wait_for(lambda: worker.events("abandoned_returned"), 15, "the first handler to return")
    _next_job_runs()
    _stops_cleanly(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_handler_that_acknowledged_its_job_then_hung_is_abandoned(workers):
    """Invariants 3, 6: a handler acks in fenced(ack=True), then hangs deaf: its job stays
    succeeded, and past the timeout it is abandoned, its one slot serving the next job
    (before: the slot, and its claim in the book, were kept for good)."""
    from tests.testapp.tasks import ack_then_linger

    done = ack_then_linger.enqueue("acked-hung", 60, heed=False)
    worker = _start(workers, "timeout-acked", "--concurrency", "1")
    wait_for(lambda: _job(done).state == JobState.SUCCEEDED, 20, "the handler's own ack")
    _next_job_runs()
    assert worker.events("handler_abandoned", job_id=int(done.id)), worker.log()
    assert _job(done).state == JobState.SUCCEEDED
    assert not JobFailure.objects.filter(job_id=int(done.id)).exists()
    _stops_cleanly(worker)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(non_retryable=...) needs Django 6.1")
@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_task_listing_handler_timeout_as_non_retryable_is_dead_at_once(workers):
    """Invariant 6: non_retryable=(HandlerTimeout,) dead-letters a timed-out job at its
    first attempt, as it does for an exception the handler raised."""
    from tests.testapp.tasks import hangs_once

    result = hangs_once.enqueue("no-retry", 60)
    _start(workers, "timeout-final", timeout=None)
    failure = _failure(result)
    assert failure.exception_class_path == TIMEOUT_CLASS
    job = _job(result)
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, "non_retryable", 1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_stop_fails_a_timed_out_attempt_rather_than_release_it(workers):
    """Invariants 3, 6: SIGTERM then SIGINT (the grace skipped) while a handler is past
    its timeout: its attempt fails, the retry waiting the lease (before: released, the
    attempt not counted, so a job that always hangs never spent its attempts)."""
    result = stubborn.using_lease(retry=[0], max_attempts=3).enqueue("stopped-hung", seconds=60)
    worker = _start(workers, "timeout-stop")
    worker.wait_event("timed_out", timeout=30, job_id=int(result.id))
    worker.signal(signal.SIGTERM)
    worker.signal(signal.SIGINT)
    worker.wait_exit()
    failure = JobFailure.objects.get(job_id=int(result.id))
    assert failure.exception_class_path == TIMEOUT_CLASS
    # The stop's own failure, or (the signals late on a loaded machine) the abandonment's.
    assert failure.message.endswith(
        (
            f"the worker stopped before it did (the retry waits at least the lease, {LEASE:g} s)",
            f"abandoned, still running (the retry waits at least the lease, {LEASE:g} s)",
        )
    ), failure.message
    job = _job(result)
    assert (job.state, job.attempts, job.claim_token) == (JobState.PENDING, 1, None)
    assert (job.available_at - failure.recorded_at).total_seconds() >= LEASE - 0.05
    assert not worker.events("released", job_id=job.pk), worker.log()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_worker_stops_with_status_1_once_more_handlers_are_abandoned_than_it_has_slots(
    workers,
):
    """Invariant 6: each abandoned thread holds its handler's connection; a task that
    always hangs took one more per timeout, without bound (48 threads in 30 s). With more
    abandoned than slots (two slots, their replacements, a third abandoned) the worker
    stops, exit status 1, for a fresh process."""
    once = stubborn.using_lease(max_attempts=1)
    hung = [once.enqueue(f"hung-{n}", seconds=60) for n in range(3)]
    worker = _start(workers, "timeout-limit", "--concurrency", "2")
    assert worker.wait_exit(40) == 1
    assert worker.events("abandoned_limit", held=3), worker.log()
    for result in hung:
        assert _job(result).state == JobState.DEAD
        assert JobFailure.objects.get(job_id=int(result.id)).exception_class_path == TIMEOUT_CLASS


# -- the options ---------------------------------------------------------------------------


def test_timeout_comes_from_the_task_then_the_queue_then_the_backend():
    """Invariant 6: the task's own timeout wins, then QUEUE_OPTIONS, then TIMEOUT_SECONDS;
    none of them set means no limit."""
    options = conf.LeaseOptions.from_dict(
        {"TIMEOUT_SECONDS": 60, "QUEUE_OPTIONS": {"reports": {"TIMEOUT_SECONDS": 600}}}
    )
    assert timeout_of(add, options, "default") == 60
    assert timeout_of(add, options, "reports") == 600
    assert timeout_of(add.using(queue_name="reports"), options, "reports") == 600
    assert timeout_of(None, options, "default") == 60
    assert timeout_of(add, conf.LeaseOptions.from_dict({}), "default") is None


@pytest.mark.parametrize(
    ("options", "named", "check"),
    [
        ({"TIMEOUT_SECONDS": 0}, "TIMEOUT_SECONDS", "django_leases.E024"),
        ({"TIMEOUT_SECONDS": "60"}, "TIMEOUT_SECONDS", "django_leases.E024"),
        ({"TIMEOUT_SECONDS": float("nan")}, "TIMEOUT_SECONDS", "django_leases.E024"),
        (
            {"QUEUE_OPTIONS": {"reports": {"TIMEOUT_SECONDS": -1}}},
            "QUEUE_OPTIONS['reports']['TIMEOUT_SECONDS']",
            "django_leases.E012",
        ),
    ],
)
def test_a_bad_timeout_is_an_error_naming_it(options, named, check):
    """Invariant 6: bad input is refused with the option named (a system check's id)."""
    with pytest.raises(InvalidLeaseOption) as raised:
        conf.LeaseOptions.from_dict(options)
    assert raised.value.option == named
    errors = [e for e in check_backend("default", options) if e.id == check]
    assert errors and named.replace("QUEUE_OPTIONS", "") in errors[0].msg


def test_a_timeout_cannot_be_changed_per_copy():
    """Invariant 6: the worker reads a task's timeout as declared, so using_lease() refuses
    to change it rather than have the copy's ignored."""
    with pytest.raises(InvalidTask, match="cannot change timeout"):
        add.using_lease(timeout=5)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(timeout=...) needs Django 6.1")
@pytest.mark.parametrize("bad", [0, -1, "5", float("inf")])
def test_a_bad_task_timeout_is_refused_where_the_task_is_made(bad):
    """Invariant 6: @task(timeout=...) is checked as the task is made, naming ``timeout``."""
    from django.tasks import task

    from tests.testapp.tasks import _sleeps_on

    with pytest.raises(InvalidTask, match="timeout"):
        task(timeout=bad)(_sleeps_on)


@pytest.mark.django_db(transaction=True)
def test_a_process_handlers_timeout_counts_from_its_start_not_its_process_start(workers):
    """--isolation process: a child's start (a fresh interpreter, Django's setup, the
    task's import: 3 s here, on a loaded machine as long) counted as the handler's run
    time, so a handler that returned at once failed with HandlerTimeout ("did not stop
    when told and was killed"), and one never entered was dead-lettered after its
    attempts. The clock starts when the child says its handler starts (2, 6)."""
    result = add.enqueue(2, 2)
    # A timeout the handler itself meets with room to spare on a loaded machine, shorter
    # than the child's start-up.
    worker = workers.start(
        "timeout-spawn",
        *FAST,
        "--isolation",
        "process",
        env_extra={**_options(TIMEOUT_SECONDS=5), "LEASES_WORKER_CHILD_SETUP_SECONDS": "6"},
    )
    # Its end, or the end of its first attempt (a failure recorded): a failed attempt's
    # job is pending only until it is claimed again.
    wait_for(
        lambda: (
            _job(result).state in (JobState.SUCCEEDED, JobState.DEAD)
            or JobFailure.objects.filter(job_id=int(result.id)).exists()
        ),
        30,
        lambda: f"the job to end: {worker.log()[-3000:]}",
    )
    failures = list(JobFailure.objects.filter(job_id=int(result.id)).values_list("message"))
    assert not failures, (failures, worker.log()[-3000:])
    assert (_job(result).state, _job(result).result) == (JobState.SUCCEEDED, 4), worker.log()[
        -3000:
    ]
    assert not worker.events("timed_out"), worker.log()[-3000:]
    _stops_cleanly(worker)


@pytest.mark.django_db(transaction=True)
def test_a_process_handlers_result_back_in_time_stands_though_its_process_lingers(workers):
    """--isolation process: a handler that returned at once but left a thread that is no
    daemon (or a forked child) keeps its process alive past the timeout; the result had
    come, yet the attempt failed with HandlerTimeout ("it stopped when told") and the job
    ran again. A result back in time stands; the process is killed (2, 4)."""
    result = returns_leaving_a_thread.enqueue("lingers", 15)
    worker = _start(workers, "timeout-linger", "--isolation", "process", timeout=5)
    wait_for(lambda: _phases("lingers") == ["returned"], 30, "the handler to return")
    wait_for(lambda: _job(result).state != JobState.CLAIMED, 30, "the job to end")
    assert (_job(result).state, _job(result).result) == (JobState.SUCCEEDED, "lingers")
    assert not JobFailure.objects.filter(job_id=int(result.id)).exists()
    assert not worker.events("timed_out"), worker.log()[-3000:]
    _stops_cleanly(worker)


@pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="a child's start-up is the same on every database: this 30 s wait runs in the "
    "SQLite passes",
)
@pytest.mark.django_db(transaction=True)
def test_a_process_handler_whose_start_hangs_is_killed_and_said_to_have_not_started(workers):
    """A child that never starts its handler (its start-up hangs: here a setup sleeping
    past START_ALLOWANCE_SECONDS) has its start-up counted once it alone lasted the
    allowance (30 s) and the timeout: killed, its attempt failed as one that had not
    started the handler (not "did not stop when told") (2, 3)."""
    result = add.enqueue(3, 3)
    worker = workers.start(
        "timeout-unstarted",
        *FAST,
        "--isolation",
        "process",
        "--grace",
        "1",  # the retry's child, should one start, is not waited for at the stop
        env_extra={
            **_options(TIMEOUT_SECONDS=TIMEOUT),
            "LEASES_WORKER_CHILD_SETUP_SECONDS": str(START_ALLOWANCE_SECONDS + 30),
        },
    )
    wait_for(
        lambda: JobFailure.objects.filter(job_id=int(result.id)).exists(),
        START_ALLOWANCE_SECONDS + 20,
        "the hung start to be failed",
    )
    failure = JobFailure.objects.get(job_id=int(result.id))
    assert failure.exception_class_path == TIMEOUT_CLASS, failure.message
    assert "had not started the handler yet and was killed" in failure.message
    [killed] = worker.events("process_killed", job_id=int(result.id))
    assert killed["reason"] == "timeout"
    _stops_cleanly(worker)
