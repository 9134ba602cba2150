"""Many threads and several processes claiming at once never share a valid lease."""

from __future__ import annotations

import json
import threading
import time
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
    children = [
        procs.python(
            "-m", "tests.claimer", f"proc-{n}", "5", "300", "3", stdout=-1, stderr=-1, text=True
        )
        for n in range(4)
    ]
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
                cursor.execute(
                    "SELECT COUNT(*) FROM information_schema.innodb_trx "
                    "WHERE trx_state = 'LOCK WAIT'"
                )
                if cursor.fetchone()[0]:
                    break
                threading.Event().wait(0.01)
        [thief] = Job.objects.claim("thief", limit=1)
    writer.join(timeout=60)
    assert _innodb_deadlocks() > deadlocks, "no deadlock happened: the test proves nothing"
    assert answer == [False]
    job = Job.objects.get(pk=stale.pk)
    assert (job.claimed_by, job.fence, job.cursor, job.claim_token) == (
        "thief",
        2,
        None,
        thief.claim_token,
    )


# -- takeovers of expired claims, raced ------------------------------------------------------
# (Appended below the tests above, its imports with it.)

import contextlib  # noqa: E402
import queue  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from django_leases.models import JobFailure  # noqa: E402
from django_leases.states import FailureKind  # noqa: E402


class Racers:
    """Claimer processes (tests/claimer.py --commands) that start each order together."""

    def __init__(self, tmp_path, n, *, limit, lease):
        self.children, self.lines, self.logs, self.readers = [], [], [], []
        for i in range(n):
            log = open(tmp_path / f"racer-{i}.log", "w")  # noqa: SIM115 -- closed in close()
            child = procs.python(
                "-m",
                "tests.claimer",
                "--commands",
                f"racer-{i}",
                str(limit),
                str(lease),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            lines: queue.Queue = queue.Queue()
            reader = threading.Thread(target=self._read, args=(child, lines), daemon=True)
            reader.start()
            self.readers.append(reader)
            self.children.append(child)
            self.lines.append(lines)
            self.logs.append(log)
        for i in range(n):
            assert self._next(i, 60) == {"ready": True}

    @staticmethod
    def _read(child, lines):
        for line in child.stdout:
            lines.put(json.loads(line))
        lines.put(None)

    def _next(self, i, timeout):
        try:
            record = self.lines[i].get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"racer-{i} said nothing for {timeout} s") from None
        if record is None:
            self.children[i].wait(10)
            raise AssertionError(
                f"racer-{i} exited ({self.children[i].returncode}):\n"
                f"{Path(self.logs[i].name).read_text()[-3000:]}"
            )
        return record

    def order(self, text, timeout=90):
        """Send ``text`` to every racer at once; return all their records once each is done.
        A claim starts at one instant for all, a moment after the last racer has its order
        (on a loaded machine the first one given it took every job before the others woke)."""
        if text == "claim":
            text = f"claim {time.time() + 0.3:.6f}"
        for child in self.children:
            child.stdin.write(text + "\n")
            child.stdin.flush()
        records = []
        for i in range(len(self.children)):
            while (record := self._next(i, timeout)) != {"done": True}:
                records.append(record)
        return records

    def close(self):
        for child in self.children:
            with contextlib.suppress(OSError):
                child.stdin.close()  # end of orders: the racer exits
        for child, reader, log in zip(self.children, self.readers, self.logs, strict=True):
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
            reader.join(10)
            child.stdout.close()
            log.close()


def fill_for_takeovers(n):
    """Jobs that survive many takeovers: the attempts never run out during a test."""
    Job.objects.bulk_create(
        [Job(task_path=TASK, args=[i, i], lease_seconds=300, max_attempts=1000) for i in range(n)]
    )
    return set(Job.objects.values_list("pk", flat=True))


def assert_only_the_newest_claim_acks(claims, acks):
    """Invariants 2 and 5: after the race, every racer checkpoints and acks every claim it
    ever made. Per job exactly one of them touches the row, the newest; every stale owner's
    checkpoint and ack touch nothing (rowcount 0), and the row keeps what the newest wrote."""
    newest = {}
    for c in claims:
        if c["job"] not in newest or c["fence"] > newest[c["job"]]["fence"]:
            newest[c["job"]] = c
    assert len(acks) == len(claims)
    for a in acks:
        is_newest = a["token"] == newest[a["job"]]["token"]
        assert (a["checkpointed"], a["acked"]) == (is_newest, is_newest), a
    for job in Job.objects.filter(pk__in=newest):
        owner = newest[job.pk]
        assert job.state == JobState.SUCCEEDED, (job.pk, job.state)
        expected = {"fence": owner["fence"], "worker": owner["worker"]}
        assert (job.fence, job.cursor, job.result) == (owner["fence"], expected, expected)


def test_processes_racing_to_take_over_expired_claims_each_win_one_fence(tmp_path):
    """Invariants 2, 4 and 5 on the takeover path (the one SQLite serves without SKIP
    LOCKED). Four processes, ordered at the same instant, race for 24 claims that
    expire_now() just ended, six times over. Each round every job is taken over by exactly
    one racer: its fence grows by exactly one, one owner per fence, and the takeover
    records the previous owner. Afterwards every stale owner's checkpoint and ack are refused."""
    n, rounds = 24, 6
    ids = fill_for_takeovers(n)
    racers = Racers(tmp_path, 4, limit=2, lease=300)
    try:
        by_round = [racers.order("claim")]  # round 0: the pending jobs
        for _ in range(rounds):
            assert Job.objects.expire_now() == n
            by_round.append(racers.order("claim"))
            # No job is left expired or unclaimed after a round.
            assert not Job.objects.expired().exists()
        acks = racers.order("ack")
    finally:
        racers.close()
    owner = {}
    for r, records in enumerate(by_round):
        per_job = Counter(c["job"] for c in records)
        assert set(per_job) == ids and set(per_job.values()) == {1}, (r, per_job)
        assert {c["fence"] for c in records} == {r + 1}, (r, records)
        assert all(c["stored_fence"] == c["fence"] for c in records), (r, records)
        owner.update({(c["job"], c["fence"]): c["worker"] for c in records})
    takeovers = [c for records in by_round[1:] for c in records]
    assert len({c["worker"] for c in takeovers}) > 1, "one racer took every job: no race"
    # Each takeover recorded the claim it ended: its fence and its owner, once.
    failures = JobFailure.objects.filter(kind=FailureKind.LEASE_EXPIRED)
    assert sorted(failures.values_list("job_id", "fence", "worker_id")) == sorted(
        (pk, fence, owner[pk, fence]) for pk in ids for fence in range(1, rounds + 1)
    )
    assert set(Job.objects.values_list("leases_lost", flat=True)) == {rounds}
    assert_only_the_newest_claim_acks([c for records in by_round for c in records], acks)


def test_takeovers_racing_a_stream_of_expiries_never_hand_out_a_fence_twice(tmp_path):
    """Invariants 2, 4 and 5 with no pause between expiry and claim: while three processes
    claim the same 12 jobs for three seconds, a thread of this process ends every lease
    over and over (as an operator's expire_now, or leases far shorter than a claim's round
    trip). Every claim hands out a fence no other claim got, the fence the row stores under
    its token, and the newest claim of each job is the row's owner; every stale owner's
    checkpoint and ack are refused."""
    ids = fill_for_takeovers(12)
    racers = Racers(tmp_path, 3, limit=3, lease=300)
    stop = threading.Event()
    expiries = []

    def expirer():
        try:
            while not stop.is_set():
                expiries.append(Job.objects.expire_now())
        except Exception as e:  # surfaced below
            expiries.append(e)
        finally:
            connections.close_all()

    thread = threading.Thread(target=expirer)
    try:
        thread.start()
        try:
            claims = racers.order("race 3")
        finally:
            stop.set()
            thread.join(60)
        rows = {job.pk: job for job in Job.objects.all()}
        acks = racers.order("ack")
    finally:
        racers.close()
    assert not [e for e in expiries if isinstance(e, Exception)], expiries
    assert sum(expiries) > len(ids), "the leases were hardly ever ended: no takeover raced"
    per_job = {}
    for c in claims:
        per_job.setdefault(c["job"], []).append(c)
    # Every claim round takes the first due rows again, so the last few jobs may never come
    # up in three seconds; the race is on the ones that do.
    assert set(per_job) <= ids and len(per_job) >= len(ids) // 2, sorted(per_job)
    for pk, mine in per_job.items():
        wrong = [c for c in mine if c["stored_fence"] not in (None, c["fence"])]
        assert not wrong, (
            f"job {pk}: {len(wrong)} of {len(mine)} claims handed out a fence "
            f"the row does not hold under their token, e.g. {wrong[:3]}"
        )
        fences = [c["fence"] for c in mine]
        assert len(fences) == len(set(fences)), (
            f"job {pk}: a fence handed out twice: {sorted(fences)}"
        )
        newest = max(mine, key=lambda c: c["fence"])
        job = rows[pk]
        assert (job.fence, str(job.claim_token), job.claimed_by) == (
            newest["fence"],
            newest["token"],
            newest["worker"],
        )
    assert max(len(mine) for mine in per_job.values()) > 3, "too few takeovers to call it a race"
    assert len({c["worker"] for c in claims}) > 1, "one racer took every claim: no race"
    assert_only_the_newest_claim_acks(claims, acks)
