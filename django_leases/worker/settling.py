"""Settling: the owner's writes of what the handlers came back with (a mixin of Worker).

Acks go out in one statement (or ride with the next claim: loop.py), fails and releases
one by one. A write the database refuses outright ends the attempt another way (a failure
instead of a refused result, a minimal record instead of a refused one) or drops the claim
to its lease; connection trouble leaves the outcome in the outbox, sent again after a
pause. A claim whose write went through is settled (claims.py), so nothing is sent twice.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from django.db import OperationalError, connections

from .. import conf
from ..api import FOUND_TAKEN
from ..exceptions import ReleasedTooOften
from ..safe_logging import WorkerLogger
from ..states import FailureKind
from ..storable import (
    CLASS_PATH_LIMIT,
    MESSAGE_LIMIT,
    ascii_text,
    class_path,
    first_line,
    storable_text,
)
from .claims import (
    FINISHING,
    RELEASING,
    Claim,
    ClaimBook,
    Kind,
    Outcome,
    read_back_acks,
)
from .dberrors import DB_ERRORS, error_kind, refused_by_database
from .logs import claim_fields

if TYPE_CHECKING:
    from ..models import Job as JobModel
    from .repeats import Trouble
    from .shutdown import StopRequest

logger = WorkerLogger()

# How many times one claim's ack or fail may fail over a connection that still answers
# (not an outage, then) before the database counts as refusing it.
WRITE_STRIKES = 3


class Settling:
    """The owner's writes of Worker: ack, fail, release, and what a refusal turns them into."""

    if TYPE_CHECKING:
        Job: type[JobModel]
        book: ClaimBook
        database: str
        worker_id: str
        _done: queue.SimpleQueue[tuple[Claim, Outcome]]
        _unsent: list[tuple[Claim, Outcome]]
        _writes_trouble: Trouble
        stop_request: StopRequest
        # Worker._db_trouble (loop.py): log, drop the connection, back off.
        _db_trouble: Callable[..., None]

        def _claims_left(self) -> int: ...

    def _last_writes_left(self) -> float | None:
        """At a stop, the seconds left to write (stopping.py); None while running."""
        return None

    def _settle(self, *, hold_acks: bool = False) -> list[tuple[Claim, Outcome]]:
        """Write what the handlers came back with: an outbox of (claim, outcome), those just
        returned and those a database outage left unsent. The acks go out in one statement,
        then the fails and releases one by one; should the database fail meanwhile, what
        was not written stays in the outbox for the next call. A claim whose write went
        through is settled (claims.py), so nothing is sent twice. With ``hold_acks`` the
        acks are returned, finishing but unsent, for the next claim to carry."""
        outbox, self._unsent = self._unsent, []
        while True:
            try:
                outbox.append(self._done.get_nowait())
            except queue.Empty:
                break
        writes = [(c, o) for c, o in outbox if self._to_write(c, o)]
        oks = [(c, o) for c, o in writes if o.kind is Kind.OK]
        others = [(c, o) for c, o in writes if o.kind is not Kind.OK]
        try:
            if oks and not hold_acks:
                others += self._acks(oks)
            for claim, outcome in others:
                self._write(claim, outcome)
        except DB_ERRORS as e:
            # A refused ack's failure replaces its ack (the later pair wins).
            unsent = {id(c): (c, o) for c, o in [*oks, *others] if c.state == FINISHING}
            for claim, _ in unsent.values():
                claim.finish_failed()
            self._unsent = list(unsent.values())
            left = self._last_writes_left()
            # Running, told in few lines with the claims' trouble; at a stop, every try.
            trouble = self._writes_trouble if left is None else None
            self._db_trouble("acknowledge", e, most=left, trouble=trouble)
            return []
        if writes and not hold_acks and (self._claims_left() == 0 or self.stop_request.stopping):
            # Written, and no claim follows to end the trouble of the loop's writes (a
            # worker past --max-jobs, or stopping): this ends it. While claims follow, a
            # claim does, so acks going through while claims fail do not end it each time.
            self._writes_trouble.over()
        return oks if hold_acks else []

    def _to_write(self, claim: Claim, outcome: Outcome) -> bool:
        """Whether ``outcome`` still needs a write by this worker; the claim then finishing."""
        if claim.decided is not None and outcome is not claim.decided:
            # A stop failed its timed-out attempt itself: what its slot (or the watchdog's
            # abandonment) brought afterwards is not a second outcome.
            return False
        if outcome.kind is Kind.ACKED or claim.acked:
            # Not to be released at shutdown: the job is done. (Acked with another outcome:
            # the handler acknowledged its job, then raised or was stopped.)
            claim.mark_acked()
            self.book.forget(claim)
            logger.debug(
                "Acked job=%s fence=%s worker=%s in the handler's fenced transaction",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "acked"),
            )
            return False
        if outcome.kind is not Kind.LOST and (claim.begin_finish() or claim.state == FINISHING):
            return True
        if outcome.kind not in (Kind.LOST, Kind.STOPPED) and claim.finish_released():
            # Came back before its release went: a result is acknowledged (not run again),
            # a failure raised before the notice recorded, as without the stop.
            return True
        self._discard(claim, outcome)
        return False

    def _acks(self, oks: list[tuple[Claim, Outcome]]) -> list[tuple[Claim, Outcome]]:
        """Acknowledge ``oks``; the failures to record instead of the results the database
        refused. Database trouble raises; anything else drops the unwritten claims."""
        try:
            return self._ack_or_refuse(oks)
        except DB_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 -- one claim must not stop the worker
            for claim, _ in oks:
                if claim.state == FINISHING:
                    self._drop(claim, "acknowledge", e)
            return []

    def _write(self, claim: Claim, outcome: Outcome) -> None:
        """Fail the attempt, or release the job (STOPPED); database trouble raises."""
        try:
            if outcome.kind is Kind.STOPPED:
                # Its process died of the stop (a signal to the whole process group or
                # cgroup): the job goes back to pending, the attempt not counted.
                self._release(claim, "; its handler process died while the worker was stopping")
            else:
                self._fail_or_minimal(claim, outcome)
        except DB_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 -- one claim must not stop the worker
            doing = "release" if outcome.kind is Kind.STOPPED else "record the failure of"
            self._drop(claim, doing, e)

    def _forget(self, claim: Claim) -> None:
        """Its write went through (or it is given up): settled, and no longer held."""
        claim.settle()
        self.book.forget(claim)

    def _drop(self, claim: Claim, doing: str, error: Exception) -> None:
        """Let go of a claim whose write failed on something other than the database (a
        row holding what no verb can read, a bug): its lease runs out and the next claim
        records the attempt as expired, so that one claim never stops the worker."""
        self._forget(claim)
        logger.error(
            "Could not %s job=%s fence=%s worker=%s error=%s: %s; dropping the "
            "claim, whose lease runs out",
            doing,
            claim.pk,
            claim.job.fence,
            self.worker_id,
            class_path(type(error)),
            first_line(error),
            exc_info=error,
            extra=claim_fields(claim.job, self.worker_id, "dropped", error=class_path(type(error))),
        )

    def _discard(self, claim: Claim, outcome: Outcome) -> None:
        self.book.forget(claim)
        if claim.state == RELEASING:
            logger.info(
                "Handler of job=%s fence=%s worker=%s has stopped; its job is to be released",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "handler_stopped"),
            )
            return
        logger.warning(
            "Discarded result of job=%s fence=%s worker=%s: the claim was lost (%s)",
            claim.pk,
            claim.job.fence,
            self.worker_id,
            # The worker's reason if it had one, else what the handler's side found (a
            # result that came back after the claim was lost carries none of its own).
            claim.lost_reason or (outcome.kind is Kind.LOST and outcome.message) or FOUND_TAKEN,
            extra=claim_fields(claim.job, self.worker_id, "discarded"),
        )

    def _ack(self, oks: list[tuple[Claim, Outcome]]) -> None:
        manager = self.Job.objects.using(self.database)
        if len(oks) == 1:
            claim, outcome = oks[0]
            acked = {claim.pk} if manager.ack(claim.job, outcome.result) else set()
        else:
            acked = manager.ack_many([(c.job, o.result) for c, o in oks])
        self._acked(oks, acked)

    def _acked(self, oks: list[tuple[Claim, Outcome]], acked: set[Any]) -> None:
        """The acks of ``oks`` went through: settle each, logged as acked (-v 2: Django's
        ``state=SUCCESSFUL`` line came first) or rejected (a warning)."""
        for claim, _ in oks:
            self._forget(claim)
            if claim.pk in acked:
                logger.debug(
                    "Acked job=%s fence=%s worker=%s",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    extra=claim_fields(claim.job, self.worker_id, "acked"),
                )
            else:
                logger.warning(
                    "Ack rejected job=%s fence=%s worker=%s: the claim was lost "
                    "before the ack; result discarded",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    extra=claim_fields(claim.job, self.worker_id, "ack_rejected"),
                )

    def _fail(self, claim: Claim, outcome: Outcome) -> None:
        unrunnable = outcome.kind is Kind.UNRUNNABLE
        recorded = self.Job.objects.using(self.database).fail(
            claim.job,
            exception_class_path=outcome.exception_class_path,
            message=outcome.message,
            traceback=outcome.traceback,
            # The delay before the next attempt is the job's own retry ladder (owner_writes.py).
            retry=outcome.retryable and not unrunnable,
            min_retry_in=outcome.min_retry_in,
            kind=FailureKind.UNRUNNABLE if unrunnable else FailureKind.EXCEPTION,
        )
        self._forget(claim)
        error = outcome.exception_class_path or outcome.kind.value
        if recorded is None:
            logger.warning(
                "Fail rejected job=%s fence=%s worker=%s: the claim was lost first",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "fail_rejected"),
            )
        elif recorded.dead:
            # The end of the job, for an operator to look at: a warning of its own.
            logger.warning(
                "Dead-lettered job=%s fence=%s worker=%s reason=%s attempt=%s error=%s: %s",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                recorded.dead_reason,
                recorded.attempt,
                error,
                outcome.message,
                extra=claim_fields(
                    claim.job,
                    self.worker_id,
                    "dead_lettered",
                    error=error,
                    reason=recorded.dead_reason,
                    attempt=recorded.attempt,
                ),
            )
        else:
            logger.info(
                "Failed job=%s fence=%s worker=%s attempt=%s error=%s: %s; retrying in %.1fs",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                recorded.attempt,
                error,
                outcome.message,
                recorded.retry_in,
                extra=claim_fields(
                    claim.job,
                    self.worker_id,
                    "failed",
                    error=error,
                    attempt=recorded.attempt,
                    retry_in=recorded.retry_in,
                ),
            )

    def _ack_or_refuse(self, oks: list[tuple[Claim, Outcome]]) -> list[tuple[Claim, Outcome]]:
        """Acknowledge ``oks`` in one statement. A batch the database refuses (a DataError,
        a constraint) is sent again one by one; a single result it refuses fails that
        attempt instead: returned, for the caller to record. Connection trouble raises."""
        try:
            self._ack(oks)
            return []
        except DB_ERRORS as e:
            if not self._refused(e, oks[0][0] if len(oks) == 1 else None):
                raise
            if len(oks) > 1:
                logger.warning(
                    "Ack of %d jobs refused worker=%s error=%s; acknowledging them one by one",
                    len(oks),
                    self.worker_id,
                    first_line(e),
                    extra={
                        "event": "batch_ack_refused",
                        "worker": self.worker_id,
                        "error": first_line(e),
                    },
                )
                return [failed for ok in oks for failed in self._ack_or_refuse([ok])]
            claim = oks[0][0]
            logger.warning(
                "Ack refused job=%s fence=%s worker=%s error=%s; failing the attempt instead",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                first_line(e),
                extra=claim_fields(claim.job, self.worker_id, "ack_refused", error=first_line(e)),
            )
            claim.write_strikes = 0
            return [(claim, _refusal(e, "the database refused the result"))]

    def _fail_or_minimal(self, claim: Claim, outcome: Outcome) -> None:
        """Record the failed attempt. Should the database refuse the record, a minimal one
        in ASCII ends the attempt; should it refuse that too, the claim is dropped and its
        lease runs out (the next claim records the attempt as expired)."""
        try:
            self._fail(claim, outcome)
            return
        except DB_ERRORS as e:
            if not self._refused(e, claim):
                raise
            logger.warning(
                "Failure record refused job=%s fence=%s worker=%s error=%s; "
                "recording a minimal one",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                first_line(e),
                extra=claim_fields(
                    claim.job, self.worker_id, "failure_refused", error=first_line(e)
                ),
            )
            minimal = replace(
                outcome,
                traceback="",
                exception_class_path=ascii_text(outcome.exception_class_path, CLASS_PATH_LIMIT),
                message=ascii_text(
                    f"the database refused the failure record "
                    f"({class_path(type(e))}: {first_line(e)}); the message "
                    f"began: {outcome.message[:500]}",
                    MESSAGE_LIMIT,
                ),
            )
        try:
            self._fail(claim, minimal)
        except DB_ERRORS as e:
            if not self._refused(e, claim):
                raise
            self._forget(claim)
            logger.error(
                "Could not record the failure of job=%s fence=%s worker=%s: the "
                "database refused even a minimal record (%s); dropping the claim, "
                "whose lease runs out",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                first_line(e),
                extra=claim_fields(
                    claim.job, self.worker_id, "failure_dropped", error=first_line(e)
                ),
            )

    def _refused(self, error: Exception, claim: Claim | None = None) -> bool:
        """Whether the database refused an owner's write itself, so that sending it again
        cannot help: an error other than a connection's, or (for one claim's write) the
        same write failing WRITE_STRIKES times over a connection that still answers, as
        MySQL reports a string its character set cannot hold. Anything else, lock waits and
        deadlocks included, is an outage: sent again after a pause, however long it lasts."""
        if refused_by_database(error):
            return True
        if not isinstance(error, OperationalError):
            return False
        kind = error_kind(error)
        if kind is not None:
            return kind == "refusal"
        if not self._connection_answers():
            return False
        if claim is None:
            return True  # several jobs in one statement: send them one by one
        claim.write_strikes += 1
        return claim.write_strikes >= WRITE_STRIKES

    def _connection_answers(self) -> bool:
        connection = connections[self.database]
        try:
            return connection.connection is not None and connection.is_usable()
        except Exception:  # noqa: BLE001 -- a connection that cannot say is not answering
            return False

    def _release(self, claim: Claim, why: str = "", *, at_stop: bool = True) -> bool:
        """Give the job back to pending, the attempt not counted; raise on database trouble.
        A job given back at stops too often (conf.UNCOUNTED_RELEASES, none of them its
        handler's doing but a stop: ``at_stop``) has this attempt failed instead."""
        jobs = self.Job.objects.using(self.database)
        released = jobs.release(claim.job, at_stop=at_stop)
        if not released and at_stop and jobs.over_release_limit(claim.job):
            self._fail(
                claim,
                Outcome(
                    Kind.ERROR,
                    exception_class_path=class_path(ReleasedTooOften),
                    message=f"given back at a worker's stop {conf.UNCOUNTED_RELEASES} times "
                    f"with no checkpoint moving its cursor between{why}: this stop counts "
                    "the attempt",
                ),
            )
            return True
        self._forget(claim)
        if released:
            logger.info(
                "Released job=%s fence=%s worker=%s: back to pending, attempt not counted%s",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                why,
                extra=claim_fields(claim.job, self.worker_id, "released"),
            )
        elif read_back_acks(self.Job, self.database, [claim]):
            # The handler's own fenced(ack=True) committed just before the release.
            logger.debug(
                "Acked job=%s fence=%s worker=%s in the handler's fenced transaction, "
                "before its release",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "acked"),
            )
        else:
            logger.warning(
                "Release rejected job=%s fence=%s worker=%s: the claim was already lost",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "release_rejected"),
            )
        return released


def _refusal(error: Exception, what: str) -> Outcome:
    """The failed outcome of a write the database refused: its error class and message."""
    return Outcome(
        Kind.ERROR,
        exception_class_path=class_path(type(error)),
        message=storable_text(f"{what}: {error}", MESSAGE_LIMIT),
    )
