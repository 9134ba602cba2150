"""A claim's states and the handler processes behind it, unit by unit (no worker): how a
handler's own ack reaches the claim, and how the process executor's kill meets a start.

Invariants (design.md): (3) nothing is lost (a job its handler acknowledged is never
released to run again), (4) duplicates only after expiry (no handler process outlives a
worker that ends at once).
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from types import SimpleNamespace

import pytest

from django_leases.api import JobHandle
from django_leases.worker.claims import ACKED, RELEASING, Claim, Kind
from django_leases.worker.executors import ProcessExecutor
from django_leases.worker.stopping import Stopping
from tests.worker_helpers import process_ended, wait_for


def a_claim(**flags):
    job = SimpleNamespace(
        pk=1,
        fence=1,
        attempts=1,
        cursor=None,
        claim_token="token",
        database="default",
        task_path="tests.testapp.tasks.add",
        queue_name="default",
        args=[1, 2],
        kwargs={},
    )
    return Claim(job, stamp=0.0, lease=30.0, worker_id="w", **flags)


def test_a_claim_whose_acked_flag_is_set_moves_to_acked_not_released_or_lost():
    """(3) A child process's ack reaches the parent as the shared acked flag, set when its
    fenced(ack=True) commits: the claim's next move finds it, so a stop does not release
    the job (it tells the handler to stop as a finished one) and a renewal that misses the
    row declares no loss."""
    claim = a_claim()
    claim.acked_flag.set()  # as the child does, in shared memory
    assert claim.acked
    assert not claim.begin_release()
    assert claim.state == ACKED
    assert claim.stop_acked() and claim.lost_flag.is_set()
    assert not claim.mark_lost("renewal matched no row")
    assert claim.lost_reason == ""


def test_a_claim_holds_one_lease_that_its_handle_and_watchdog_read():
    claim = a_claim()
    assert claim.lease == claim.handle.lease_seconds == claim.link.lease_seconds == 30.0
    assert claim.handle.claim.lease_seconds == 30.0  # what a handler's renewals send
    # A handle built over a link takes its lease; a second, different value is refused.
    with pytest.raises(ValueError, match="lease_seconds=5"):
        JobHandle(
            job_id=1,
            fence=1,
            attempt=1,
            cursor=None,
            worker_id="w",
            lease_seconds=5,
            link=claim.link,
        )
    with pytest.raises(TypeError, match="lease_seconds"):
        JobHandle(job_id=1, fence=1, attempt=1, cursor=None, worker_id="w")


def test_an_ack_landing_after_the_release_began_is_still_known():
    """(3) A thread handler's ack that commits after its claim began releasing (the stop
    came between the block's end and the commit) leaves the state RELEASING, but the claim
    says it was acknowledged: _release_all skips it, and no release is sent."""
    claim = a_claim()
    assert claim.begin_release()
    claim.mark_acked()
    assert claim.state == RELEASING and claim.acked
    other = a_claim()
    assert other.begin_release()
    released = []
    stopping = SimpleNamespace(
        _call_until_done=lambda what, call: released.append((what, call)) or True,
        _release=None,
        book=None,
        worker_id="w",
    )
    Stopping._release_all(stopping, [claim, other])
    assert len(released) == 1  # the other claim's, and none for the acknowledged one


def test_a_result_returned_after_the_release_began_is_acknowledged_instead():
    """(3, 4) A handler told to stop at shutdown (link.releasing: not a lost claim) that
    returns a result before its release is sent finishes under the claim's token
    (finish_released), and _release_all sends no release for it; should the ack not go
    (database trouble), the claim is to be released again, as it was."""
    from django_leases.worker.claims import FINISHING

    claim = a_claim()
    assert claim.begin_release()
    assert claim.link.releasing and claim.lost_flag.is_set()
    assert claim.finish_released() and claim.state == FINISHING
    assert not claim.finish_released()
    claim.finish_failed()
    assert claim.state == RELEASING
    assert claim.finish_released()
    claim.settle()
    released = []
    stopping = SimpleNamespace(
        _call_until_done=lambda what, call: released.append(what) or True,
        _release=None,
        book=None,
        worker_id="w",
    )
    Stopping._release_all(stopping, [claim])
    assert released == []
    lost = a_claim()
    assert lost.mark_lost("renewal matched no row")
    assert not lost.link.releasing and not lost.finish_released()
    # A loss the handler heard of first (its checkpoint or fenced() write refused) stays a
    # loss when the stop's notice follows before the worker noticed: its result is no
    # release's to acknowledge.
    told = a_claim()
    told.link.mark_lost()
    assert told.begin_release() and not told.link.releasing


def test_what_a_handler_came_back_with_before_its_release_went_is_written():
    """(3, 6) At a stop, an outcome that arrives for a releasing claim is written under the
    claim: a result acknowledged, a failure (raised before the notice: one raised after it
    is LOST) recorded, as without the stop; a lost or stopped one is not."""
    from django_leases.worker.claims import FINISHING, Outcome
    from django_leases.worker.settling import Settling

    discarded = []
    settling = SimpleNamespace(book=None, _discard=lambda c, o: discarded.append(o.kind))
    for kind, written in (
        (Kind.OK, True),
        (Kind.ERROR, True),
        (Kind.UNRUNNABLE, True),
        (Kind.LOST, False),
        (Kind.STOPPED, False),
    ):
        claim = a_claim()
        assert claim.begin_release()
        assert Settling._to_write(settling, claim, Outcome(kind)) is written
        assert claim.state == (FINISHING if written else RELEASING)
    assert discarded == [Kind.LOST, Kind.STOPPED]


# Run in the parent after each start of a WatchedProcess, with it (a child unpickles the
# class by name, so it is defined here, at module level).
_after_start: list = []


class WatchedProcess(multiprocessing.get_context("spawn").Process):
    def start(self):
        super().start()
        for hook in _after_start:
            hook(self)


@pytest.fixture
def executor(monkeypatch):
    executor = ProcessExecutor(
        1, lambda claim, outcome: None, alias="default", worker_id="w", stopping=lambda: True
    )
    monkeypatch.setattr(executor._mp, "Process", WatchedProcess)
    monkeypatch.setattr(sys.modules[__name__], "_after_start", [])
    yield executor
    executor.close()


def a_process_claim(executor):
    lost, stamp, acked = executor.new_flags()
    return a_claim(lost_flag=lost, shared_stamp=stamp, acked_flag=acked)


def test_no_handler_process_starts_once_its_children_are_killed(executor):
    """(4) A slot thread that takes a claim after kill_children() (the process ending at
    once) starts no child that nobody would kill: its job is reported stopped."""
    started = []
    _after_start.append(started.append)
    executor.kill_children()
    outcome = executor.execute(a_process_claim(executor), None)
    assert outcome.kind == Kind.STOPPED, outcome
    assert started == []


def test_a_child_whose_start_meets_the_kill_is_killed_by_its_slot(executor):
    """(4) kill_children() while a child is being started (its process exists, but its
    Process cannot be killed until start() returns; start() waits for the child's
    interpreter when the arguments pass the pipe's buffer) cannot see it: the slot that
    started it kills it once start() returns. The start runs outside the executor's lock,
    so the kill does not wait for it (before: it waited, and the child ran its job)."""
    pids = []

    def kill_meanwhile(process):
        pids.append(process.pid)
        killer = threading.Thread(target=executor.kill_children)
        killer.start()
        killer.join(5)

    _after_start.append(kill_meanwhile)
    outcome = executor.execute(a_process_claim(executor), None)
    assert outcome.kind == Kind.STOPPED, outcome
    [pid] = pids
    wait_for(lambda: process_ended(pid), 5, "the child to end")
