"""Helpers for your own test suite: make leases run out, run jobs through the real worker
path, pause a worker, and assert a job ran exactly once.

    from django_leases import testing

    def test_receipt_is_sent_once():
        result = send_receipt.enqueue(42)
        testing.run_burst()                  # the real claim / heartbeat / ack path
        testing.assert_ran_once(result.id)

Everything here goes through the manager's verbs and the real worker; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any


def _job_id(job: Any) -> Any:
    """A Job, a TaskResult (``.id``) or an id."""
    for attr in ("pk", "id"):
        value = getattr(job, attr, None)
        if value is not None:
            return int(value) if isinstance(value, str) and value.isdigit() else value
    return job


def _jobs(using: str | None = None) -> Any:
    from .models import Job

    return Job.objects.using(using) if using else Job.objects


def expire_lease(job: Any, *, using: str | None = None) -> bool:
    """End the lease of a claimed job now (a second ago, database clock), as if its worker
    had stopped renewing: any worker may claim it again. True if the job was claimed."""
    expired: int = _jobs(using).filter(pk=_job_id(job)).expire_now()
    return expired == 1


def run_burst(
    *,
    backend: str | None = None,
    queues: list[str] | None = None,
    max_jobs: int | None = None,
    lease: float | None = None,
    worker_id: str = "test-worker",
) -> None:
    """Run a worker in this process until nothing is claimable (``--burst``): every due job
    is claimed, run on a handler thread under a renewed lease and acknowledged or failed,
    exactly as run_lease_worker would. Jobs whose retry is due later stay pending. Its
    arguments are checked as the command checks its options (InvalidLeaseOption naming
    one); called inside a transaction (Django's TestCase), it raises
    TransactionManagementError: its handler threads could not see what the test wrote."""
    from django.db import connections
    from django.db.transaction import TransactionManagementError

    from .worker import Worker
    from .worker.options import worker_kwargs

    kwargs = worker_kwargs(
        backend=backend,
        queues=queues,
        lease=lease,
        max_jobs=max_jobs,
        worker_id=worker_id,
        burst=True,
        connect_handlers=False,
    )
    if connections[kwargs["database"]].in_atomic_block:
        raise TransactionManagementError(
            "run_burst() runs handlers on threads of their own, with connections of their "
            "own: they cannot see this transaction's writes (a TestCase's), and its locks "
            "stall them. Use a transactional test: TransactionTestCase, or pytest-django's "
            "transactional_db (pytest.mark.django_db(transaction=True))."
        )
    # One handler, a quick poll, no grace and no LISTEN: a test's burst ends as soon as
    # nothing is claimable.
    kwargs.update(concurrency=1, poll=0.05, grace=0, notify=False)
    worker = Worker(**kwargs)
    worker.run()
    if (signum := worker.stop_request.signum) is not None:
        # Ctrl-C or a CI's SIGTERM stopped the burst as it stops a worker; the test runner
        # is owed it too (its own handler is back): a KeyboardInterrupt, or the end.
        signal.raise_signal(signum)


def run_job(job: Any, *, using: str | None = None, **options: Any) -> Any:
    """Run one burst (run_burst()) and return ``job`` re-read from the database: a job
    whose retry is due later is pending again."""
    run_burst(**options)
    return _jobs(using).get(pk=_job_id(job))


@contextlib.contextmanager
def paused(process: Any) -> Iterator[None]:
    """SIGSTOP a worker process (a Popen or a pid) for the block, SIGCONT after: its
    heartbeats stop while it stays alive, like a VM pause or a long GC (POSIX only)."""
    pid = getattr(process, "pid", process)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_ran_once(job: Any, *, using: str | None = None) -> Any:
    """Assert the job succeeded on its first claim: one attempt, no lease lost, no failure
    recorded. Return the job."""
    found = _jobs(using).get(pk=_job_id(job))
    problems = []
    if found.state != "succeeded":
        problems.append(f"state is {found.state!r}")
    if found.attempts != 1 or found.fence != 1:
        problems.append(f"claimed {found.fence} times ({found.attempts} attempts counted)")
    if found.leases_lost:
        problems.append(f"{found.leases_lost} leases ran out")
    failures = list(found.failures.values_list("kind", "message"))
    if failures:
        problems.append(f"failures recorded: {failures}")
    if problems:
        raise AssertionError(
            f"job {found.pk} ({found.task_path}) did not run exactly once: " + "; ".join(problems)
        )
    return found
