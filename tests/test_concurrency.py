"""Many threads and several processes claiming at once never share a valid lease."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
from django.db import connections

from django_leases.models import Job
from django_leases.states import JobState
from tests import procs

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "tests.testapp.tasks.add"


def fill(n):
    Job.objects.bulk_create([Job(task_path=TASK, args=[i, i], lease_seconds=300) for i in range(n)])


def test_threads_claiming_at_once_never_hold_the_same_job():
    """Invariant 4: with a lease longer than the run, every job is claimed exactly once,
    and invariant 2: every owner's ack touches its one row."""
    fill(1500)
    claims: list[tuple[int, int, bool]] = []
    lock = threading.Lock()
    errors = []

    def claimer(n):
        try:
            while True:
                batch = Job.objects.claim(f"thread-{n}", limit=7)
                if not batch:
                    return
                for job in batch:
                    acked = Job.objects.ack(job)
                    with lock:
                        claims.append((job.pk, job.fence, acked))
        except Exception as e:  # surfaced below
            errors.append(e)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    per_job = Counter(pk for pk, _, _ in claims)
    assert len(per_job) == 1500 and set(per_job.values()) == {1}
    assert all(acked for _, _, acked in claims)
    assert {fence for _, fence, _ in claims} == {1}
    assert Job.objects.exclude(state=JobState.SUCCEEDED).count() == 0


def test_processes_claiming_at_once_never_hold_the_same_job():
    """Invariants 3 and 4: four real processes drain 2,000 jobs; each job is claimed and
    acknowledged exactly once and none is left behind."""
    fill(2000)
    children = [procs.python("-m", "tests.claimer", f"proc-{n}", "5", "300", "3",
                             stdout=-1, stderr=-1, text=True) for n in range(4)]
    records = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        records.extend(json.loads(line) for line in out.splitlines())
    per_job = Counter(r["job"] for r in records)
    assert len(per_job) == 2000 and set(per_job.values()) == {1}
    assert all(r["acked"] for r in records)
    assert len({r["worker"] for r in records}) > 1, "the processes did not actually compete"
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 2000
    # A lost race never bumps a fence: the UPDATE re-checks the claim predicate.
    assert set(Job.objects.values_list("fence", flat=True)) == {1}
