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


def _innodb_deadlocks():
    with connections["default"].cursor() as cursor:
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        return int(cursor.fetchone()[1])


def test_a_stale_checkpoint_chosen_as_deadlock_victim_answers_lost_not_an_error():
    """MySQL/MariaDB: a stale owner's checkpoint that reaches the row through the token index
    while a takeover holds the row is rolled back by InnoDB to break the cycle. The verb sends
    it again and answers False, the claim is lost (2), instead of raising; the takeover's
    state stays as it wrote it (5)."""
    from django.db import transaction

    if connections["default"].vendor != "mysql":
        pytest.skip("the lock cycle is InnoDB's: a row lock plus a secondary-index lock")
    fill(1)
    [stale] = Job.objects.claim("stale", limit=1)
    deadlocks = _innodb_deadlocks()
    answer: list[object] = []

    def checkpoint():
        try:
            answer.append(Job.objects.checkpoint(stale, 4))
        except Exception as e:  # surfaced below
            answer.append(e)
        finally:
            connections.close_all()

    with transaction.atomic():
        Job.objects.filter(pk=stale.pk).expire_now()
        writer = threading.Thread(target=checkpoint)
        writer.start()
        with connections["default"].cursor() as cursor:
            for _ in range(200):  # until the checkpoint waits for the row this block holds
                cursor.execute("SELECT COUNT(*) FROM information_schema.innodb_trx "
                               "WHERE trx_state = 'LOCK WAIT'")
                if cursor.fetchone()[0]:
                    break
                threading.Event().wait(0.01)
        [thief] = Job.objects.claim("thief", limit=1)
    writer.join(timeout=60)
    assert _innodb_deadlocks() > deadlocks, "no deadlock happened: the test proves nothing"
    assert answer == [False]
    job = Job.objects.get(pk=stale.pk)
    assert (job.claimed_by, job.fence, job.cursor, job.claim_token) == (
        "thief", 2, None, thief.claim_token)
