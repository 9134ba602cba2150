"""run_lease_worker as real processes, stopped, killed and signalled for real.

Invariants (design.md): (1) one clock, (2) rowcount is ownership, (3) nothing is lost,
(4) duplicates only after expiry, (5) a stale owner's ack/checkpoint is rejected.
Leases are 2-3 s so that expiry happens within the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.models import Count

from django_leases.api import FOUND_TAKEN
from django_leases.models import Job, JobFailure, WorkerProcess
from django_leases.states import TERMINAL_STATES, FailureKind, JobState
from tests.testapp.models import Effect
from tests.testapp.tasks import ack_then_linger, add, hold, record, spawns, stubborn
from tests.worker_helpers import (
    ON_POSTGRES,
    PG_ONLY,
    Workers,
    descendants,
    process_ended,
    wait_for,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LEASE, BEAT, POLL = 2.0, 0.5, 0.2
FAST = ["--lease", str(LEASE), "--heartbeat", str(BEAT), "--poll", str(POLL)]


@pytest.fixture
def workers(tmp_path):
    pool = Workers(tmp_path)
    yield pool
    pool.close()


def job_of(result) -> Job:
    return Job.objects.get(pk=int(result.id))


def effects(key: str) -> list[tuple[int, str, str]]:
    return list(
        Effect.objects.filter(key=key).order_by("id").values_list("fence", "worker_id", "phase")
    )


def test_bad_options_are_refused_before_any_claim():
    """Invalid options raise a CommandError naming the option and claim nothing (3)."""
    result = add.enqueue(1, 2)
    cases = [
        (["--lease", "3", "--heartbeat", "3"], "--heartbeat"),
        (["--lease", "0.5"], "--lease"),
        (["--lease", "nan"], "--lease"),
        (["--poll", "nan"], "--poll"),
        (["--concurrency", "0"], "--concurrency"),
        (["--poll", "0"], "--poll"),
        (["--grace", "-1"], "--grace"),
        (["--max-jobs", "0"], "--max-jobs"),
        (["--backend", "nope"], "--backend"),
        (["--backend", ""], "--backend"),  # served the first backend without a word
        (["--queue", "nowhere"], "--queue"),
    ]
    for args, option in cases:
        with pytest.raises(CommandError, match=re.escape(option)):
            call_command("run_lease_worker", *args, "--burst")
    job = job_of(result)
    assert (job.state, job.fence, job.attempts) == (JobState.PENDING, 0, 0)


def test_kill_9_mid_job_is_completed_by_another_worker_within_the_lease(workers):
    """A SIGKILLed worker's job is taken over by another worker once its lease expires,
    within lease + heartbeat + poll, and only then (3, 4); the takeover is recorded as a
    lease_expired failure carrying the dead claim's fence."""
    result = record.enqueue("kill9", first_seconds=60, later_seconds=0)
    a = workers.start("kill9-a", *FAST)
    wait_for(lambda: effects("kill9"), 10, "the first handler to start")
    b = workers.start("kill9-b", *FAST)
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    a.wait_exit()
    wait_for(lambda: job_of(result).fence == 2, LEASE + BEAT + POLL + 2, "the takeover")
    took = time.monotonic() - killed
    # Not before the lease could have run out: the last renewal came at most one beat earlier.
    assert took >= LEASE - BEAT - 0.1, took
    assert took <= LEASE + BEAT + POLL + 0.3, took
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 5, "the job to succeed")
    job = job_of(result)
    assert (job.claimed_by, job.fence, job.attempts) == ("kill9-b", 2, 2)
    assert job.result == {"fence": 2, "worker": "kill9-b"}
    assert list(JobFailure.objects.filter(job=job).values_list("kind", "fence", "worker_id")) == [
        (FailureKind.LEASE_EXPIRED, 1, "kill9-a")
    ]
    assert effects("kill9") == [
        (1, "kill9-a", "start"),
        (2, "kill9-b", "start"),
        (2, "kill9-b", "done"),
    ]
    b.signal(signal.SIGTERM)
    assert b.wait_exit() == 0


def test_a_busy_worker_still_takes_over_an_expired_claim_while_its_backlog_lasts(workers):
    """Invariant 3: a worker kept busy by a backlog (woken each time a handler finishes, so
    nearly every claim is a woken one) still takes over an expired claim long before the
    backlog is gone. On PostgreSQL a woken claim takes due pending jobs only, so this holds
    because a settling claim runs at least every two poll intervals; before that rule the
    takeover waited for the backlog to drain."""
    dead = add.enqueue(1, 1)
    backlog = 160  # 160 x 50 ms: about 8 s of work for one slot
    for _ in range(backlog):
        hold.enqueue(0.05)
    # A claim of a worker that then vanished: its lease runs out while the backlog runs.
    [claimed] = Job.objects.claim("gone-worker", lease=LEASE)
    assert claimed.pk == int(dead.id)
    busy = workers.start("busy", "--concurrency", "1", *FAST)
    busy.wait_event("takeover", timeout=20, job_id=claimed.pk)
    pending = Job.objects.filter(task_path=hold.module_path, state=JobState.PENDING).count()
    assert pending >= backlog // 4, f"the takeover came after {backlog - pending} backlog jobs"
    wait_for(lambda: job_of(dead).state == JobState.SUCCEEDED, 20, "the taken-over job")
    assert job_of(dead).fence == 2
    busy.signal(signal.SIGTERM)
    assert busy.wait_exit() == 0


def test_sigstop_past_the_lease_then_sigcont_stops_the_first_handler(workers):
    """A worker frozen past its lease loses the job to another worker (4); once thawed, its
    handler is told within one heartbeat period and stops, and its result is never
    acknowledged (2, 5): the job keeps the second claim's result and fence."""
    result = record.enqueue("stop", first_seconds=8, later_seconds=0)
    a = workers.start("stop-a", *FAST)
    wait_for(lambda: effects("stop"), 10, "the first handler to start")
    a.signal(signal.SIGSTOP)
    b = workers.start("stop-b", *FAST)
    wait_for(
        lambda: job_of(result).state == JobState.SUCCEEDED, LEASE + 10, "the takeover to finish"
    )
    job = job_of(result)
    assert (job.claimed_by, job.fence, job.result) == (
        "stop-b",
        2,
        {"fence": 2, "worker": "stop-b"},
    )
    a.signal(signal.SIGCONT)
    thawed = time.monotonic()
    a.wait_event("lost", job_id=job.pk, fence=1, worker="stop-a", timeout=BEAT + 2)
    assert time.monotonic() - thawed <= BEAT + 0.5
    a.wait_event("discarded", job_id=job.pk, fence=1, worker="stop-a", timeout=BEAT + 2)
    assert not a.events("acked", job_id=job.pk)
    job = job_of(result)
    assert (job.state, job.fence, job.result) == (
        JobState.SUCCEEDED,
        2,
        {"fence": 2, "worker": "stop-b"},
    )
    assert list(JobFailure.objects.filter(job=job).values_list("kind", "fence", "worker_id")) == [
        (FailureKind.LEASE_EXPIRED, 1, "stop-a")
    ]
    # The first handler stopped: it never wrote its "done" effect.
    assert effects("stop") == [
        (1, "stop-a", "start"),
        (2, "stop-b", "start"),
        (2, "stop-b", "done"),
    ]
    for w in (a, b):
        w.signal(signal.SIGTERM)
        assert w.wait_exit() == 0


def test_a_killed_handler_takes_the_processes_it_started_with_it(workers):
    """(4) A process-isolated handler whose claim is lost is killed with the processes it
    started (its process group): a subprocess left running would go on with the job while
    another worker runs it again (before: the child alone was killed, and its `sleep`
    outlived the worker)."""
    result = spawns.enqueue("spawned", seconds=60)
    a = workers.start("spawn-a", "--isolation", "process", *FAST)
    wait_for(lambda: effects("spawned"), 20, "the handler's own process to start")
    sleeper = Effect.objects.get(key="spawned").pid

    def ended(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        return state in ("Z", "X")  # dead, whoever reaps it

    assert not ended(sleeper)
    Job.objects.filter(pk=job_of(result).pk).cancel()
    wait_for(lambda: ended(sleeper), BEAT + 6, "the handler's own process to end")
    assert a.events("process_killed", job_id=result.id), a.log()
    # A handler process that ends by itself (a crash) takes them with it too, before its
    # job is retried (before: the retry ran beside the last attempt's subprocess).
    crashed = spawns.using_lease(max_attempts=1).enqueue("crashed", seconds=60, crash=True)
    wait_for(lambda: job_of(crashed).state == JobState.DEAD, 20, "the crash to be recorded")
    crashed_sleeper = Effect.objects.get(key="crashed").pid
    wait_for(lambda: ended(crashed_sleeper), 5, "the crashed handler's own process to end")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def test_a_handler_that_ignores_cancellation_is_killed_in_process_isolation(workers):
    """In process isolation a handler that never checks for cancellation is killed soon
    after its claim is lost (4): it never writes its effect, and the worker carries on."""
    result = stubborn.enqueue("deaf", seconds=60)
    a = workers.start("deaf-a", "--isolation", "process", *FAST)
    wait_for(lambda: effects("deaf"), 20, "the child to start")
    child_pid = Effect.objects.get(key="deaf").pid
    assert child_pid != a.pid
    Job.objects.filter(pk=job_of(result).pk).cancel()
    cancelled = time.monotonic()

    def child_gone():
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(child_gone, BEAT + 4, "the child to be killed")
    # One beat to notice, one second to stop by itself, then SIGTERM.
    assert time.monotonic() - cancelled <= BEAT + 1.0 + 1.5
    assert a.events("process_killed", pid=child_pid, job_id=result.id), a.log()
    assert effects("deaf") == [(1, "deaf-a", "start")]
    assert job_of(result).state == JobState.CANCELLED
    after = add.enqueue(2, 3)
    wait_for(lambda: job_of(after).state == JobState.SUCCEEDED, 20, "the worker to carry on")
    assert job_of(after).result == 5
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_handlers_own_ack_is_no_lost_claim_to_the_heartbeat(workers, isolation):
    """A handler that acknowledges its job in fenced(ack=True) and goes on for a few
    heartbeats: the renewals miss the row, and the heartbeat reads why (succeeded at the
    claim's fence) instead of telling the handler its claim is lost (2, 5). In process
    isolation the child's ack reaches the worker as the shared acked flag, as it commits."""
    result = ack_then_linger.enqueue(f"linger-{isolation}", seconds=4 * BEAT)
    a = workers.start(f"linger-{isolation}", "--isolation", isolation, *FAST)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the handler's ack")
    a.wait_event("acked", job_id=int(result.id))
    assert effects(f"linger-{isolation}") == [
        (1, f"linger-{isolation}", "acked"),
        (1, f"linger-{isolation}", "done"),
    ]
    assert not a.events("lost", job_id=int(result.id)), a.log()
    assert not a.events("process_killed", job_id=int(result.id)), a.log()
    assert job_of(result).result == {"acked": True}
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_handler_running_on_after_its_own_ack_is_stopped_at_shutdown(workers, isolation):
    """SIGTERM while a handler that acknowledged its job itself runs on: at the end of the
    grace it is told to stop like any other, the job stays succeeded (not released, nor
    named as released), and the worker exits then (3). (In process isolation the heartbeat's
    renewal missed the row first, which is no loss: the child had set the claim's acked
    flag.)"""
    key = f"linger-stop-{isolation}"
    result = ack_then_linger.enqueue(key, seconds=60)
    a = workers.start(key, "--isolation", isolation, "--grace", "1", *FAST)
    wait_for(lambda: effects(key), 20, "the handler's ack")
    if isolation == "process":
        a.wait_event("renewed", claims=1, held=0, lost=0)
    a.signal(signal.SIGTERM)
    assert a.wait_exit(timeout=10) == 0, a.log()
    assert effects(key) == [(1, key, "acked")]
    job = job_of(result)
    assert (job.state, job.result) == (JobState.SUCCEEDED, {"acked": True})
    assert not a.events("released", job_id=int(result.id)), a.log()
    assert not a.events("release_rejected", job_id=int(result.id)), a.log()
    assert all(int(result.id) not in e["jobs"] for e in a.events("handlers_running")), a.log()
    # Stopping as told after its ack is not an error of the handler's.
    assert not a.events("raised_after_ack", job_id=int(result.id)), a.log()


def test_a_stop_right_after_a_childs_own_ack_releases_nothing(workers):
    """A stop right after a handler process acknowledged its job itself, before the
    outcome came (with the child's exit) and before any renewal missed the row (the
    heartbeat period is 100 s), its handler deaf to the stop: the child set the claim's
    shared acked flag when its ack committed, so the worker kills it as done, not as
    released (before: "released"), sends no release, and warns of no lost claim. The job
    stays succeeded (3, 5)."""
    key = "release-acked"
    result = ack_then_linger.enqueue(key, seconds=60, heed=False)
    a = workers.start(
        key, "--isolation", "process", "--grace", "0", "--lease", "300", "--heartbeat", "100"
    )
    wait_for(lambda: effects(key), 20, "the handler's ack")
    a.signal(signal.SIGTERM)
    assert a.wait_exit(15) == 0, a.log()
    assert effects(key) == [(1, key, "acked")]
    job = job_of(result)
    assert (job.state, job.result) == (JobState.SUCCEEDED, {"acked": True})
    assert not a.events("renewed", claims=1), a.log()  # no renewal learnt of the ack first
    assert not a.events("release_rejected"), a.log()
    assert not a.events("released", job_id=int(result.id)), a.log()
    [killed] = a.events("process_killed", job_id=int(result.id))
    assert killed["reason"] == "acked", a.log()


def test_a_stop_signal_to_a_handler_process_still_starting_waits_for_its_handler(workers):
    """A SIGTERM to every process of the service (systemd's KillMode=control-group, a
    container runtime) reached a handler process still starting (its interpreter, before
    its handlers for stop signals were in), and its default disposition ended it: the job
    failed (HandlerDied), an attempt counted. The thread that starts a child blocks them;
    the child unblocks them once it ignores them, and the job goes on (3, 6)."""
    result = hold.enqueue(1.0)
    a = workers.start("boot-term", "--isolation", "process", *FAST)
    signalled = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for _ in range(100):  # from its first moments, as often as the machine allows
            for pid in descendants(a.pid):
                with contextlib.suppress(OSError):
                    command = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"--multiprocessing-fork" in command and b"resource_tracker" not in command:
                        os.kill(pid, signal.SIGTERM)
                        signalled.add(pid)
            time.sleep(0.002)
        if (
            job_of(result).state in TERMINAL_STATES
            or JobFailure.objects.filter(job_id=result.id).exists()
        ):
            break
    assert signalled, "no handler process seen"
    job = job_of(result)
    failures = list(JobFailure.objects.filter(job_id=result.id).values_list("message", flat=True))
    assert (job.state, job.attempts, failures) == (JobState.SUCCEEDED, 1, []), a.log()[-3000:]
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0, a.log()[-3000:]


def test_a_handler_process_whose_worker_dies_while_it_starts_never_runs(workers):
    """A worker SIGKILLed while its handler process is still starting renews nothing any
    more, nor will it kill that process: the process notices its parent is gone and ends
    without running the handler, which would otherwise run unsupervised past its lease,
    beside the takeover's execution (4)."""
    result = stubborn.enqueue("orphan", seconds=60)
    setup = 2.0
    a = workers.start(
        "orphan-a",
        "--isolation",
        "process",
        *FAST,
        env_extra={"LEASES_WORKER_CHILD_SETUP_SECONDS": str(setup)},
    )
    child_pid = a.wait_event("process_started", timeout=20, job_id=int(result.id))["pid"]
    try:
        a.signal(signal.SIGKILL)
        a.wait_exit()
        assert not process_ended(child_pid), "the handler process ended before its set-up did"
        wait_for(lambda: process_ended(child_pid), setup + 5, "the orphaned handler process to end")
    finally:
        _kill_unless_ended(child_pid)  # its connection would outlive the test
    assert effects("orphan") == []
    assert a.events("orphaned", pid=child_pid, job_id=int(result.id)), a.log()
    job = job_of(result)
    assert (job.state, job.fence) == (JobState.CLAIMED, 1)


def test_a_handler_process_whose_worker_dies_ends_within_the_kill_grace(workers):
    """A worker SIGKILLed mid-job can no longer kill its handler process: the process
    sees its parent gone, and a handler that ignores cancellation is ended after the
    same grace the worker would have given it (4)."""
    result = stubborn.enqueue("orphan-running", seconds=60)
    a = workers.start("orphan-b", "--isolation", "process", *FAST)
    wait_for(lambda: effects("orphan-running"), 20, "the handler to start")
    child_pid = Effect.objects.get(key="orphan-running").pid
    try:
        a.signal(signal.SIGKILL)
        killed = time.monotonic()
        a.wait_exit()
        wait_for(lambda: process_ended(child_pid), 5, "the orphaned handler process to end")
        # 0.2 s to notice, one second of grace, scheduling.
        assert time.monotonic() - killed <= 0.2 + 1.0 + 3.0
    finally:
        _kill_unless_ended(child_pid)
    assert effects("orphan-running") == [(1, "orphan-b", "start")]
    assert a.events("orphaned", pid=child_pid, job_id=int(result.id)), a.log()
    job = job_of(result)
    assert (job.state, job.fence) == (JobState.CLAIMED, 1)


def test_a_handler_that_stops_when_its_worker_dies_ends_quietly(workers):
    """A handler that stops on LeaseLost once its worker was SIGKILLed returns an outcome
    nobody can take: its process ends as an orphan does, writing only the orphaned line
    (before: two chained BrokenPipeError tracebacks in the worker's log, which broke
    --log-format json) (6)."""
    from tests.testapp.tasks import hold

    result = hold.enqueue(60)
    a = workers.start("orphan-quiet", "--isolation", "process", *FAST)
    child_pid = a.wait_event("process_started", timeout=20, job_id=int(result.id))["pid"]
    # Django's RUNNING line, logged in the child just before it calls the handler.
    a.wait_event("task_running", timeout=20, job_id=result.id)
    try:
        a.signal(signal.SIGKILL)
        a.wait_exit()
        wait_for(lambda: process_ended(child_pid), 5, "the orphaned handler process to end")
    finally:
        _kill_unless_ended(child_pid)
    assert a.events("orphaned", pid=child_pid, job_id=int(result.id)), a.log()
    log = a.log()
    for line in log.splitlines():
        if line.strip():
            json.loads(line)  # every line a JSON record: no traceback of a failed send
    assert "BrokenPipeError" not in log, log[-3000:]


def test_a_worker_killed_during_a_lost_claims_grace_leaves_no_handler_running(workers):
    """The claim is lost (cancelled), and the worker is SIGKILLed within the second it gives
    the handler process before killing it: the process, told already, still sees its
    worker gone and ends after that grace (4). The kill must land inside that second, so a
    try whose kill came too late (a loaded machine) is made again, three times at most."""
    for n in range(3):
        key = f"orphan-told-{n}"
        result = stubborn.enqueue(key, seconds=60)
        a = workers.start(f"orphan-c{n}", "--isolation", "process", *FAST)
        wait_for(lambda key=key: effects(key), 20, "the handler to start")
        child_pid = Effect.objects.get(key=key).pid
        try:
            Job.objects.filter(pk=job_of(result).pk).cancel()
            a.wait_event("lost", job_id=int(result.id))
            a.signal(signal.SIGKILL)
            killed = time.monotonic()
            a.wait_exit()
            if a.events("process_killed", pid=child_pid):
                continue  # the worker killed it first: the kill came too late
            wait_for(
                lambda pid=child_pid: process_ended(pid), 5, "the orphaned handler process to end"
            )
            assert time.monotonic() - killed <= 0.2 + 1.0 + 3.0
        finally:
            _kill_unless_ended(child_pid)
        assert effects(key) == [(1, f"orphan-c{n}", "start")]
        assert a.events("orphaned", pid=child_pid, job_id=int(result.id)), a.log()
        return
    pytest.fail("in three tries the worker killed its handler before the test killed it")


def _kill_unless_ended(pid: int) -> None:
    if not process_ended(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_finishes_within_grace_then_releases_and_nothing_is_lost(workers):
    """SIGTERM: the short job finishes within --grace and is acked, the long one is released
    (pending, attempt not counted) and the worker row is marked stopped; another worker then
    completes it (3)."""
    short = record.enqueue("short", first_seconds=0.5)
    long = record.enqueue("long", first_seconds=60, later_seconds=0)
    a = workers.start("term-a", "--concurrency", "2", "--grace", "1.5", *FAST)
    wait_for(lambda: len(effects("short")) + len(effects("long")) == 2, 10, "both handlers")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0
    assert job_of(short).state == JobState.SUCCEEDED
    released = job_of(long)
    assert (released.state, released.attempts, released.fence, released.claim_token) == (
        JobState.PENDING,
        0,
        1,
        None,
    )
    assert a.events("released", job_id=released.pk, fence=1, worker="term-a")
    assert WorkerProcess.objects.get(worker_id="term-a").stopped_at is not None
    b = workers.start("term-b", "--burst", *FAST, ready=False)
    assert b.wait_exit() == 0
    done = job_of(long)
    assert (done.state, done.fence, done.attempts, done.claimed_by) == (
        JobState.SUCCEEDED,
        2,
        1,
        "term-b",
    )
    assert not JobFailure.objects.exists()


def test_a_second_signal_releases_at_once(workers):
    """A second SIGTERM does not wait out --grace: jobs are released and the worker exits (3),
    and says so (`hurried`, naming the signal; before, nothing told an early release from
    the end of the grace)."""
    result = hold.enqueue(60)
    a = workers.start("twice-a", "--grace", "60", *FAST)
    a.wait_event("claimed", job_id=result.id)
    a.signal(signal.SIGTERM)
    a.wait_event("stopping", signal="SIGTERM")
    sent = time.monotonic()
    a.signal(signal.SIGINT)
    assert a.wait_exit() == 0
    assert time.monotonic() - sent < 3
    assert a.events("hurried", signal="SIGINT"), a.log()[-3000:]
    job = job_of(result)
    assert (job.state, job.attempts) == (JobState.PENDING, 0)


def test_a_handler_hogging_its_thread_does_not_stop_renewals(workers):
    """Renewals run on their own thread: a handler blocking for twice the lease keeps its
    claim and is acknowledged with the first fence (2, 4)."""
    result = stubborn.enqueue("hog", seconds=2 * LEASE)
    a = workers.start("hog-a", *FAST)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 2 * LEASE + 5, "the job")
    job = job_of(result)
    assert (job.fence, job.attempts, job.claimed_by) == (1, 1, "hog-a")
    assert not JobFailure.objects.exists()
    assert a.events("renewed", held=1, claims=1)
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def test_heartbeats_of_500_held_jobs_cost_one_statement_per_period(workers):
    """500 concurrently held claims are renewed by one statement per heartbeat period, all
    on the database clock (1): every held row carries the same heartbeat_at. SIGTERM with no
    grace then releases all 500 (3)."""
    n = 500
    for _ in range(n):
        Job.objects.enqueue("tests.testapp.tasks.hold", [60], lease_seconds=3)
    # Its handlers use no database: 500 of them need no connection each.
    a = workers.start(
        "many-a",
        "--concurrency",
        str(n),
        "--lease",
        "3",
        "--heartbeat",
        "0.75",
        "--poll",
        "0.2",
        "--grace",
        "0",
        "--skip-connection-check",
    )
    wait_for(
        lambda: Job.objects.filter(state=JobState.CLAIMED, claimed_by="many-a").count() == n,
        20,
        "all jobs to be claimed",
    )

    def full_beats():
        return a.events("renewed", claims=n)

    beats = wait_for(lambda: len(full_beats()) >= 3 and full_beats(), 10, "three full renewals")
    assert all(beat["statements"] == 1 for beat in beats), beats
    assert all(beat["held"] == n for beat in beats), beats
    held = Job.objects.filter(state=JobState.CLAIMED, claimed_by="many-a")
    assert held.values("heartbeat_at").distinct().count() == 1
    a.signal(signal.SIGTERM)
    assert a.wait_exit(30) == 0, a.log()[-3000:]
    released = Job.objects.filter(state=JobState.PENDING, attempts=0).count()
    assert released == n, (
        sorted(Job.objects.values_list("state", "attempts").annotate(n=Count("id"))),
        a.log()[-3000:],
    )


@pytest.mark.skipif(not ON_POSTGRES, reason=PG_ONLY)
def test_notify_wakes_an_idle_worker_at_once(workers):
    """On PostgreSQL an enqueue wakes an idle worker through NOTIFY, long before its poll
    interval; the job still runs under a lease like any other (2)."""
    a = workers.start("notify-a", "--lease", "3", "--poll", "30")
    a.wait_event("listening")
    enqueued = time.monotonic()
    result = add.enqueue(20, 22)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 5, "the job")
    assert time.monotonic() - enqueued < 1.0
    assert job_of(result).result == 42
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.skipif(not ON_POSTGRES, reason=PG_ONLY)
def test_without_notify_polling_alone_runs_the_job(workers):
    """NOTIFY=False (PgBouncer transaction pooling): no LISTEN, and polling still finds
    every job (3)."""
    a = workers.start("poll-a", "--lease", "3", "--poll", "0.5", notify=False)
    result = add.enqueue(1, 1)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 5, "the job")
    assert not a.events("listening")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.skipif(not ON_POSTGRES, reason=PG_ONLY)
@pytest.mark.skipif(
    bool(os.environ.get("LEASES_POOLER_DIRECT_URL")),
    reason="through PgBouncer it would terminate the pooler's sessions that serve this test "
    "process too; tests/chaos cuts a pooled worker's connections instead",
)
def test_the_worker_survives_losing_its_connections(workers):
    """When PostgreSQL drops every connection of the worker mid-job, it logs, reconnects and
    keeps its claim (renewals resume within the lease), so the job succeeds with its first
    fence (2, 3, 4); handlers that use the database run again afterwards."""
    before = record.enqueue("conn-before")
    a = workers.start("conn-a", "--lease", "3", "--heartbeat", "0.5", "--poll", "0.2")
    wait_for(lambda: job_of(before).state == JobState.SUCCEEDED, 10, "a first job")
    held = hold.enqueue(2)
    wait_for(lambda: job_of(held).state == JobState.CLAIMED, 10, "the held job")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    wait_for(lambda: job_of(held).state == JobState.SUCCEEDED, 10, "the held job")
    assert (job_of(held).fence, job_of(held).attempts) == (1, 1)
    wait_for(
        lambda: a.events("renewal_failed") or a.events("db_trouble"),
        5,
        "the trouble to be logged",
    )
    after = record.enqueue("conn-after")
    wait_for(lambda: job_of(after).state == JobState.SUCCEEDED, 10, "a later job")
    # The handler's own connection was cut while idle; CONN_HEALTH_CHECKS reopens it.
    assert job_of(after).attempts == 1
    assert a.proc.poll() is None
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def _end_the_workers_sessions() -> None:
    """What a failover or a restart of the server does: every session of the test database
    but this test's own ends."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return
        cursor.execute(
            "SELECT id FROM information_schema.PROCESSLIST "
            "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        )
        for (session,) in cursor.fetchall():
            with contextlib.suppress(Exception):
                cursor.execute(f"KILL {int(session)}")


@pytest.mark.skipif(
    connection.vendor == "sqlite" or os.environ.get("LEASES_POOLER_DIRECT_URL") is not None,
    reason="SQLite has no sessions to end; through PgBouncer this would end the pooler's "
    "sessions that serve this test process too",
)
def test_jobs_after_a_failover_do_not_fail_on_the_connections_it_ended(workers):
    """(3) A failover ends every session: each handler slot kept a dead connection, and the
    next job on it failed with "terminating connection due to administrator command", an
    attempt spent (with Django's default CONN_HEALTH_CHECKS off, as here). The worker's own
    statements meet the failure first; each slot then checks its connection before its next
    handler, and the jobs after the failover run once, none failed."""
    warm = [record.enqueue(f"failover-warm-{i}", first_seconds=0.3) for i in range(3)]
    w = workers.start(
        "failover", *FAST, "--concurrency", "3", env_extra={"LEASES_WORKER_HEALTH_CHECKS": "0"}
    )
    wait_for(lambda: all(job_of(j).state == JobState.SUCCEEDED for j in warm), 30, "warm-up")
    _end_the_workers_sessions()
    wait_for(lambda: w.events("renewal_failed") or w.events("db_trouble"), 10, "the failover")
    after = [record.enqueue(f"failover-after-{i}") for i in range(6)]
    wait_for(lambda: all(job_of(j).state == JobState.SUCCEEDED for j in after), 30, "the jobs")
    assert [job_of(j).attempts for j in after] == [1] * 6
    assert not JobFailure.objects.filter(job_id__in=[j.id for j in after]).exists()
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0


@pytest.mark.skipif(
    connection.vendor != "postgresql" or os.environ.get("LEASES_POOLER_DIRECT_URL") is not None,
    reason="ends one session with pg_terminate_backend (not through PgBouncer)",
)
def test_a_slots_connection_unused_for_a_while_is_checked_before_the_next_handler():
    """(3) A server's idle_session_timeout, or a pooler's or firewall's idle limit, ends a
    connection a slot kept while no job came: unused for IDLE_CHECK_SECONDS, it is checked
    (one round trip) and replaced before the next handler, not handed to it dead."""
    import threading

    from django.db import connections

    from django_leases.worker import running

    seen = {}
    opened, ended = threading.Event(), threading.Event()

    def slot() -> None:
        try:
            assert running.connect_before_handler("default") is None
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                seen["first"] = cursor.fetchone()[0]
            opened.set()
            assert ended.wait(30)
            running._slot.used_at -= running.IDLE_CHECK_SECONDS + 1
            assert running.connect_before_handler("default") is None
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                seen["then"] = cursor.fetchone()[0]
        except BaseException as e:  # noqa: BLE001 -- reported below
            seen["error"] = repr(e)
        finally:
            connections.close_all()

    thread = threading.Thread(target=slot)
    thread.start()
    assert opened.wait(30), seen
    with connection.cursor() as cursor:  # this test's own session ends the slot's
        cursor.execute("SELECT pg_terminate_backend(%s)", [seen["first"]])
    ended.set()
    thread.join(30)
    assert "error" not in seen, seen
    assert seen["then"] != seen["first"]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_stale_owners_checkpoint_is_rejected_and_stops_the_handler(workers, isolation):
    """Once another claim took the job over, the first owner's next checkpoint matches no row
    (5): the stored cursor stays where the takeover found it and the handler stops (2). In
    process isolation the child sends the checkpoint itself."""
    from tests.testapp.tasks import count_up

    result = count_up.enqueue(10_000, 0.05)
    a = workers.start(
        "ckpt-a", "--lease", "6", "--heartbeat", "5", "--poll", "0.2", "--isolation", isolation
    )
    wait_for(lambda: (job_of(result).cursor or 0) >= 3, 30, "a few checkpoints")
    pk = job_of(result).pk

    class NotYet(Exception):
        pass

    def take_over():
        # Expiry and claim in one transaction, so no other claimer (the worker's own poll)
        # ever sees the lease ended; on MariaDB the claim's SKIP LOCKED may pass over the
        # row while the owner's checkpoint holds its token-index entry: then roll the
        # expiry back and try again.
        try:
            with transaction.atomic():
                Job.objects.filter(pk=pk).expire_now()
                claimed = Job.objects.claim("ckpt-thief", limit=1, lease=30)
                if not claimed:
                    raise NotYet
                return claimed
        except NotYet:
            return None

    [thief] = wait_for(take_over, 10, "the takeover")
    taken = job_of(result)
    assert (thief.pk, taken.fence, taken.claimed_by) == (taken.pk, 2, "ckpt-thief")
    discarded = a.wait_event("discarded", job_id=taken.pk, fence=1, worker="ckpt-a")
    assert a.events("checkpoint_rejected", job_id=taken.pk, fence=1) or a.events(
        "lost", job_id=taken.pk, fence=1
    )
    # The line says who found the loss: the handler's checkpoint, or a renewal first.
    assert (
        FOUND_TAKEN in discarded["message"] or "renewal matched no row" in discarded["message"]
    ), discarded["message"]
    after = job_of(result)
    assert (after.cursor, after.fence, after.claimed_by, after.state) == (
        taken.cursor,
        2,
        "ckpt-thief",
        JobState.CLAIMED,
    )
    assert Job.objects.ack(thief, "thief") is True
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def test_an_async_handler_is_cancelled_when_its_claim_is_lost(workers):
    """An ``async def`` handler's task is cancelled within one heartbeat period of the loss
    (an operator cancel here), so it never writes its effect, and nothing is acked (2, 5)."""
    from tests.testapp.tasks import async_record

    result = async_record.enqueue("async", 60)
    a = workers.start("async-a", *FAST)
    wait_for(lambda: effects("async"), 10, "the handler to start")
    Job.objects.filter(pk=job_of(result).pk).cancel()
    cancelled = time.monotonic()
    a.wait_event("discarded", job_id=result.id, fence=1, worker="async-a", timeout=BEAT + 2)
    assert time.monotonic() - cancelled <= BEAT + 0.5
    assert effects("async") == [(1, "async-a", "start")]
    assert job_of(result).state == JobState.CANCELLED
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0
