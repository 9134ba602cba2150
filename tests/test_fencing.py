"""fenced(), once() and fenced_update() against a real claim, without a worker."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from django_leases.api import JobHandle, Stamp
from django_leases.exceptions import LeaseLost
from django_leases.fencing import fenced, fenced_update, once
from django_leases.models import Job
from django_leases.states import JobState
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db


def handle_for(job):
    return JobHandle(
        job_id=job.pk,
        fence=job.fence,
        attempt=job.attempts,
        cursor=job.cursor,
        lease_seconds=job.lease_seconds,
        worker_id=job.claimed_by,
        lost=threading.Event(),
        stamp=Stamp(0.0),
        checkpointer=lambda c: True,
        claim_token=job.claim_token,
        database="default",
    )


def claimed():
    Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])
    [job] = Job.objects.claim("w")
    return job


def effect(job, phase):
    return Effect.objects.create(
        key="k", job_id=job.pk, fence=job.fence, worker_id="w", pid=1, phase=phase
    )


def test_fenced_commits_the_block_while_the_claim_is_held():
    """Invariant 2: the closing conditional UPDATE touched the row, so the block commits."""
    job = claimed()
    with fenced(handle=handle_for(job)):
        effect(job, "fenced")
    assert Effect.objects.filter(phase="fenced").count() == 1


def test_fenced_rolls_back_a_stale_owners_writes():
    """Invariant 5: the claim was taken over during the block: nothing of it commits."""
    job = claimed()
    handle = handle_for(job)
    with pytest.raises(LeaseLost), fenced(handle=handle):
        effect(job, "stale")
        Job.objects.filter(pk=job.pk).expire_now()
        Job.objects.claim("thief")
    assert not Effect.objects.filter(phase="stale").exists()
    assert handle.lost


def test_fenced_ack_commits_the_writes_and_the_ack_together(django_capture_on_commit_callbacks):
    """Invariant 2: one transaction: the effect and 'succeeded', or neither."""
    job = claimed()
    handle = handle_for(job)
    with (
        django_capture_on_commit_callbacks(execute=True),
        fenced(ack=True, result={"ok": 1}, handle=handle),
    ):
        effect(job, "with-ack")
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.result, handle.acked) == (JobState.SUCCEEDED, {"ok": 1}, True)
    assert Effect.objects.filter(phase="with-ack").exists()


def test_a_fenced_ack_rolled_back_by_the_callers_transaction_is_not_taken_as_acked(
    django_capture_on_commit_callbacks,
):
    """Invariant 3: the ack never committed, so the worker must still renew the claim and
    record the handler's outcome itself: the handle says acked only once the ack commits."""
    job = claimed()
    handle = handle_for(job)
    with (
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        with fenced(ack=True, result={"ok": 1}, handle=handle):
            effect(job, "rolled-back")
        raise RuntimeError("the caller's transaction fails after the block")
    assert not callbacks
    assert not handle.acked
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.claim_token) == (JobState.CLAIMED, job.claim_token)
    assert not Effect.objects.filter(phase="rolled-back").exists()


def test_once_records_an_effect_for_the_job_and_refuses_it_the_second_time():
    """Invariant 3 made livable: a retried attempt skips the effect the first one recorded."""
    job = claimed()
    first = handle_for(job)
    assert once("email-sent", handle=first) is True
    assert once("email-sent", handle=first) is False
    Job.objects.filter(pk=job.pk).expire_now()
    [again] = Job.objects.claim("w2")
    assert once("email-sent", handle=handle_for(again)) is False
    assert once("sms-sent", handle=handle_for(again)) is True
    assert list(job.effects.values_list("key", "fence")) == [("email-sent", 1), ("sms-sent", 2)]


def test_fenced_update_refuses_a_write_older_than_the_stored_fence():
    """Invariant 5: the store keeps the newest fence; an older writer changes nothing."""
    row = Effect.objects.create(key="balance", job_id=1, fence=0, worker_id="", pid=0, phase="v0")
    rows = Effect.objects.filter(pk=row.pk)
    assert fenced_update(rows, 2, phase="v2") == 1
    assert fenced_update(rows, 1, phase="v1-stale") == 0
    assert fenced_update(rows, 2, phase="v2-again") == 1
    row.refresh_from_db()
    assert (row.fence, row.phase) == (2, "v2-again")


def test_idempotency_key_is_the_same_for_every_attempt():
    job = claimed()
    key = handle_for(job).idempotency_key
    Job.objects.filter(pk=job.pk).expire_now()
    [again] = Job.objects.claim("w2")
    assert handle_for(again).idempotency_key == key and str(job.pk) in key


def test_fenced_outside_a_handler_says_so():
    with pytest.raises(RuntimeError, match="inside a job handler"), fenced():
        pass


# -- the check at commit, with the takeover on another connection ---------------------------


def take_over_elsewhere(job):
    """End the lease and claim the job on another thread, so on another connection: the
    takeover is committed when this returns, and nobody told the owner's handle."""
    from django.db import connections

    out = []

    def run():
        try:
            Job.objects.filter(pk=job.pk).expire_now()
            out.extend(Job.objects.claim("thief"))
        except Exception as e:  # surfaced below
            out.append(e)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the takeover is stuck: it waits for the owner's transaction"
    [thief] = out
    assert isinstance(thief, Job), thief
    assert (thief.fence, thief.claimed_by) == (job.fence + 1, "thief")
    return thief


def assert_the_stale_owner_changed_nothing(job, thief, handle, phase):
    """Invariant 5 as rowcounts: nothing of the block committed, the job is still the
    thief's, and every later write of the stale claim touches no row."""
    assert handle.lost and not handle.acked
    assert not Effect.objects.filter(phase=phase).exists()
    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.fence, stored.claim_token, stored.claimed_by, stored.result) == (
        JobState.CLAIMED,
        2,
        thief.claim_token,
        "thief",
        None,
    )
    assert Job.objects.renew([job]) == set()
    assert Job.objects.checkpoint(job, {"stale": True}) is False
    assert Job.objects.ack(job, "stale") is False
    assert Job.objects.ack(thief, "thief") is True


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ack", [False, True], ids=["renew", "ack"])
def test_fenced_refuses_the_commit_when_the_claim_is_taken_over_on_another_connection_mid_block(
    ack,
):
    """Invariant 5, by the check inside the transaction alone: the owner enters fenced()
    with its claim held and its lost flag unset (so the entry check passes), writes, and
    while the block is open another connection expires the lease and claims the job, and
    commits. Nothing tells the owner; the block's closing conditional UPDATE (renewal, or
    the ack) touches no row, so the block is rolled back and LeaseLost raised."""
    if connection.vendor == "sqlite":
        pytest.skip(
            "SQLite in IMMEDIATE mode holds the write lock for the whole block: a "
            "takeover on another connection waits for its end, it cannot commit mid-block "
            "(see the test below for a takeover the owner has not heard of)"
        )
    job = claimed()
    handle = handle_for(job)
    with pytest.raises(LeaseLost), fenced(ack=ack, result={"stale": True}, handle=handle):
        assert not handle.lost
        effect(job, "mid-block")
        thief = take_over_elsewhere(job)
        assert not handle.lost  # only the check at the end of the block can refuse it now
    assert_the_stale_owner_changed_nothing(job, thief, handle, "mid-block")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ack", [False, True], ids=["renew", "ack"])
def test_fenced_refuses_an_owner_that_has_not_heard_of_the_takeover(ack):
    """Invariant 5 on every database: the takeover committed on another connection before
    the block, but the owner's heartbeat has not noticed yet (lost flag unset), so entering
    fenced() succeeds. The closing conditional UPDATE finds another token: the block's
    writes are rolled back and LeaseLost raised."""
    job = claimed()
    handle = handle_for(job)
    thief = take_over_elsewhere(job)
    with pytest.raises(LeaseLost), fenced(ack=ack, result={"stale": True}, handle=handle):
        assert not handle.lost
        effect(job, "unheard")
    assert_the_stale_owner_changed_nothing(job, thief, handle, "unheard")


@pytest.mark.django_db(transaction=True)
def test_fenced_waits_for_a_lock_another_transaction_holds_on_its_row():
    """Invariant 2: the renewal closing a fenced() block waits for a lock another
    transaction holds on the job's row (the heartbeat's renewal, an admin's action), then
    commits the block. Only the heartbeat's renewal skips locked rows: with the block's
    own, a locked row read as a lost claim, LeaseLost raised and the writes rolled back."""
    from tests.worker_helpers import held_open

    if connection.vendor == "sqlite":
        pytest.skip("SQLite locks the whole database: no row lock to wait on")
    job = claimed()
    handle = handle_for(job)

    def commit_once_it_blocks(held):
        try:
            if held.until_it_blocks_another():
                held.commit()
        finally:
            connection.close()  # this thread's own

    with held_open(lambda: list(Job.objects.select_for_update().filter(pk=job.pk))) as held:
        waiter = threading.Thread(target=commit_once_it_blocks, args=(held,))
        waiter.start()
        with fenced(handle=handle):
            effect(job, "waited")
        waiter.join(30)
    assert not handle.lost
    assert Effect.objects.filter(phase="waited").count() == 1
