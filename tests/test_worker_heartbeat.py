"""The heartbeat and watchdog threads: their default period, errors they outlive, and what
the worker does when renewals stop going through or a thread dies anyway.

Invariants (design.md): (2) rowcount is ownership, (3) nothing is lost, (4) duplicates only
after expiry. Faults are real where a real one exists (a row lock that holds a renewal, a
signal); where none does, a driver error is injected at Django's execute_wrappers of the
heartbeat thread's connection (tests/worker_faults.py), never in django_leases.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from django_leases.management.commands.run_lease_worker import Command
from django_leases.models import Job, JobFailure, WorkerProcess
from django_leases.states import JobState
from django_leases.worker.claims import Claim, ClaimBook
from django_leases.worker.heartbeat import Watchdog
from django_leases.worker.waker import Waker
from tests.testapp.tasks import add, hold
from tests.worker_helpers import BEAT, FAST, LEASE, POLL, job_of, wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]

# Four renewal periods per lease, and room for three failed renewals (retried every 0.2 s)
# inside one lease even on a loaded machine.
ROOMY = ["--lease", "4", "--heartbeat", "0.5", "--poll", str(POLL)]


def _defaults(**options):
    base = {
        "backend": None,
        "queues": None,
        "concurrency": None,
        "isolation": "thread",
        "lease": None,
        "heartbeat": None,
        "poll": None,
        "burst": False,
        "max_jobs": None,
        "grace": None,
        "worker_id": None,
    }
    return Command()._worker_kwargs({**base, **options})


def test_the_heartbeat_default_is_what_the_help_says(capsys):
    """--heartbeat defaults to the smaller of HEARTBEAT_SECONDS and lease / 3, the lease
    being --lease or else LEASE_SECONDS (30 s in the test settings), and --help says so."""
    assert _defaults()["heartbeat"] == 10
    assert _defaults(lease=6)["heartbeat"] == 2
    assert _defaults(lease=60)["heartbeat"] == 10
    assert _defaults(lease=60, heartbeat=25)["heartbeat"] == 25
    with pytest.raises(SystemExit):
        call_command("run_lease_worker", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "the smaller of HEARTBEAT_SECONDS and lease / 3" in text
    assert "--lease or else LEASE_SECONDS: 10 s without --lease" in text


@pytest.mark.slow
def test_the_heartbeat_outlives_an_interface_error(workers):
    """InterfaceError is no DatabaseError (MySQLdb raised it on a dead connection): renewals
    failing with it are retried like any database trouble, so the claim is kept past its
    first lease and the job acknowledged under its first fence (2, 4), and the worker goes
    on claiming."""
    result = hold.enqueue(6)
    a = workers.start(
        "iface-a",
        *ROOMY,
        env_extra={"LEASES_WORKER_FAULT": "leases-heartbeat:InterfaceError:3:django_leases_job"},
    )
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 30, "the held job")
    job = job_of(result)
    assert (job.fence, job.attempts, job.leases_lost) == (1, 1, 0)
    # Three failures in a row: one line when they start, the count when they end.
    failures = [r["error"] for r in a.events("renewal_failed", worker="iface-a")]
    assert failures == ["(0, '') injected by tests/worker_faults.py"], a.log()
    assert a.events("trouble_over", trouble="renewal_failed", failures=3), a.log()
    assert a.events("renewed", held=1, claims=1)
    assert not a.events("lost")
    after = add.enqueue(2, 3)
    wait_for(lambda: job_of(after).state == JobState.SUCCEEDED, 20, "a later job")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.slow
def test_a_dead_heartbeat_thread_makes_the_worker_release_and_exit_non_zero(workers):
    """A heartbeat thread ended outright (SystemExit passes any ``except Exception``) would
    leave the worker claiming jobs nobody renews. It stops claiming, releases what it holds
    (pending, attempt not counted: 3) and exits with status 1, saying why."""
    held = hold.enqueue(60)
    a = workers.start(
        "deadbeat-a",
        *FAST,
        env_extra={"LEASES_WORKER_FAULT": "leases-heartbeat:SystemExit:1:django_leases_job"},
    )
    assert a.wait_exit(LEASE + 20) == 1
    assert a.events("thread_died", worker="deadbeat-a", role="heartbeat"), a.log()
    job = job_of(held)
    assert (job.state, job.attempts, job.fence, job.claim_token) == (JobState.PENDING, 0, 1, None)
    assert a.events("released", job_id=job.pk, fence=1, worker="deadbeat-a")
    assert WorkerProcess.objects.get(worker_id="deadbeat-a").stopped_at is not None
    assert not JobFailure.objects.exists()


def test_overdue_excuses_a_new_claim_but_never_a_hung_beat():
    """Invariants 1 and 4 (monotonic intervals): the heartbeat's last good beat was 7 s ago
    (an idle 10 s wait); a job with a 3 s lease claimed just now is not overdue, nor while
    the beat it brings on is in flight. A beat tried and not through (hung, failing)
    counts from its start, so a stream of fresh claims does not hide it: 4 s after that
    beat began, overdue, though the newest claim is a second old."""
    from django_leases.worker.heartbeat import Heartbeat

    Job.objects.enqueue("tests.testapp.tasks.hold", [60])
    Job.objects.enqueue("tests.testapp.tasks.hold", [60])
    first, second = Job.objects.claim_rows("overdue-test", limit=2, lease=30)
    book, waker = ClaimBook(), Waker()
    beat = Heartbeat(
        book=book,
        database="default",
        worker_id="overdue-test",
        instance="i",
        period=10,
        lease=None,
        waker=waker,
        on_replaced=lambda holder: None,
    )
    try:
        t = time.monotonic()
        beat.beat_ok_at = t - 7
        assert beat.overdue(t) is None  # nothing held: 7 s of 30 (three periods)
        book.add(Claim(first, stamp=t - 0.1, lease=3, worker_id="overdue-test"))
        assert beat.overdue(t) is None
        beat.trying_since = t  # the beat the claim brought on, in flight
        assert beat.overdue(t + 0.5) is None
        # That beat hangs; claims keep coming (the first one done, a new one held).
        book.forget(book.all()[0])
        book.add(Claim(second, stamp=t + 3, lease=3, worker_id="overdue-test"))
        late = beat.overdue(t + 4)
        assert late is not None and late == (pytest.approx(4), 3)
        beat.beat_ok_at, beat.trying_since = t + 4.5, None  # it went through at last
        assert beat.overdue(t + 5) is None
    finally:
        waker.close()


def test_the_watchdog_outlives_an_error_in_one_round():
    """An exception in one watchdog round (here a logging filter that raises, as a broken
    LOGGING filter would) is logged and the next round carries on: the second expired claim
    is still declared lost, its handler told."""
    for _ in range(2):
        Job.objects.enqueue("tests.testapp.tasks.hold", [60])
    jobs = Job.objects.claim_rows("watchdog-test", limit=2, lease=30)
    book = ClaimBook()
    long_ago = time.monotonic() - 100
    claims = [Claim(job, stamp=long_ago, lease=1, worker_id="watchdog-test") for job in jobs]
    for claim in claims:
        book.add(claim)
    raised = []

    def broken_filter(record: logging.LogRecord) -> bool:
        if getattr(record, "event", None) == "lost" and not raised:
            raised.append(record)
            raise RuntimeError("a broken log filter")
        return True

    logger = logging.getLogger("django_leases.worker")
    logger.addFilter(broken_filter)
    waker = Waker()
    watchdog = Watchdog(book=book, worker_id="watchdog-test", period=0.2, waker=waker)
    try:
        watchdog.start()
        wait_for(lambda: all(c.handle.lost for c in claims), 10, "both claims to be lost")
        assert raised
        assert watchdog.is_alive() and not watchdog.died
    finally:
        watchdog.stop()
        watchdog.join(5)
        logger.removeFilter(broken_filter)
        waker.close()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_short_lease_claimed_mid_wait_is_no_overdue_heartbeat(workers, isolation):
    """Invariant 1 (local decisions on monotonic intervals): an idle worker beats every
    6 s; a job with a 2 s lease claimed 3 s into that wait had nothing to renew before, so
    the heartbeat is not overdue. Before, the worker warned "Heartbeat overdue ... 3.x s
    (lease 2 s)" and stopped claiming until the next beat, with a healthy database. The
    job is renewed at its own lease's pace and succeeds (3). A slot stays free with both
    jobs held (--concurrency 3), so the loop asks whether the heartbeat is on time at its
    next poll, before the heartbeat's catch-up beat (within a slice of the claim); with
    every slot taken, a handler process's start let that beat land first and the test
    passed on the old rule too."""
    a = workers.start(
        f"mid-wait-{isolation}",
        "--heartbeat",
        "6",
        "--poll",
        str(POLL),
        "--isolation",
        isolation,
        "--concurrency",
        "3",
    )
    time.sleep(3.5)  # into the heartbeat's 6 s wait, past the job's 2 s lease
    result = hold.using_lease(lease=2).enqueue(3)
    second = add.enqueue(1, 2)
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, 20, "the held job")
    wait_for(lambda: job_of(second).state == JobState.SUCCEEDED, 20, "the second job")
    assert job_of(result).attempts == 1
    assert not a.events("heartbeat_overdue"), a.log()
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


@pytest.mark.slow
def test_no_claims_while_a_renewal_hangs_for_longer_than_the_lease(workers):
    """A renewal that hangs (here on a lock of the worker's own row, which each beat
    updates; in production on a half-open connection) makes the watchdog give up the
    claims it holds; a job claimed meanwhile could not be renewed either, so the worker
    claims nothing until a renewal goes through again, then carries on (3). (A lock of the
    job's row no longer holds it up on PostgreSQL: the renewal skips such a row.)"""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite locks the whole database: a claim would wait like the renewal")
    held = hold.enqueue(60)
    # --grace 1: the held job, claimed again once its lease ran out, is released at the end.
    a = workers.start("stuck-a", *FAST, "--grace", "1")
    wait_for(lambda: job_of(held).state == JobState.CLAIMED, 20, "the held job")
    a.wait_event("renewed", held=1, claims=1)
    locked, unlock = threading.Event(), threading.Event()

    def lock_the_row():
        try:
            with transaction.atomic():
                list(WorkerProcess.objects.select_for_update().filter(worker_id="stuck-a"))
                locked.set()
                unlock.wait(60)
        finally:
            connection.close()

    locker = threading.Thread(target=lock_the_row)
    locker.start()
    try:
        assert locked.wait(10)
        a.wait_event("lost", job_id=held.id, fence=1, timeout=LEASE + 10)
        a.wait_event("heartbeat_overdue", worker="stuck-a", timeout=LEASE + 10)
        later = add.enqueue(1, 2)
        time.sleep(3 * POLL + 3 * BEAT + 1)
        assert job_of(later).state == JobState.PENDING
        assert not a.events("claimed", job_id=later.id)
    finally:
        unlock.set()
        locker.join(10)
    wait_for(lambda: job_of(later).state == JobState.SUCCEEDED, 20, "the later job")
    assert a.events("heartbeat_back", worker="stuck-a")
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0


def _claimed_with_link(task, args):
    """A job of ``task`` enqueued and claimed by worker "w", with the handle and link a
    slot would give its handler (lease stamp: now)."""
    from django_leases.api import JobHandle, Stamp, WorkerLink

    Job.objects.enqueue(task.module_path, args)
    [job] = Job.objects.claim("w")
    link = WorkerLink(
        lost=threading.Event(),
        stamp=Stamp(time.monotonic()),
        lease_seconds=job.lease_seconds,
        checkpointer=bool,
    )
    handle = JobHandle(
        job_id=job.pk,
        fence=job.fence,
        attempt=job.attempts,
        cursor=None,
        worker_id="w",
        claim_token=job.claim_token,
        link=link,
    )
    return job, handle, link


def test_a_handler_that_returns_past_its_lease_by_the_local_clock_is_lost_unsignalled():
    """Invariants 2 and 4: a handler that held the GIL through its lease starved the
    heartbeat thread; another worker may run the job now. What it returns or raises then is
    a lost claim's (discarded; the database decides), and task_finished is not sent: it
    said SUCCESSFUL for a result the worker then discarded."""
    from django.tasks.signals import task_finished, task_started

    from django_leases.worker.claims import Kind
    from django_leases.worker.running import run_task
    from tests.testapp.tasks import boom

    def claim(task):
        return _claimed_with_link(task, [1, 2] if task is add else [])

    sent = []

    def receiver(sender, task_result, **kwargs):
        sent.append((task_result.id, task_result.status))

    task_finished.connect(receiver)
    try:
        job, handle, link = claim(add)
        assert run_task(add, [1, 2], {}, handle, link).kind is Kind.OK
        assert sent == [(str(job.pk), "SUCCESSFUL")]
        for task, args in ((add, [1, 2]), (boom, [])):
            sent.clear()
            job, handle, link = claim(task)
            link.stamp.value = time.monotonic() - job.lease_seconds - 0.1
            assert run_task(task, args, {}, handle, link).kind is Kind.LOST, task
            assert sent == [], task
        # Told to stop by the worker's stop (released at the end), a result still stands
        # while the lease lasts; not once it ran out (a worker paused past its lease, then
        # sent SIGTERM, said SUCCESSFUL for a job another worker held).
        for expired, kind, signalled in ((False, Kind.OK, True), (True, Kind.LOST, False)):
            sent.clear()
            job, handle, link = claim(add)

            def stop(sender, task_result, link=link, lease=job.lease_seconds, late=expired, **kw):
                link.mark_lost(releasing=True)  # the worker's stop, as the handler runs
                if late:
                    link.stamp.value = time.monotonic() - lease - 0.1

            task_started.connect(stop, weak=False)
            try:
                assert run_task(add, [1, 2], {}, handle, link).kind is kind, expired
            finally:
                task_started.disconnect(stop)
            assert sent == ([(str(job.pk), "SUCCESSFUL")] if signalled else []), expired
    finally:
        task_finished.disconnect(receiver)


def test_a_handler_whose_claim_went_before_it_started_is_not_started():
    """Invariants 2 and 4: a worker paused between its claim and its handler's start (a
    SIGSTOP, a stall past the lease) started the handler on resuming, the claim already
    lost by its own clock, sometimes after another worker had finished the job: unfenced
    effects ran twice. A claim gone before the start runs nothing and sends no
    task_started (lost, cancelled or expired); one being released at a stop is stopped."""
    from django.tasks.signals import task_started

    from django_leases.worker.claims import Kind
    from django_leases.worker.running import run_task
    from tests.testapp.models import Effect
    from tests.testapp.tasks import record

    def claimed(key):
        return _claimed_with_link(record, [key])

    sent = []

    def receiver(sender, task_result, **kwargs):
        sent.append(task_result.id)

    task_started.connect(receiver)
    try:
        job, handle, link = claimed("expired")
        link.stamp.value = time.monotonic() - job.lease_seconds - 0.1
        assert run_task(record, ["expired"], {}, handle, link).kind is Kind.LOST
        job, handle, link = claimed("lost")
        link.mark_lost()
        assert run_task(record, ["lost"], {}, handle, link).kind is Kind.LOST
        job, handle, link = claimed("released")
        link.mark_lost(releasing=True)
        assert run_task(record, ["released"], {}, handle, link).kind is Kind.STOPPED
        assert sent == []
        assert not Effect.objects.exists()
        job, handle, link = claimed("held")
        assert run_task(record, ["held"], {}, handle, link).kind is Kind.OK
        assert sent == [str(job.pk)]
        assert list(Effect.objects.values_list("key", "phase")) == [
            ("held", "start"),
            ("held", "done"),
        ]
    finally:
        task_started.disconnect(receiver)


def test_a_sub_second_heartbeat_beats_at_the_period_its_row_says(workers):
    """Invariant 4: the admin takes a worker silent for two of its registered periods (and
    a second) for gone, and "Expire stalled claims now" ends its claims. The heartbeat slept
    in slices of 0.25 s, so a 0.3 s period beat every 0.5 s while its row said 0.3 s."""
    from datetime import datetime

    from django_leases import conf

    Job.objects.enqueue("tests.testapp.tasks.hold", [30], lease_seconds=3)
    w = workers.start("sub-second", "--lease", "3", "--heartbeat", "0.3", "--grace", "0")
    beats = wait_for(
        lambda: len(w.events("renewed")) >= 12 and w.events("renewed"), 30, "twelve renewals"
    )
    times = [datetime.fromisoformat(beat["time"]) for beat in beats]
    gaps = sorted((b - a).total_seconds() for a, b in zip(times, times[1:], strict=False))
    assert gaps[len(gaps) // 2] < 0.45, gaps
    # What the admin's "gone" allows: never exceeded while the worker is healthy.
    assert max(gaps) < conf.silent_after(0.3), gaps
    w.signal(signal.SIGTERM)
    assert w.wait_exit(30) == 0


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the renewal skips locked rows on PostgreSQL"
)
@pytest.mark.django_db(transaction=True)
def test_a_fenced_block_outlasting_the_lease_spares_the_claims_beside_it(workers):
    """A handler's fenced() block locks its job's row until it commits. The renewal of all
    the worker's claims (one statement) waited for that lock: a block longer than the lease
    starved every claim of the process, and the job beside it lost its claim, its result
    discarded, its attempt counted as expired (6: other jobs are untouched). The renewal
    skips a locked row, read back as still held: the job beside it is renewed throughout
    and succeeds in one attempt, its claim never lost (2)."""
    from tests.testapp.tasks import hold_fenced

    locked = hold_fenced.enqueue("fenced-long", 5.0)
    beside = hold.enqueue(7, "fenced-beside")
    a = workers.start(
        "fenced-a", "--lease", "3", "--heartbeat", "0.5", "--poll", str(POLL), "--concurrency", "2"
    )
    wait_for(lambda: job_of(beside).state == JobState.SUCCEEDED, 40, lambda: a.log()[-3000:])
    job = job_of(beside)
    assert (job.attempts, job.fence) == (1, 1), a.log()[-3000:]
    assert not a.events("lost", job_id=job.pk), a.log()[-3000:]
    assert not JobFailure.objects.filter(job_id=job.pk).exists()
    # Its own claim is given up once its lease has run out by the worker's clock: the
    # block outlived it (operations.md), and its row's lease was not pushed forward.
    assert a.events("lost", job_id=int(locked.id)), a.log()[-3000:]
    a.signal(signal.SIGTERM)
    assert a.wait_exit(30) == 0, a.log()[-3000:]
