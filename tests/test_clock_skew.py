"""Workers whose clocks are an hour off claim, renew and expire exactly like the others.

Runs real processes under Debian's faketime. On SQLite the database clock is the process's
own clock, so skew there is not something the queue can correct (docs/concepts.md).
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_leases.models import Job
from tests import procs

pytestmark = pytest.mark.django_db(transaction=True)

SKEWS = {"ahead": "+1h", "behind": "-1h"}


@pytest.fixture(autouse=True)
def _needs_server_clock():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's clock is the calling process's clock: nothing to correct")
    if shutil.which("faketime") is None:
        pytest.fail("faketime is not installed (apt-get install faketime); .ci/run installs it")


def run_skewed(skew, action, arg):
    child = procs.python("-m", "tests.skewed", action, str(arg),
                         prefix=("faketime", "-f", SKEWS[skew]), stdout=-1, stderr=-1, text=True)
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
