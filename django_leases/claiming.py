"""The claim: who takes a job, with a fresh claim token, fence and lease.

On PostgreSQL one UPDATE ... RETURNING claims (a woken worker's, due pending jobs only, is
cheaper to plan); it sits beside the portable ORM path (SELECT ... FOR UPDATE SKIP LOCKED,
then an UPDATE that re-checks each row as read) whose predicates it must agree with, so a
worker pays one round trip where the portable path pays four (BEGIN, SELECT ... FOR
UPDATE, UPDATE, COMMIT). A
claim of an expired lease is a takeover, recorded as a spent attempt in the same statement
or transaction; a candidate that must not run again (past its deadline, no attempts left,
a task whose lost lease means dead-letter or park) is settled instead. ``claim_rows()``
answers plain ClaimedJob rows, the worker's: no model instance built per job.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from . import conf
from .deadlocks import retry_deadlock_victims
from .endings import PARK, ending, log_ended
from .lease_statements import checked_lease, lease_end_by_job, on_postgresql, pg_answer, pg_sql
from .states import FailureKind, JobState

if TYPE_CHECKING:
    from .models import Job

    # For the type checker the mixin is the queryset it is mixed into (see operators.py).
    _VerbsBase = models.QuerySet[Job]
else:
    _VerbsBase = object


def _count_if_expired() -> Case:
    """leases_lost + 1 when the row is a claim (being taken over or ended), else unchanged."""
    return Case(
        When(state=JobState.CLAIMED, then=F("leases_lost") + 1),
        default=F("leases_lost"),
        output_field=models.PositiveIntegerField(),
    )


def _granted_lease(job: Job) -> float | None:
    """The lease the claim's last claim or renewal granted: its end minus the heartbeat
    that set it, both written by one statement on the database clock. None if unknown."""
    if job.lease_expires_at is None or job.heartbeat_at is None:
        return None
    return round((job.lease_expires_at - job.heartbeat_at).total_seconds(), 1)


def _expiry_message(granted: float | None, owner: str) -> str:
    """The message of a lease_expired failure (the PostgreSQL claim writes the same)."""
    owner = owner or "its worker"
    if granted is None or conf.ended_early(granted):
        return f"lease was ended early, before {owner} acknowledged"
    return f"lease of {granted:g} s ran out before {owner} acknowledged"


def _token_case(tokens: dict[Any, uuid.UUID]) -> Case:
    return Case(
        *[
            When(pk=pk, then=Value(token, output_field=models.UUIDField()))
            for pk, token in tokens.items()
        ],
        output_field=models.UUIDField(),
    )


# Fields whose new values the claim sets on the database clock; dropped from the returned
# instances so that reading them loads the database's value instead of a guess.
_DB_CLOCK_FIELDS = ("lease_expires_at", "heartbeat_at", "last_attempted_at", "started_at")


def _pg_claim(model: Any, db: str, sql: str, params: dict[str, Any]) -> list[Any]:
    """Claim in one statement; the jobs carry their state before the claim on ``was_*``."""
    return list(model._default_manager.using(db).raw(sql, params))


@dataclass(slots=True, eq=False)
class ClaimedJob:
    """A row just claimed, as plain values: what the worker, the owner's verbs (``pk``,
    ``claim_token``, ``lease_seconds``, ``retry``, ``attempts``) and a TaskResult read, with
    no model instance built. ``was_*`` is the row as it was before the claim."""

    pk: Any
    database: str
    task_path: str
    queue_name: str
    priority: int
    run_after: datetime | None
    args: Any
    kwargs: Any
    cursor: Any
    retry: Any
    state: str
    fence: int
    attempts: int
    max_attempts: int
    claim_token: Any
    lease_seconds: float
    claimed_by: str
    enqueued_at: datetime | None
    started_at: datetime | None
    last_attempted_at: datetime | None
    was_state: str | None = None
    was_claimed_by: str | None = None
    was_fence: int | None = None
    was_lease: float | None = None
    finished_at: None = None
    result: None = None

    @classmethod
    def of(cls, job: Any, database: str, times: tuple[Any, Any]) -> ClaimedJob:
        """From a Job the portable claim returned; ``times``: its started_at and
        last_attempted_at, read back (the claim set them on the database clock)."""
        return cls(
            job.pk,
            database,
            **{name: getattr(job, name) for name in _ROW_FIELDS[2:-2]},
            started_at=times[0],
            last_attempted_at=times[1],
            was_state=job.was_state,
            was_claimed_by=job.was_claimed_by,
            was_fence=job.was_fence,
            was_lease=job.was_lease,
        )


# The columns of a claimed row that ClaimedJob holds, in its order (after pk, database).
_ROW_FIELDS = (
    "id",
    "",
    "task_path",
    "queue_name",
    "priority",
    "run_after",
    "args",
    "kwargs",
    "cursor",
    "retry",
    "state",
    "fence",
    "attempts",
    "max_attempts",
    "claim_token",
    "lease_seconds",
    "claimed_by",
    "enqueued_at",
    "started_at",
    "last_attempted_at",
)
# What a claim statement returns for plain rows: those columns (and available_at, which it
# orders by), not all of them: less for the server to send and the worker to parse per job.
_ROW_RETURNING = ", ".join(
    f"j.{name}" for name in (*_ROW_FIELDS[:1], *_ROW_FIELDS[2:], "available_at")
)
_JSON_FIELDS = ("args", "kwargs", "cursor", "retry")
_WAS_FIELDS = ("was_state", "was_claimed_by", "was_fence", "was_lease")


# What a claim answers: Job instances (claim()) or ClaimedJob rows (claim_rows()).
_Claimed = TypeVar("_Claimed")


def _as_jobs(jobs: list[Any], db: str) -> list[Any]:
    return jobs


def _as_rows(jobs: list[Any], db: str) -> list[ClaimedJob]:
    # Nothing may fail once the claim has committed (the rows would stay claimed, an
    # attempt spent, unrun until expiry): the times were read in the claim's transaction.
    return [ClaimedJob.of(j, db, (j.started_at, j.last_attempted_at)) for j in jobs]


def _pg_claim_rows(model: Any, db: str, sql: str, params: dict[str, Any]) -> list[ClaimedJob]:
    """_pg_claim's statement, read as plain rows."""
    return _claimed_rows(db, *pg_answer(db, sql, params))


def _claimed_rows(db: str, columns: list[str], rows: list[Any]) -> list[ClaimedJob]:
    """The claimed rows of a claim statement's answer; a row without an id (the ack and
    claim statement's answer when it claimed nothing) is none."""
    at = {name: columns.index(name) for name in (*_ROW_FIELDS[:1], *_ROW_FIELDS[2:], *_WAS_FIELDS)}
    claimed = []
    for row in rows:
        if row[at["id"]] is None:
            continue
        values = {name: row[i] for name, i in at.items()}
        for name in _JSON_FIELDS:
            # Django loads jsonb as text and lets JSONField decode it.
            if isinstance(values[name], str):
                values[name] = json.loads(values[name])
        claimed.append(ClaimedJob(pk=values.pop("id"), database=db, **values))
    return claimed


# The parts both claim statements share: the due pending jobs in claim order (an ordered
# scan of leases_job_due_idx), and what a claim sets on the database clock.
_DUE_ORDERED = """        WHERE state = '{pending}' AND available_at <= statement_timestamp(){queue_filter}
          AND (deadline IS NULL OR deadline >= statement_timestamp())
        ORDER BY priority DESC, available_at, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
"""
_CLAIMED_SET = """            state = '{claimed}',
            claim_token = gen_random_uuid(),
            fence = j.fence + 1,
            attempts = j.attempts + 1,
            claimed_by = %(worker)s,
            lease_expires_at = statement_timestamp()
                + make_interval(secs => COALESCE(%(lease)s::float8, j.lease_seconds)),
            heartbeat_at = statement_timestamp(),
            last_attempted_at = statement_timestamp(),
            started_at = COALESCE(j.started_at, statement_timestamp())
"""


# The woken claim (due pending jobs only), as CTEs: ``claimed`` holds the rows it took.
_DUE_CLAIM_CTES = (
    """due AS MATERIALIZED (
        SELECT id, claimed_by AS was_claimed_by, fence AS was_fence,
               round(extract(epoch FROM lease_expires_at - heartbeat_at), 1)::float8
                   AS was_lease
        FROM {job}
"""
    + _DUE_ORDERED
    + """    ), claimed AS (
        UPDATE {job} AS j SET
"""
    + _CLAIMED_SET
    + """        FROM due WHERE j.id = due.id
        RETURNING {returning}, due.was_claimed_by, due.was_fence, due.was_lease
    )"""
)


class ClaimVerbs(_VerbsBase):
    """claim() and claim_rows() of JobQuerySet (a mixin, as OperatorVerbs)."""

    if TYPE_CHECKING:
        _db: str | None

    # The claim on PostgreSQL: the same predicates as claim() and _take() below.
    _PG_CLAIM = (
        """
    WITH due AS (
        -- An ordered scan of leases_job_due_idx: the first rows in claim order, not a sort
        -- of every pending job.
        SELECT id, priority, available_at FROM {job}
"""
        + _DUE_ORDERED
        + """    ), expired AS (
        -- Claims whose lease ran out (leases_job_claimed_idx); usually none. Those that end
        -- instead of running again (past deadline, no attempts left, a task that must not run
        -- twice) are left to the portable path, which settles them.
        SELECT id, priority, available_at FROM {job}
        WHERE state = '{claimed}' AND lease_expires_at < statement_timestamp(){queue_filter}
          AND (deadline IS NULL OR deadline >= statement_timestamp())
          AND on_lease_lost = '{retry}' AND attempts < max_attempts
        ORDER BY lease_expires_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ), picked AS (
        SELECT c.id, j.state AS was_state, j.claimed_by AS was_claimed_by, j.fence AS was_fence,
               j.attempts AS was_attempts,
               -- The lease its last claim or renewal granted (both times from one statement).
               round(extract(epoch FROM j.lease_expires_at - j.heartbeat_at), 1)::float8
                   AS was_lease
        FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c JOIN {job} AS j ON j.id = c.id
        ORDER BY c.priority DESC, c.available_at, c.id
        LIMIT %(limit)s
    ), claimed AS (
        UPDATE {job} AS j SET
            leases_lost = j.leases_lost + CASE WHEN j.state = '{claimed}' THEN 1 ELSE 0 END,
"""
        + _CLAIMED_SET
        + """        FROM picked AS c
        WHERE j.id = c.id
        RETURNING {returning}, c.was_state, c.was_claimed_by, c.was_fence, c.was_attempts, c.was_lease
    ), lost AS (
        -- A takeover records the expired claim as a spent attempt, in the same statement.
        INSERT INTO {failure} (job_id, attempt, fence, worker_id, kind, exception_class_path,
                               message, traceback, recorded_at)
        SELECT id, was_attempts, was_fence, was_claimed_by, '{lease_expired}', '',
               -- As _expiry_message() words it.
               CASE WHEN was_lease >= {min_lease}
                    THEN format('lease of %%s s ran out before %%s acknowledged',
                                trim_scale(was_lease::numeric),
                                COALESCE(NULLIF(was_claimed_by, ''), 'its worker'))
                    ELSE format('lease was ended early, before %%s acknowledged',
                                COALESCE(NULLIF(was_claimed_by, ''), 'its worker')) END,
               '', statement_timestamp()
        FROM claimed WHERE was_state = '{claimed}'
    )
    SELECT * FROM claimed ORDER BY priority DESC, available_at, id
    """
    )

    # The claim of a worker woken by NOTIFY (settle=False) on PostgreSQL: due pending jobs
    # only. The full statement above takes about 1 ms to plan on every call (Django prepares
    # nothing); this one a fraction of it, and a woken worker waits on it. Expired claims and
    # jobs that must end wait for the next settling claim: a worker runs one on each poll,
    # at least every two poll intervals while busy, and before a --burst worker leaves.
    _PG_CLAIM_DUE = (
        """
    WITH """
        + _DUE_CLAIM_CTES
        + """
    SELECT *, '{pending}'::varchar AS was_state
    FROM claimed ORDER BY priority DESC, available_at, id
    """
    )

    @retry_deadlock_victims
    def claim(
        self,
        worker_id: str,
        queues: Iterable[str] | None = ("default",),
        limit: int = 1,
        lease: float | None = None,
        *,
        settle: bool = True,
    ) -> list[Job]:
        """Claim up to ``limit`` due or expired jobs of ``queues`` (None: of every queue),
        by priority then due time.

        Each claimed job gets a fresh claim token, fence + 1, attempts + 1 and a lease ending
        at Now() + lease (its own lease_seconds unless ``lease`` is given). Candidates that
        must not run again end here instead: past their deadline, or an expired claim with no
        attempts left or whose task says a lost lease means dead-letter or park. Where the
        database has SKIP LOCKED, rows another worker is claiming are passed over; elsewhere
        (SQLite) the UPDATE re-checks the claim predicate, so two workers never both win a row.

        On PostgreSQL one statement claims; the candidates that end instead of running are
        settled by a second, portable pass when the first claimed fewer than ``limit``.
        ``settle=False`` skips that pass and, on PostgreSQL, takes due pending jobs only, with
        a statement much cheaper to plan: expired claims are taken over by the next settling
        claim (a worker woken by NOTIFY settles on its next poll).

        Each job carries the row as it was before the claim: ``was_state`` ("claimed" for a
        takeover of an expired claim), ``was_claimed_by``, ``was_fence`` and ``was_lease``
        (the seconds its last claim or renewal granted, from the row's own database times).
        """
        return self._claim_with(_pg_claim, "j.*", _as_jobs, worker_id, queues, limit, lease, settle)

    @retry_deadlock_victims
    def claim_rows(
        self,
        worker_id: str,
        queues: Iterable[str] | None = ("default",),
        limit: int = 1,
        lease: float | None = None,
        *,
        settle: bool = True,
    ) -> list[ClaimedJob]:
        """claim(), answered as ClaimedJob rows rather than model instances (the worker's
        verb: on PostgreSQL no model instance is built per job)."""
        return self._claim_with(
            _pg_claim_rows, _ROW_RETURNING, _as_rows, worker_id, queues, limit, lease, settle
        )

    def _claim_with(
        self,
        pg_claim: Callable[[Any, str, str, dict[str, Any]], list[_Claimed]],
        returning: str,
        portable_as: Callable[[list[Job], str], list[_Claimed]],
        worker_id: str,
        queues: Iterable[str] | None,
        limit: int,
        lease: float | None,
        settle: bool,
    ) -> list[_Claimed]:
        """claim() and claim_rows(): on PostgreSQL one statement (the due jobs alone when
        not settling) answering the columns ``returning``, then the portable settling pass
        for what is left of ``limit``."""
        if limit < 1:
            return []
        lease = checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        queues = None if queues is None else list(queues)
        claimed: list[_Claimed] = []
        if on_postgresql(db):
            template = self._PG_CLAIM if settle else self._PG_CLAIM_DUE
            sql = pg_sql(template, self.model, db, all_queues=queues is None, returning=returning)
            params = {"worker": worker_id, "queues": queues, "limit": limit, "lease": lease}
            claimed = pg_claim(self.model, db, sql, params)
            if len(claimed) == limit or not settle:
                return claimed
            limit -= len(claimed)
        return claimed + portable_as(self._claim_portable(db, worker_id, queues, limit, lease), db)

    def _claim_portable(
        self, db: str, worker_id: str, queues: list[str] | None, limit: int, lease: float | None
    ) -> list[Job]:
        features = connections[db].features
        candidates_qs = (
            self.model._default_manager.using(db)
            .claim_order(queues)
            .annotate(
                past_deadline=Case(
                    When(deadline__lt=Now(), then=Value(True)),
                    default=Value(False),
                    output_field=models.BooleanField(),
                )
            )
        )
        if features.has_select_for_update_skip_locked:
            with transaction.atomic(using=db):
                candidates = list(candidates_qs.select_for_update(skip_locked=True)[:limit])
                return self._take(db, candidates, worker_id, lease)
        candidates = list(candidates_qs[:limit])
        # The UPDATE re-checks each row as read; the claim, its failure records and the
        # read-back commit together or not at all.
        with transaction.atomic(using=db):
            return self._take(db, candidates, worker_id, lease)

    def _take(
        self, db: str, candidates: list[Job], worker_id: str, lease: float | None
    ) -> list[Job]:
        if not candidates:
            return []
        manager = self.model._default_manager.using(db)
        ends = {j.pk: how for j in candidates if (how := ending(j)) is not None}
        if ends:
            self._settle(db, [j for j in candidates if j.pk in ends], ends, worker_id)
        wanted = [j for j in candidates if j.pk not in ends]
        if not wanted:
            return []
        tokens = {j.pk: uuid.uuid4() for j in wanted}
        # Each row must still be as it was read (fence and state): without SKIP LOCKED the
        # read took no lock, and a row taken over and expired again meanwhile would be won
        # with the previous owner's fence and attempt, so two owners would share a fence.
        as_read = Q()
        for j in wanted:
            as_read |= Q(pk=j.pk, fence=j.fence, state=j.state)
        (
            manager.filter(as_read)
            .claimable()
            .update(
                # MySQL assigns left to right and later expressions see earlier assignments:
                # read the old state before it is overwritten.
                leases_lost=_count_if_expired(),
                state=JobState.CLAIMED,
                claim_token=_token_case(tokens),
                fence=F("fence") + 1,
                attempts=F("attempts") + 1,
                claimed_by=worker_id,
                lease_expires_at=lease_end_by_job(wanted, lease),
                heartbeat_at=Now(),
                last_attempted_at=Now(),
                started_at=Case(
                    When(started_at__isnull=True, then=Now()),
                    default=F("started_at"),
                    output_field=models.DateTimeField(),
                ),
            )
        )
        # The rows that carry our tokens (fewer than wanted only after a lost race, possible
        # without SKIP LOCKED), with the times the claim set on the database clock.
        won = {
            pk: (started, attempted)
            for pk, started, attempted in manager.filter(
                claim_token__in=tokens.values()
            ).values_list("pk", "started_at", "last_attempted_at")
        }
        if len(won) != len(wanted):
            wanted = [j for j in wanted if j.pk in won]
        taken_over = [j for j in wanted if j.state == JobState.CLAIMED]
        if taken_over:
            self._record_expired(db, taken_over)
        for job in wanted:
            job.was_state, job.was_claimed_by, job.was_fence = job.state, job.claimed_by, job.fence
            job.was_lease = _granted_lease(job) if job.state == JobState.CLAIMED else None
            job.state = JobState.CLAIMED
            job.claim_token = tokens[job.pk]
            job.fence += 1
            job.attempts += 1
            job.claimed_by = worker_id
            for name in _DB_CLOCK_FIELDS:
                job.__dict__.pop(name, None)
            job.started_at, job.last_attempted_at = won[job.pk]
        return wanted

    def _record_expired(self, db: str, jobs: list[Job]) -> None:
        JobFailure = apps.get_model("django_leases", "JobFailure")
        JobFailure.objects.using(db).bulk_create(
            [
                JobFailure(
                    job_id=j.pk,
                    attempt=j.attempts,
                    fence=j.fence,
                    worker_id=j.claimed_by,
                    kind=FailureKind.LEASE_EXPIRED,
                    message=_expiry_message(_granted_lease(j), j.claimed_by),
                )
                for j in jobs
            ]
        )

    def _settle(self, db: str, jobs: list[Job], ends: dict[Any, str], worker_id: str) -> None:
        """End candidates that must not run again: dead-letter them, or park them; each is
        logged once the claim's transaction commits (endings.py)."""
        manager = self.model._default_manager.using(db)
        with transaction.atomic(using=db):
            lost, ended = [], []
            for job in jobs:
                how = ends[job.pk]
                if how == PARK:
                    changes: dict[str, Any] = {"state": JobState.PENDING, "available_at": None}
                else:
                    changes = {"state": JobState.DEAD, "dead_reason": how, "finished_at": Now()}
                # One conditional UPDATE per job: state and token pin the row as it was found.
                if (
                    manager.claimable()
                    .filter(pk=job.pk, state=job.state, claim_token=job.claim_token)
                    .update(
                        leases_lost=_count_if_expired(),
                        claim_token=None,
                        lease_expires_at=None,
                        **changes,
                    )
                    == 1
                ):
                    ended.append((job, how))
                    if job.state == JobState.CLAIMED:
                        lost.append(job)
            self._record_expired(db, lost)
            if ended:
                # robust: a logging filter that raises must not make a committed claim
                # raise, its claimed rows never returned.
                transaction.on_commit(lambda: log_ended(worker_id, ended), using=db, robust=True)
