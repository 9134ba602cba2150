"""Keys, names and ids compare as spelled on every database (migration 0009).

MySQL's and MariaDB's default collations compare text without case, accents and trailing
spaces, and take any two characters beyond the Basic Multilingual Plane as one. A job
keyed "invoice-AB" collided there with "invoice-Ab"'s: refused, or merged into the other
key's job and never created. Each pair below differs in one such way; on every database
both of a pair are kept apart. Invariant 3: nothing is lost, nothing is merged that the
caller did not ask for.
"""

from __future__ import annotations

import pytest

from django_leases.exceptions import DuplicateJob
from django_leases.models import Job, JobEffect, WorkerProcess
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"
PAIRS = [
    ("invoice-Ab", "invoice-AB"),
    ("invoice", "invoice "),
    ("r\u00e9port", "report"),
    ("order-\U0001f600", "order-\U0001f389"),
]
IDS = ["case", "trailing space", "accent", "beyond the BMP"]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
def test_unique_keys_that_differ_in_any_character_are_jobs_of_their_own(first, second):
    """Before, on MariaDB: DuplicateJob, and on_duplicate="merge" answered the first key's
    job, the second never created."""
    one = add.using_lease(unique_key=first).enqueue(1, 1)
    two = add.using_lease(unique_key=second, on_duplicate="merge").enqueue(2, 2)
    assert one.id != two.id
    assert Job.objects.get(pk=two.id).unique_key == second
    assert two.args == [2, 2]
    with pytest.raises(DuplicateJob) as held:
        add.using_lease(unique_key=second).enqueue(3, 3)
    assert str(held.value.job_id) == two.id
    # The manager's enqueue, as an operator's code calls it: the same.
    three = Job.objects.enqueue(TASK, [4, 4], unique_key="manager-" + first)
    four = Job.objects.enqueue(TASK, [5, 5], unique_key="manager-" + second, on_duplicate="merge")
    assert three.pk != four.pk


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
def test_a_queue_serves_its_own_jobs_only(first, second):
    """A worker serving one queue claimed the other's jobs there."""
    theirs = Job.objects.enqueue(TASK, [1, 1], queue_name=second)
    assert Job.objects.claim("w", [first]) == []
    assert [j.pk for j in Job.objects.claim("w", [second])] == [theirs.pk]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
def test_worker_ids_and_effect_keys_that_differ_in_any_character_are_apart(first, second):
    """A worker id another's spelling held waited for that worker (one id, two processes);
    an effect recorded under one key made once() skip the other's."""
    for n, worker_id in enumerate([first, second]):
        held = WorkerProcess.objects.register(
            worker_id, instance=f"i{n}", hostname="h", pid=n + 1, queues=[], heartbeat_seconds=5
        )
        assert held is None  # taken, not held by the other
    assert sorted(WorkerProcess.objects.values_list("worker_id", flat=True)) == sorted(
        [first, second]
    )
    job = Job.objects.enqueue(TASK, [1, 1])
    for key in (first, second):
        JobEffect.objects.create(job=job, key=key, fence=1)
    assert sorted(job.effects.values_list("key", flat=True)) == sorted([first, second])


def test_the_admin_finds_schedules_and_workers_whatever_the_case_searched(admin_client):
    """The search stays blind to case where the columns compare as spelled: on MySQL a
    plain LIKE follows the column's collation, and "nightly" no longer found
    "Nightly-Report" there (6)."""
    from django_leases.models import Schedule
    from django_leases.schedules import Periodic, ScheduleSpec

    Schedule.objects.sync("default", [ScheduleSpec("Nightly-Report", TASK, Periodic(every=60))])
    WorkerProcess.objects.register(
        "Worker-One", instance="i", hostname="h", pid=1, queues=[], heartbeat_seconds=5
    )
    found = admin_client.get("/admin/django_leases/schedule/", {"q": "nightly-REPORT"})
    assert "Nightly-Report" in found.content.decode()
    assert (
        "Nightly-Report"
        not in admin_client.get("/admin/django_leases/schedule/", {"q": "weekly"}).content.decode()
    )
    found = admin_client.get("/admin/django_leases/workerprocess/", {"q": "worker-one"})
    assert "Worker-One" in found.content.decode()
