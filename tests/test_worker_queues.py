"""Which queues a worker serves: the backend's QUEUES, the ones named, or every queue.

Django reads ``QUEUES: []`` as any queue name, so a worker of such a backend serves every
queue by default, and ``--all-queues`` asks for it explicitly; an absent ``QUEUES`` is
``["default"]`` to Django, and to the worker.
Real worker processes on every database; the claim verb's "every queue" form directly.
"""

from __future__ import annotations

import signal
import time

import pytest
from django.core.management import CommandError, call_command

from django_leases.models import Job, WorkerProcess
from django_leases.states import JobState
from tests.worker_helpers import ON_POSTGRES, PG_ONLY, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ADD = "tests.testapp.tasks.add"


def enqueue_in(*queues: str) -> list[Job]:
    return [Job.objects.enqueue(ADD, [i, 1], queue_name=q) for i, q in enumerate(queues)]


def states(jobs: list[Job]) -> list[str]:
    return [Job.objects.get(pk=j.pk).state for j in jobs]


def test_the_claim_of_every_queue_takes_jobs_of_any_queue_in_claim_order():
    """claim(queues=None) filters on no queue and keeps the claim order (priority, then
    due time, then id); a list still filters."""
    a, b, c = enqueue_in("default", "zzz-unlisted", "emails")
    Job.objects.filter(pk=c.pk).update(priority=5)
    assert [j.pk for j in Job.objects.claim_order(None)] == [c.pk, a.pk, b.pk]
    assert [j.pk for j in Job.objects.claim("w", ["default"], limit=5)] == [a.pk]
    claimed = Job.objects.claim("w", None, limit=5)
    assert [j.pk for j in claimed] == [c.pk, b.pk]
    assert all(j.was_state == JobState.PENDING for j in claimed)


@pytest.mark.slow
def test_a_worker_of_a_backend_without_queues_serves_every_queue(workers):
    """QUEUES: [] and no --queue: every queue, recorded as "*" in the worker row (3)."""
    jobs = enqueue_in("default", "zzz-unlisted", "reports", "another one")
    w = workers.start("anyq-a", "--poll", "0.2", "--burst", env_extra={"LEASES_WORKER_QUEUES": ""})
    assert w.wait_exit(timeout=30) == 0, w.log()
    assert states(jobs) == [JobState.SUCCEEDED] * 4, w.log()
    assert w.events("started", queue="*"), w.log()
    assert WorkerProcess.objects.get(worker_id="anyq-a").queues == ["*"]


@pytest.mark.slow
def test_a_worker_of_a_backend_with_no_queues_key_serves_default_as_django_reads_it(workers):
    """No QUEUES key at all: Django's backend accepts only "default" (its ``queues`` is
    {"default"}), so its worker serves that queue, not the jobs another lease backend on
    the same database keeps in queues of its own (it ran them with its own --burst, as
    "*"). --queue naming another queue is refused, saying what QUEUES reads as (3). The
    backend is one of the worker's settings only (tests/worker_settings.py)."""
    mine, theirs = enqueue_in("default", "reports")
    env = {"LEASES_WORKER_QUEUES": "-"}
    w = workers.start("noq-a", "--backend", "noqueues", "--poll", "0.2", "--burst", env_extra=env)
    assert w.wait_exit(timeout=30) == 0, w.log()
    assert states([mine, theirs]) == [JobState.SUCCEEDED, JobState.PENDING], w.log()
    assert w.events("started", queue="default"), w.log()
    assert WorkerProcess.objects.get(worker_id="noq-a").queues == ["default"]
    w = workers.start(
        "noq-b",
        "--backend",
        "noqueues",
        "--queue",
        "reports",
        "--burst",
        env_extra=env,
        ready=False,
    )
    assert w.wait_exit(timeout=30) != 0
    assert "absent, Django reads it as ['default']" in w.log(), w.log()


@pytest.mark.slow
def test_declared_queues_stay_the_default_and_all_queues_serves_the_rest(workers):
    """With QUEUES listed, a worker serves those by default; --all-queues takes any."""
    listed, unlisted = enqueue_in("reports", "zzz-unlisted")
    w = workers.start("listed-a", "--poll", "0.2", "--burst")
    assert w.wait_exit(timeout=30) == 0, w.log()
    assert states([listed, unlisted]) == [JobState.SUCCEEDED, JobState.PENDING]
    assert WorkerProcess.objects.get(worker_id="listed-a").queues == [
        "default",
        "emails",
        "reports",
    ]
    w = workers.start("all-a", "--all-queues", "--poll", "0.2", "--burst")
    assert w.wait_exit(timeout=30) == 0, w.log()
    assert states([unlisted]) == [JobState.SUCCEEDED]


def test_all_queues_and_queue_together_or_a_star_are_refused():
    """--all-queues with --queue is a usage error; --queue '*' is no wildcard (the shell
    would expand an unquoted one), and the message says what to use."""
    with pytest.raises(CommandError, match="not allowed with argument"):
        call_command("run_lease_worker", "--all-queues", "--queue", "default", "--burst")
    with pytest.raises(CommandError, match=r"--queue: .*use --all-queues"):
        call_command("run_lease_worker", "--queue", "*", "--burst")


def test_a_queue_given_twice_is_served_once():
    """--queue emails --queue default --queue emails: the worker row and its log named
    "emails, default, emails"; each queue once, in the order given."""
    from django_leases.worker.options import worker_kwargs

    given = ["emails", "default", "emails"]
    assert worker_kwargs(backend="default", queues=given)["queues"] == ["emails", "default"]


@pytest.mark.slow
@pytest.mark.skipif(not ON_POSTGRES, reason=PG_ONLY)
def test_notify_wakes_a_worker_of_every_queue_for_any_queue(workers):
    """LISTEN/NOTIFY: a job enqueued in a queue no list names wakes an all-queues worker
    long before its 30 s poll."""
    w = workers.start("anyq-notify", "--all-queues", "--lease", "3", "--poll", "30")
    w.wait_event("listening")
    time.sleep(0.3)  # past the first poll: only a notification can wake it now
    enqueued = time.monotonic()
    [job] = enqueue_in("zzz-unlisted")
    wait_for(lambda: states([job]) == [JobState.SUCCEEDED], 10, "the job")
    assert time.monotonic() - enqueued < 5, "woken by the poll, not by NOTIFY"
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0


@pytest.mark.parametrize(
    ("worker_id", "said"),
    [
        ("", "must be 1-200 characters"),
        ("w" * 201, "must be 1-200 characters"),
        ("   ", "printable characters with no space at either end"),
        (" web-1", "printable characters with no space at either end"),
        ("new\nline", "printable characters with no space at either end"),
        ("tab\there", "printable characters with no space at either end"),
    ],
)
def test_a_worker_id_that_would_name_nobody_or_split_log_lines_is_refused(worker_id, said):
    """(6) The id names the worker in every log line and the admin (before: a blank id
    was taken, and a newline split each text line in two)."""
    with pytest.raises(CommandError, match=rf"--worker-id: .*{said}"):
        call_command("run_lease_worker", "--worker-id", worker_id, "--burst")
