"""The owner's writes: renew, ack, fail, release, checkpoint.

Each is an UPDATE filtered on id, claim token and state; its rowcount is the answer (1:
still the owner, 0: the claim is lost, and nothing is written). On PostgreSQL the renewal
of every held claim and a batch of acks are single UPDATE ... RETURNING statements beside
the portable ORM verb whose predicates they must agree with (one round trip for many
claims), and the acks of the handlers
that just finished ride with the worker's next woken claim (``ack_and_claim_rows()``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import models, router, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from . import conf
from .claiming import _DUE_CLAIM_CTES, _ROW_RETURNING, ClaimedJob, ClaimVerbs, _claimed_rows
from .deadlocks import retry_deadlock_victims
from .id_chunks import id_chunks
from .jsonsafe import statement_runs, stored_json
from .lease_statements import (
    ClaimRef,
    checked_lease,
    json_param,
    lease_end,
    lease_end_by_job,
    on_postgresql,
    pg_answer,
    pg_ids,
    pg_sql,
)
from .states import DeadReason, FailureKind, JobState

if TYPE_CHECKING:
    from .query import JobQuerySet

# The owner's ack of several jobs, each with its result: one UPDATE filtered on id, claim
# token and state (ack_many() alone, or riding with the woken claim in ack_and_claim_rows()).
_ACK_UPDATE = """UPDATE {job} AS j SET
        state = '{succeeded}', result = v.result, finished_at = statement_timestamp(),
        claim_token = NULL, lease_expires_at = NULL
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::jsonb[]) AS v(id, token, result)
    WHERE j.id = v.id AND j.claim_token = v.token AND j.state = '{claimed}'
    RETURNING j.id"""


@dataclass(frozen=True)
class RecordedFailure:
    """fail()'s answer when the claim still owned the job: the attempt recorded, and where
    the job went: "pending", to run again in ``retry_in`` seconds (database clock), or
    "dead", with its ``dead_reason``."""

    attempt: int
    state: JobState
    dead_reason: str
    retry_in: float | None

    @property
    def dead(self) -> bool:
        return self.state == JobState.DEAD


class OwnerVerbs(ClaimVerbs):
    """The claim's owner's writes of JobQuerySet (a mixin, on the claim they follow)."""

    # The renewal on PostgreSQL: the same predicate as the portable path of renew().
    _PG_RENEW = """
    UPDATE {job} AS j SET
        lease_expires_at = statement_timestamp()
            + make_interval(secs => COALESCE(%(lease)s::float8, v.lease)),
        heartbeat_at = statement_timestamp()
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(leases)s::float8[]) AS v(id, token, lease)
    WHERE j.id = v.id AND j.claim_token = v.token AND j.state = '{claimed}'
    RETURNING j.id
    """

    # The heartbeat's renewal on PostgreSQL (skip_locked): the same predicate, on the rows
    # no transaction holds. A handler's fenced() block that checkpoints locks its job's row
    # until it commits; waiting for it held up the renewal of every claim of the process,
    # and the jobs beside it ran out of lease (their results discarded, their attempts
    # counted as expired). FOR NO KEY UPDATE: the lock the plain UPDATE takes, which the
    # foreign-key checks of a failure or an effect row inserted meanwhile do not wait for.
    _PG_RENEW_SKIPPING = """
    WITH free AS (
        SELECT f.id, v.lease
        FROM {job} AS f
        JOIN unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(leases)s::float8[])
            AS v(id, token, lease) ON f.id = v.id
        WHERE f.claim_token = v.token AND f.state = '{claimed}'
        FOR NO KEY UPDATE OF f SKIP LOCKED
    )
    UPDATE {job} AS j SET
        lease_expires_at = statement_timestamp()
            + make_interval(secs => COALESCE(%(lease)s::float8, free.lease)),
        heartbeat_at = statement_timestamp()
    FROM free
    WHERE j.id = free.id
    RETURNING j.id
    """

    @retry_deadlock_victims
    def renew(
        self, claims: Iterable[ClaimRef], lease: float | None = None, *, skip_locked: bool = False
    ) -> set[Any]:
        """Push the lease of every claim forward in one statement; return the ids still held.

        An id missing from the answer is a lost claim: its handler must stop and its result
        be discarded. With ``skip_locked`` (the heartbeat's), on PostgreSQL, a row that a
        transaction still open holds locked (its handler's fenced() block) is skipped, not
        waited for, and so missing too: held_by_their_claims() tells such a row apart.
        """
        claims = list(claims)
        if not claims:
            return set()
        lease = checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        if on_postgresql(db):
            return pg_ids(
                self.model,
                db,
                self._PG_RENEW_SKIPPING if skip_locked else self._PG_RENEW,
                {
                    "ids": [c.pk for c in claims],
                    "tokens": [c.claim_token for c in claims],
                    "leases": [
                        float(getattr(c, "lease_seconds", conf.DEFAULT_LEASE_SECONDS))
                        for c in claims
                    ],
                    "lease": lease,
                },
            )
        manager = self.model._default_manager.using(db)
        ids = [c.pk for c in claims]
        tokens = [c.claim_token for c in claims]
        held = manager.filter(pk__in=ids, claim_token__in=tokens, state=JobState.CLAIMED)
        renewed = held.update(
            lease_expires_at=lease_end_by_job(claims, lease),
            heartbeat_at=Now(),
        )
        if renewed == len(claims):
            return set(ids)
        # Tokens are unique per claim and never return to 'claimed', so this read can only
        # shrink the answer (a job its owner just acknowledged), never grow it.
        return set(held.values_list("pk", flat=True))

    def held_by_their_claims(self, jobs: Iterable[ClaimRef]) -> set[Any]:
        """The ids of ``jobs`` still claimed with their claim's token, as last committed (a
        plain read, which waits for no lock): a renewal that skipped such a row found it
        locked by a transaction still open (a fenced() block of its handler, a takeover
        under way), not lost. Its lease was not pushed forward: the worker's watchdog
        gives the claim up once that lease has run out by its own clock."""
        tokens = {job.pk: job.claim_token for job in jobs}
        return self._ids_still_reading(tokens, JobState.CLAIMED, "claim_token")

    def acked_by_their_claims(self, jobs: Iterable[Any]) -> set[Any]:
        """The ids of ``jobs`` (claimed rows: ``pk``, ``fence``) that succeeded at their
        claim's fence: acknowledged by that claim, since any later claim moves the fence on.
        A renewal that misses such a job raced its handler's own ``fenced(ack=True)``
        commit: the claim ended in success, it was not lost."""
        fences = {job.pk: job.fence for job in jobs}
        return self._ids_still_reading(fences, JobState.SUCCEEDED, "fence")

    def _ids_still_reading(self, expected: dict[Any, Any], state: str, field: str) -> set[Any]:
        """The ids of ``expected`` whose row is in ``state`` with ``field`` at the value
        ``expected`` maps the id to, read in slices one statement can take."""
        found = set()
        for ids in id_chunks(self.db, list(expected)):
            rows = self.filter(pk__in=ids, state=state).values_list("pk", field)
            found |= {pk for pk, value in rows if value == expected[pk]}
        return found

    def _owned(self, claim: ClaimRef) -> JobQuerySet:
        db = self._db or router.db_for_write(self.model)
        return self.model._default_manager.using(db).filter(
            pk=claim.pk, claim_token=claim.claim_token, state=JobState.CLAIMED
        )

    @retry_deadlock_victims
    def ack(self, claim: ClaimRef, result: Any = None) -> bool:
        """Mark the job succeeded if ``claim`` still owns it. Raise InvalidJobArgument if
        ``result`` does not round-trip through JSON (nothing is written then)."""
        result = stored_json(result, "result")
        return (
            self._owned(claim).update(
                state=JobState.SUCCEEDED,
                result=result,
                finished_at=Now(),
                claim_token=None,
                lease_expires_at=None,
            )
            == 1
        )

    # A batch of acks on PostgreSQL: the same predicate as ack() and ack_many().
    _PG_ACK = _ACK_UPDATE

    @retry_deadlock_victims
    def ack_many(self, outcomes: Sequence[tuple[ClaimRef, Any]]) -> set[Any]:
        """Mark several jobs succeeded, each with its result, where the claim still owns
        the job; return the ids acknowledged. Raise InvalidJobArgument (nothing written) if
        a result does not round-trip through JSON.

        PostgreSQL: one UPDATE ... RETURNING. Elsewhere the owned rows are locked by a
        SELECT ... FOR UPDATE before the UPDATEs (as many as SENT_LIMIT asks, in one
        transaction), so the answer names exactly the rows this call moved (an UPDATE
        clears the tokens that would otherwise tell them apart).
        """
        results: dict[Any, Any] = {}
        sizes: dict[Any, int] = {}
        for claim, value in outcomes:
            size = [0]
            results[claim.pk] = stored_json(value, "result", size)
            sizes[claim.pk] = size[0]
        if not results:
            return set()
        db = self._db or router.db_for_write(self.model)
        if on_postgresql(db):
            return pg_ids(self.model, db, self._PG_ACK, _ack_params(outcomes, results))
        owned = self.model._default_manager.using(db).filter(
            pk__in=list(results),
            claim_token__in=[c.claim_token for c, _ in outcomes],
            state=JobState.CLAIMED,
        )
        with transaction.atomic(using=db):
            ids = set(owned.select_for_update().values_list("pk", flat=True))
            # Results in UPDATEs of at most SENT_LIMIT as sent (upper bounds): MariaDB
            # drops the connection for a statement past its max_allowed_packet.
            ordered = sorted(ids)
            for group in statement_runs(ordered, [sizes[pk] for pk in ordered]):
                result: Any = None
                if any(results[pk] is not None for pk in group):
                    result = Case(
                        *[
                            When(pk=pk, then=Value(results[pk], output_field=models.JSONField()))
                            for pk in group
                        ],
                        output_field=models.JSONField(),
                    )
                owned.filter(pk__in=group).update(
                    state=JobState.SUCCEEDED,
                    result=result,
                    finished_at=Now(),
                    claim_token=None,
                    lease_expires_at=None,
                )
        return ids

    # The acks of the jobs a worker's handlers just finished and its next woken claim, in one
    # statement: one round trip and one commit where there were two. The ack touches the
    # owner's claimed rows, the claim pending ones, so the two never meet. The answer has at
    # least one row, which carries the ids acknowledged; a row with a NULL id claimed nothing.
    _PG_ACK_CLAIM_DUE = (
        """
    WITH acked AS (
    """
        + _ACK_UPDATE
        + """
    ), """
        + _DUE_CLAIM_CTES
        + """
    SELECT claimed.*, '{pending}'::varchar AS was_state, a.acked_ids
    FROM (SELECT array_agg(id) AS acked_ids FROM acked) AS a LEFT JOIN claimed ON true
    ORDER BY claimed.priority DESC, claimed.available_at, claimed.id
    """
    )

    @retry_deadlock_victims
    def ack_and_claim_rows(
        self,
        outcomes: Sequence[tuple[ClaimRef, Any]],
        worker_id: str,
        queues: Iterable[str] | None = ("default",),
        limit: int = 1,
        lease: float | None = None,
    ) -> tuple[set[Any], list[ClaimedJob]]:
        """ack_many(outcomes), then claim_rows(..., settle=False), committed together: the
        ids acknowledged and the rows claimed. On PostgreSQL one statement, elsewhere one
        transaction; either way one commit where the two verbs make two, and a call that
        raises wrote neither (a refused result refuses the claim with it: the caller then
        sends the two apart). Raise InvalidJobArgument, nothing written, as ack_many does.

        The worker's busy path: each time handlers finish, their acks ride with the claim
        that fills their slots."""
        results = {c.pk: stored_json(r, "result") for c, r in outcomes}
        lease = checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        queues = None if queues is None else list(queues)
        if limit < 1 or not results or not on_postgresql(db):
            with transaction.atomic(using=db):
                acked = self.ack_many(outcomes)
                return acked, self.claim_rows(worker_id, queues, limit, lease, settle=False)
        sql = pg_sql(
            self._PG_ACK_CLAIM_DUE,
            self.model,
            db,
            all_queues=queues is None,
            returning=_ROW_RETURNING,
        )
        params = {"worker": worker_id, "queues": queues, "limit": limit, "lease": lease}
        params.update(_ack_params(outcomes, results))
        columns, rows = pg_answer(db, sql, params)
        acked_ids = rows[0][columns.index("acked_ids")] if rows else None
        return set(acked_ids or ()), _claimed_rows(db, columns, rows)

    @retry_deadlock_victims
    def fail(
        self,
        claim: ClaimRef,
        *,
        exception_class_path: str = "",
        message: str = "",
        traceback: str = "",
        retry: bool = True,
        retry_in: float | None = None,
        min_retry_in: float = 0.0,
        kind: str = FailureKind.EXCEPTION,
    ) -> RecordedFailure | None:
        """Record a failed attempt if ``claim`` still owns the job, and say where the job
        went (RecordedFailure); None, and nothing written, once the claim is lost.

        The job goes back to pending while it has attempts left, its deadline has not passed
        and ``retry`` is true, due after ``retry_in`` seconds on the database clock (by
        default the next step of the job's retry ladder; ``min_retry_in`` at least);
        otherwise it is dead-lettered with the reason. The class path, message and traceback
        are stored as storable.py makes them (lone surrogates and NUL escaped, cut at its
        limits), whoever calls.
        """
        from .storable import (
            MESSAGE_LIMIT,
            TRACEBACK_LIMIT,
            storable_name,
            storable_text,
        )

        db = self._db or router.db_for_write(self.model)
        if retry_in is None:
            retry_in = _retry_delay(
                getattr(claim, "retry", None), getattr(claim, "attempts", 1) or 1
            )
        retry_in = max(retry_in, min_retry_in)
        if retry:
            reason: Any = Case(
                When(deadline__lt=Now(), then=Value(DeadReason.DEADLINE)),
                When(attempts__gte=F("max_attempts"), then=Value(DeadReason.ATTEMPTS)),
                default=Value(""),
            )
            dead = Q(deadline__lt=Now()) | Q(attempts__gte=F("max_attempts"))
            state: Any = Case(
                When(dead, then=Value(JobState.DEAD)), default=Value(JobState.PENDING)
            )
            finished: Any = Case(
                When(dead, then=Now()), default=Value(None), output_field=models.DateTimeField()
            )
        else:
            reason = (
                DeadReason.UNRUNNABLE
                if kind == FailureKind.UNRUNNABLE
                else DeadReason.NON_RETRYABLE
            )
            state, finished = JobState.DEAD, Now()
        with transaction.atomic(using=db):
            # dead_reason and finished_at read attempts/deadline, which this UPDATE leaves
            # alone, so MySQL's left-to-right assignment cannot change their answers.
            if (
                self._owned(claim).update(
                    dead_reason=reason,
                    finished_at=finished,
                    state=state,
                    available_at=lease_end(max(retry_in, 0.0)),
                    claim_token=None,
                    lease_expires_at=None,
                )
                != 1
            ):
                return None
            job = (
                self.model._default_manager.using(db)
                .only("attempts", "fence", "claimed_by", "state", "dead_reason")
                .get(pk=claim.pk)
            )
            apps.get_model("django_leases", "JobFailure").objects.using(db).create(
                job_id=claim.pk,
                attempt=job.attempts,
                fence=job.fence,
                worker_id=job.claimed_by,
                kind=kind,
                exception_class_path=storable_name(exception_class_path),
                message=storable_text(message, MESSAGE_LIMIT),
                traceback=storable_text(traceback, TRACEBACK_LIMIT, keep_tail=True),
            )
        return RecordedFailure(
            attempt=job.attempts,
            state=JobState(job.state),
            dead_reason=job.dead_reason,
            retry_in=None if job.state == JobState.DEAD else max(retry_in, 0.0),
        )

    @retry_deadlock_victims
    def release(self, claim: ClaimRef, *, at_stop: bool = False) -> bool:
        """Give the job back to pending at once without counting the attempt (nor its
        worker: claimed_by cleared, so no TaskResult names it among the attempts).

        A release ``at_stop`` (the worker's, at a stop with the handler unfinished) is
        counted in ``releases``, and refused once the job has had UNCOUNTED_RELEASES of
        them since a checkpoint last moved its cursor: False, as for a lost claim
        (over_release_limit() tells them apart). Any other release (a handler that could
        not connect to the database: not the job's doing) is not counted."""
        owned = self._owned(claim)
        more: dict[str, Any] = {}
        if at_stop:
            owned = owned.filter(releases__lt=conf.UNCOUNTED_RELEASES)
            more["releases"] = F("releases") + 1
        return (
            owned.update(
                state=JobState.PENDING,
                available_at=Now(),
                attempts=F("attempts") - 1,
                claimed_by="",
                claim_token=None,
                lease_expires_at=None,
                **more,
            )
            == 1
        )

    def over_release_limit(self, claim: ClaimRef) -> bool:
        """Whether the claim is still held and its job has had its UNCOUNTED_RELEASES."""
        return self._owned(claim).filter(releases__gte=conf.UNCOUNTED_RELEASES).exists()

    @retry_deadlock_victims
    def checkpoint(
        self, claim: ClaimRef, cursor: Any, lease: float | None = None, *, moved: bool = True
    ) -> bool:
        """Commit ``cursor`` and renew the lease in one conditional UPDATE. A cursor that
        ``moved`` (not the one stored before) is progress: the job's count of releases at
        a stop starts again; the same cursor saved again (a keepalive) leaves it."""
        cursor = stored_json(cursor, "cursor")
        lease = checked_lease(lease)
        more = {"releases": 0} if moved else {}
        return (
            self._owned(claim).update(
                cursor=cursor,
                lease_expires_at=lease_end_by_job([claim], lease),
                heartbeat_at=Now(),
                **more,
            )
            == 1
        )


def _ack_params(
    outcomes: Sequence[tuple[ClaimRef, Any]], results: dict[Any, Any]
) -> dict[str, Any]:
    """The arrays _ACK_UPDATE reads: ids, claim tokens and results, in one order."""
    return {
        "ids": [c.pk for c, _ in outcomes],
        "tokens": [c.claim_token for c, _ in outcomes],
        "results": [json_param(results[c.pk]) for c, _ in outcomes],
    }


def _retry_delay(ladder: Any, attempts: int) -> float:
    """The delay after ``attempts`` failures by the row's own retry ladder; by the default
    ladder when the row holds none, or one that cannot be read (written straight into the
    table): recording the failure must not fail on the row's account."""
    from .retry import DEFAULT_RETRY, Retry

    try:
        return (Retry.from_json(ladder) if ladder else DEFAULT_RETRY).delay(attempts)
    except Exception:  # noqa: BLE001 -- InvalidLeaseOption, or TypeError from its parts
        return DEFAULT_RETRY.delay(attempts)
