"""Workers whose clocks are an hour off claim, renew and expire exactly like the others.

Runs real processes with libfaketime preloaded: single manager calls an hour off
(tests/skewed.py), and whole run_lease_worker processes ten minutes off. The library comes
from the ``libfaketime`` package of the test extras, which builds it at install time (a C
compiler and make); LEASES_CHAOS_FAKETIME_LIB points at another build, such as Debian's
(/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1). On SQLite the database clock is
the process's own clock, so skew there is not something the queue can correct
(docs/concepts.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_leases.models import Job, WorkerProcess
from tests import procs

pytestmark = pytest.mark.django_db(transaction=True)

SKEWS = {"ahead": "+1h", "behind": "-1h"}


def faketime_library() -> str:
    """The libfaketime shared library to preload: LEASES_CHAOS_FAKETIME_LIB, else the one
    the ``libfaketime`` package (test extras) built when it was installed."""
    path = os.environ.get("LEASES_CHAOS_FAKETIME_LIB")
    if not path:
        try:
            import libfaketime
        except ImportError:
            pytest.fail(
                "the libfaketime package is missing: pip install -e '.[test]' "
                "(it builds the library: needs a C compiler and make)"
            )
        path = os.path.join(
            os.path.dirname(libfaketime.__file__),
            "vendor",
            "libfaketime",
            "src",
            "libfaketime.so.1",
        )
    if not os.path.exists(path):
        pytest.fail(
            f"libfaketime not found at {path}: reinstall the libfaketime package, or "
            "set LEASES_CHAOS_FAKETIME_LIB to a build of it"
        )
    return path


def skewed_env(offset: str) -> dict[str, str]:
    """What ``faketime -f OFFSET`` sets, without its wrapper process in between (so signals
    reach the process itself). Monotonic time stays real: the worker times its beats and
    waits with it, and a faked one makes every timed wait hang or spin."""
    return {
        "LD_PRELOAD": faketime_library(),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.fixture(autouse=True)
def _needs_server_clock():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's clock is the calling process's clock: nothing to correct")


def run_skewed(skew, action, arg):
    child = procs.python(
        "-m",
        "tests.skewed",
        action,
        str(arg),
        env=procs.child_env(**skewed_env(SKEWS[skew])),
        stdout=-1,
        stderr=-1,
        text=True,
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    report = json.loads(out)
    # The skew is real: the child's clock disagrees with the server's by about an hour.
    assert abs(abs(report["local"] - report["db"]) - 3600) < 60, report
    return report["answer"]


def enqueue():
    return Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])


def lease_left(job_id):
    job = Job.objects.annotate(now=Now()).get(pk=job_id)
    return job.lease_expires_at - job.now


@pytest.mark.parametrize("skew", ["ahead", "behind"])
def test_a_skewed_claim_gets_a_lease_measured_on_the_server_clock(skew):
    """Invariant 1: the lease ends 30 s after the server's now, whatever the worker's clock."""
    job = enqueue()
    assert run_skewed(skew, "claim", 30) == [job.pk]
    assert timedelta(seconds=25) < lease_left(job.pk) <= timedelta(seconds=30)


@pytest.mark.parametrize("skew", ["ahead", "behind"])
def test_a_skewed_renewal_extends_from_the_server_clock(skew):
    """Invariants 1 and 2: renewal answers 'held' and the new end is server now + lease."""
    enqueue()
    [job] = Job.objects.claim("w", lease=30)
    Job.objects.filter(pk=job.pk).update(lease_expires_at=Now() + timedelta(seconds=5))
    assert run_skewed(skew, "renew", job.pk) == [job.pk]
    assert timedelta(seconds=25) < lease_left(job.pk) <= timedelta(seconds=30)


def test_a_worker_an_hour_ahead_cannot_take_a_valid_lease():
    """Invariant 4: its clock says the lease ran out long ago; the server's says not."""
    enqueue()
    Job.objects.claim("w", lease=30)
    assert run_skewed("ahead", "claim", 30) == []


def test_a_worker_an_hour_behind_takes_an_expired_lease_at_once():
    """Invariant 3: its clock says the lease has an hour left; the server's says it ended."""
    job = enqueue()
    Job.objects.claim("w", lease=30)
    Job.objects.filter(pk=job.pk).expire_now()
    assert run_skewed("behind", "claim", 30) == [job.pk]


@pytest.mark.parametrize("skew", ["ahead", "behind"])
def test_a_skewed_enqueue_with_delay_is_due_by_the_server_clock(skew):
    """Invariant 1: the delay counts from the server's now."""
    job_id = run_skewed(skew, "enqueue", 60)
    job = Job.objects.annotate(now=Now()).get(pk=job_id)
    assert timedelta(seconds=50) < job.available_at - job.now <= timedelta(seconds=60)
    assert Job.objects.claim("w") == []


# -- a whole run_lease_worker under libfaketime ---------------------------------------------

# As the chaos suite does (tests/chaos/harness.py): libfaketime preloaded into the worker
# itself, no wrapper process, its monotonic clock left alone.
WORKER_SKEWS = {"ahead": ("+10m", 600), "behind": ("-10m", -600)}
# How far a stamp the worker is still writing may seem ahead of the reader's now(). A reading
# statement fixes now() when it starts and takes its snapshot a moment later (MariaDB), so a
# renewal committed in between is read with a stamp microseconds after the reader's now().
# A skewed clock would be ten minutes off; a second of slack cannot hide that.
IN_FLIGHT = timedelta(seconds=1)


def first_log_stamp(worker):
    """The worker's own wall clock, as its first log record stamped it (seconds since epoch)."""
    records = worker.records()
    assert records, worker.log()[:500]
    return datetime.fromisoformat(records[0]["time"]).timestamp()


@pytest.mark.slow
@pytest.mark.parametrize("skew", ["ahead", "behind"])
def test_a_worker_whose_clock_is_ten_minutes_off_claims_renews_and_acks_on_the_database_clock(
    workers, monkeypatch, skew
):
    """Invariant 1 for a real worker process: ``manage.py run_lease_worker`` with its wall
    clock ten minutes ahead or behind (libfaketime). Every lease it writes, at the claim and
    at each renewal, ends the database's now() + lease, never its own clock's; its heartbeat
    and its worker row carry the database's time; the job is claimed, renewed several times,
    and acknowledged once, under its first fence, with no lease lost."""
    from tests.testapp.tasks import hold
    from tests.worker_helpers import BEAT, FAST, LEASE, job_of, wait_for

    offset_spec, offset = WORKER_SKEWS[skew]
    for name, value in skewed_env(offset_spec).items():
        monkeypatch.setenv(name, value)
    started = time.time()
    worker = workers.start(f"skewed-{skew}", *FAST)
    monkeypatch.undo()  # nothing else this test starts is skewed
    # The skew is real: the worker stamped its first log line ten minutes off our clock.
    assert abs(first_log_stamp(worker) - started - offset) < 60, (worker.log()[:300], started)

    result = hold.enqueue(4 * LEASE)  # eight heartbeat periods
    lease = timedelta(seconds=LEASE)
    beats, wrong = set(), []

    def watch():
        job = Job.objects.annotate(db_now=Now()).get(pk=int(result.id))
        if job.state == "claimed":
            beats.add(job.heartbeat_at)
            # Written by one statement from the database clock: now() + lease exactly, and
            # that statement ran moments ago by the database's clock (not ten minutes off).
            ok = (
                job.lease_expires_at - job.heartbeat_at == lease
                and -IN_FLIGHT <= job.db_now - job.heartbeat_at < lease
            )
            if not ok:
                wrong.append((job.heartbeat_at, job.lease_expires_at, job.db_now))
        return job.state == "succeeded"

    wait_for(watch, 4 * LEASE + 30, "the job to be acknowledged", interval=0.1)
    assert not wrong, (
        f"leases not on the database clock (heartbeat, lease end, db now): {wrong[:3]}"
    )
    # Claimed, then renewed at each beat: at least half of the beats were seen.
    assert len(beats) >= 4 * LEASE / BEAT / 2, sorted(beats)
    job = Job.objects.annotate(db_now=Now()).get(pk=int(result.id))
    assert (job.fence, job.attempts, job.leases_lost, job.claimed_by) == (1, 1, 0, f"skewed-{skew}")
    assert not job.failures.exists()
    # Its other stamps are the database's too: the attempt started after the enqueue and
    # lasted the hold, and it finished moments ago by the database's clock.
    assert job.enqueued_at <= job.last_attempted_at < job.finished_at <= job.db_now
    assert (
        timedelta(seconds=4 * LEASE)
        <= job.finished_at - job.last_attempted_at
        < timedelta(seconds=4 * LEASE + 10)
    )
    assert job.db_now - job.finished_at < timedelta(seconds=30)
    seen = WorkerProcess.objects.annotate(db_now=Now()).get(worker_id=f"skewed-{skew}")
    assert -IN_FLIGHT <= seen.db_now - seen.last_seen_at < timedelta(seconds=30)
    assert timedelta(0) <= seen.db_now - seen.started_at < timedelta(seconds=120)
    assert not worker.events("lost")
    assert job_of(result).state == "succeeded"
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
