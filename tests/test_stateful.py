"""Random sequences of claim/renew/ack/fail/release/checkpoint/expire keep invariants 1-5.

A model remembers every claim ever handed out (current and stale) and predicts which jobs
are claimable; after each step the database must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from django_leases.models import Job
from django_leases.states import JobState

LEASE = 300.0
MAX_ATTEMPTS = 3


@dataclass
class Claim:
    pk: int
    claim_token: object
    fence: int
    lease_seconds: float = LEASE


class Queue(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        Job.objects.all().delete()
        self.enqueued: set[int] = set()
        self.claims: list[Claim] = []  # every claim ever made, stale ones included
        self.fences: dict[int, int] = {}  # last fence handed out per job

    # -- model -----------------------------------------------------------------------

    def row(self, pk):
        return Job.objects.get(pk=pk)

    def owner(self, pk):
        job = self.row(pk)
        return job.claim_token if job.state == JobState.CLAIMED else None

    def is_current(self, claim):
        return self.owner(claim.pk) == claim.claim_token

    def claimable_ids(self):
        return set(Job.objects.claimable().values_list("pk", flat=True))

    # -- rules -----------------------------------------------------------------------

    @rule()
    def enqueue(self):
        job = Job.objects.enqueue(
            "tests.testapp.tasks.add", [1, 2], lease_seconds=LEASE, max_attempts=MAX_ATTEMPTS
        )
        self.enqueued.add(job.pk)

    @rule(worker=st.sampled_from(["w1", "w2", "w3"]))
    def claim(self, worker):
        claimable = self.claimable_ids()
        exhausted = set(
            Job.objects.expired()
            .filter(pk__in=claimable, attempts__gte=MAX_ATTEMPTS)
            .values_list("pk", flat=True)
        )
        got = Job.objects.claim(worker, limit=1)
        if not got:
            # Nothing claimable, or the first candidate had no attempts left and was buried.
            buried = {pk for pk in exhausted if self.row(pk).state == JobState.DEAD}
            assert not claimable or len(buried) == 1
            return
        [job] = got
        assert job.pk in claimable, "claimed a job whose lease was still valid (invariant 4)"
        assert job.fence == self.fences.get(job.pk, 0) + 1
        self.fences[job.pk] = job.fence
        stored = self.row(job.pk)
        assert stored.lease_expires_at - stored.heartbeat_at == timedelta(seconds=LEASE)  # inv. 1
        self.claims.append(Claim(job.pk, job.claim_token, job.fence))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def renew(self, data):
        batch = data.draw(
            st.lists(st.sampled_from(self.claims), min_size=1, max_size=4, unique_by=id)
        )
        expected = {c.pk for c in batch if self.is_current(c)}
        before = {c.pk: self.row(c.pk) for c in batch if not self.is_current(c)}
        assert Job.objects.renew(batch) == expected  # invariant 2
        for pk, row in before.items():
            if pk not in expected:
                assert self.row(pk).lease_expires_at == row.lease_expires_at  # invariant 5

    def _owner_write(self, claim, verb):
        current = self.is_current(claim)
        before = Job.objects.filter(pk=claim.pk).values().get()
        answered = verb(claim)
        assert answered is current  # invariant 2
        if not current:
            assert Job.objects.filter(pk=claim.pk).values().get() == before  # invariant 5

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def ack(self, data):
        self._owner_write(
            data.draw(st.sampled_from(self.claims)), lambda c: Job.objects.ack(c, "ok")
        )

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), retry=st.booleans())
    def fail(self, data, retry):
        self._owner_write(
            data.draw(st.sampled_from(self.claims)),
            # RecordedFailure for the owner, None once the claim is lost.
            lambda c: Job.objects.fail(c, message="boom", retry=retry) is not None,
        )

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def release(self, data):
        self._owner_write(data.draw(st.sampled_from(self.claims)), Job.objects.release)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), at=st.integers(0, 1000))
    def checkpoint(self, data, at):
        self._owner_write(
            data.draw(st.sampled_from(self.claims)), lambda c: Job.objects.checkpoint(c, {"at": at})
        )

    @precondition(lambda self: self.enqueued)
    @rule(data=st.data())
    def lease_runs_out(self, data):
        pk = data.draw(st.sampled_from(sorted(self.enqueued)))
        Job.objects.filter(pk=pk).expire_now()

    @precondition(lambda self: self.enqueued)
    @rule(data=st.data())
    def operator_cancels(self, data):
        pk = data.draw(st.sampled_from(sorted(self.enqueued)))
        Job.objects.filter(pk=pk).cancel()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def nothing_is_lost(self):
        """Invariant 3: every enqueued job is still there, in a state a person can see."""
        rows = dict(Job.objects.values_list("pk", "state"))
        assert set(rows) == self.enqueued
        assert set(rows.values()) <= set(JobState.values)

    @invariant()
    def fences_count_the_claims(self):
        for pk, fence in self.fences.items():
            assert self.row(pk).fence == fence

    @invariant()
    def attempts_never_exceed_the_ladder(self):
        assert not Job.objects.filter(state=JobState.CLAIMED, attempts__gt=MAX_ATTEMPTS).exists()


@pytest.mark.django_db
def test_random_sequences_keep_the_invariants():
    """Invariants 1-5 over random interleavings of every verb, stale claims included."""
    run_state_machine_as_test(
        Queue,
        settings=settings(
            max_examples=60,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
