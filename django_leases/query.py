"""The lease views and every statement that decides who owns a job.

A write out of ``claimed`` is an UPDATE filtered on id, claim token and state; its rowcount
is the answer (1: still the owner, 0: the claim is lost). Every timestamp written comes from
the database clock (``Now()``); no datetime computed in Python is ever compared with a lease.

On PostgreSQL the claim, the renewal and a batch of acks are single UPDATE ... RETURNING
statements, kept beside the portable ORM verb whose predicates they must agree with, so a
worker pays one round trip where the portable path pays four (BEGIN, SELECT ... FOR UPDATE,
UPDATE, COMMIT). statement_timestamp() is what Django's Now() compiles to on PostgreSQL: the
same database clock. Operator verbs and the admin's reads are in operators.py.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from . import conf
from .deadlocks import retry_deadlock_victims
from .enqueue import (
    EnqueueOptions,
    after_now,
    check_queue,
    checked_arguments,
    insert_job,
    insert_jobs,
    json_param,
    on_postgresql,
)
from .jsonsafe import ensure_json
from .operators import OperatorVerbs
from .pruning import PruneVerbs
from .states import DeadReason, FailureKind, JobState, LeaseLostPolicy

if TYPE_CHECKING:
    from .models import Job


class ClaimRef(Protocol):
    """What proves a claim: the job's id and the token its claim was given."""

    pk: Any
    claim_token: uuid.UUID | None


def _checked_lease(lease: float | None) -> float | None:
    """A caller's lease override, refused (InvalidLeaseOption naming ``lease``) when zero,
    negative, NaN or past 12 h: a claim given such a lease would be open to takeover at once."""
    return None if lease is None else conf.validate_lease(lease, "lease")


def _lease_end(lease: float) -> Any:
    return after_now(timedelta(seconds=lease))


def _lease_end_by_job(claims: Iterable[Any], override: float | None) -> Any:
    """Now() + each claim's lease (its ``lease_seconds``), on the database clock.

    Claims are grouped by lease, so the CASE has one branch per distinct lease however many
    claims there are.
    """
    if override is not None:
        return _lease_end(override)
    by_lease: dict[float, list[Any]] = {}
    for c in claims:
        by_lease.setdefault(
            float(getattr(c, "lease_seconds", conf.DEFAULT_LEASE_SECONDS)), []
        ).append(c.pk)
    if len(by_lease) == 1:
        return _lease_end(next(iter(by_lease)))
    whens = [When(pk__in=pks, then=_lease_end(v)) for v, pks in sorted(by_lease.items())]
    return Case(*whens, default=_lease_end(max(by_lease)))


def _count_if_expired() -> Case:
    """leases_lost + 1 when the row is a claim (being taken over or ended), else unchanged."""
    return Case(
        When(state=JobState.CLAIMED, then=F("leases_lost") + 1),
        default=F("leases_lost"),
        output_field=models.PositiveIntegerField(),
    )


def _ending(job: Any) -> str | None:
    """How a claim candidate ends instead of being claimed: a dead reason, "park", or None."""
    if job.past_deadline:
        return DeadReason.DEADLINE
    if job.state != JobState.CLAIMED:
        return None
    if job.on_lease_lost == LeaseLostPolicy.DEAD:
        return DeadReason.LEASE_LOST
    if job.on_lease_lost == LeaseLostPolicy.PARK:
        return "park"
    if job.attempts >= job.max_attempts:
        return DeadReason.ATTEMPTS
    return None


def _granted_lease(job: Job) -> float | None:
    """The lease the claim's last claim or renewal granted: its end minus the heartbeat
    that set it, both written by one statement on the database clock. None if unknown."""
    if job.lease_expires_at is None or job.heartbeat_at is None:
        return None
    return round((job.lease_expires_at - job.heartbeat_at).total_seconds(), 1)


def _expiry_message(granted: float | None, owner: str) -> str:
    """The message of a lease_expired failure (the PostgreSQL claim writes the same)."""
    owner = owner or "its worker"
    if granted is None or granted < conf.MIN_LEASE_SECONDS:
        # No claim is granted less: the lease was ended early (expire_now, the admin).
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


# -- PostgreSQL: the statements of JobQuerySet._PG_* for a model and database ------------


@functools.lru_cache(maxsize=64)
def _pg_sql(
    template: str, model: Any, db: str, *, all_queues: bool = False, returning: str = "j.*"
) -> str:
    """``template`` for ``model``'s tables; the claim's queue filter left out for a claim
    of every queue (the due half is then the same ordered index scan, unfiltered), and the
    claimed rows' columns ``returning`` (every column for a model instance, _ROW_RETURNING
    for plain rows)."""
    quote = connections[db].ops.quote_name
    failure = apps.get_model("django_leases", "JobFailure")
    return template.format(
        returning=returning,
        job=quote(model._meta.db_table),
        failure=quote(failure._meta.db_table),
        queue_filter="" if all_queues else "\n      AND queue_name = ANY(%(queues)s)",
        min_lease=f"{conf.MIN_LEASE_SECONDS:g}",
        pending=JobState.PENDING.value,
        claimed=JobState.CLAIMED.value,
        succeeded=JobState.SUCCEEDED.value,
        retry=LeaseLostPolicy.RETRY.value,
        lease_expired=FailureKind.LEASE_EXPIRED.value,
    )


def _pg_ids(model: Any, db: str, template: str, params: dict[str, Any]) -> set[Any]:
    with connections[db].cursor() as cursor:
        cursor.execute(_pg_sql(template, model, db), params)
        return {row[0] for row in cursor.fetchall()}


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
    return _claimed_rows(db, *_pg_answer(db, sql, params))


def _pg_answer(db: str, sql: str, params: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """Run ``sql``; its column names and rows."""
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        return [c[0] for c in cursor.description], cursor.fetchall()


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


# The owner's ack of several jobs, each with its result: one UPDATE filtered on id, claim
# token and state (ack_many() alone, or riding with the woken claim in ack_and_claim_rows()).
_ACK_UPDATE = """UPDATE {job} AS j SET
        state = '{succeeded}', result = v.result, finished_at = statement_timestamp(),
        claim_token = NULL, lease_expires_at = NULL
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::jsonb[]) AS v(id, token, result)
    WHERE j.id = v.id AND j.claim_token = v.token AND j.state = '{claimed}'
    RETURNING j.id"""
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


class JobQuerySet(OperatorVerbs, PruneVerbs, models.QuerySet["Job"]):
    """Lease views and the owner's verbs of jobs (operator verbs: OperatorVerbs; prune:
    PruneVerbs)."""

    # -- lease views -------------------------------------------------------------------
    # "Stalled" is the design's full definition, the one the admin shows: renewals stopped
    # for more than two heartbeat periods, or the worker that holds the claim is stopped or
    # unseen for as long. Every comparison uses Now().

    def claimable(self) -> JobQuerySet:
        """Pending and due, or claimed with a lease that has run out."""
        return self.filter(
            Q(state=JobState.PENDING, available_at__lte=Now())
            | Q(state=JobState.CLAIMED, lease_expires_at__lt=Now())
        )

    def claim_order(self, queues: Iterable[str] | None) -> JobQuerySet:
        """Claimable jobs of ``queues`` (None: of every queue) in the order a claim takes
        them (partial indexes on PostgreSQL the claim itself runs an ordered scan of
        leases_job_due_idx)."""
        jobs = self if queues is None else self.filter(queue_name__in=list(queues))
        return jobs.claimable().order_by("-priority", "available_at", "id")

    def expired(self) -> JobQuerySet:
        """Claimed, and the lease has passed: any worker may claim it again."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__lt=Now())

    def lease_valid(self) -> JobQuerySet:
        """Claimed with a lease that has not run out (healthy or stalled)."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__gte=Now())

    def _stalled_q(self, heartbeat_seconds: float) -> Q:
        workers = apps.get_model("django_leases", "WorkerProcess")
        gone = workers.objects.using(self.db).gone(heartbeat_seconds).values("worker_id")
        return Q(state=JobState.CLAIMED, lease_expires_at__gte=Now()) & (
            Q(heartbeat_at__lt=Now() - Value(timedelta(seconds=2 * heartbeat_seconds)))
            | Q(claimed_by__in=gone)
        )

    def stalled_claims(self, heartbeat_seconds: float) -> JobQuerySet:
        """Claimed with a valid lease, but silent for two heartbeat periods or its worker gone."""
        return self.filter(self._stalled_q(heartbeat_seconds))

    def with_lease_status(self, heartbeat_seconds: float) -> JobQuerySet:
        """Annotate ``db_now`` and ``lease_status`` (healthy, stalled, expired or None).

        ``db_now`` is the database clock of the same statement, so ages and countdowns shown
        from it never depend on the web server's clock.
        """
        return self.annotate(
            db_now=Now(),
            lease_status=Case(
                When(state=JobState.CLAIMED, lease_expires_at__lt=Now(), then=Value("expired")),
                When(self._stalled_q(heartbeat_seconds), then=Value("stalled")),
                When(state=JobState.CLAIMED, then=Value("healthy")),
                default=Value(None),
                output_field=models.CharField(),
            ),
        )

    # -- enqueue: the manager's entry to enqueue.py -----------------------------------

    def enqueue(
        self,
        task_path: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Job:
        """Insert a pending job in the caller's transaction and return it.

        ``options`` are those of EnqueueOptions: queue_name, priority, run_after, delay,
        lease_seconds, max_attempts, retry, on_lease_lost, deadline, max_age, unique_key,
        on_duplicate. Raise InvalidJobArgument (naming the argument) or InvalidLeaseOption
        before anything is written. ``delay`` and ``max_age`` count from the database clock;
        ``run_after`` and ``deadline`` are the caller's own absolute times. With
        ``unique_key``, a second pending or claimed job with the same key is refused
        (DuplicateJob) or, with ``on_duplicate="merge"``, the existing job is returned instead.

        ``task_path`` is not looked up: the manager takes the path of a task this process
        need not declare (one only the workers' code has, a path kept in data), as Celery's
        ``send_task()`` does. A path no worker declares is written and ends dead as
        ``UnknownTask`` when claimed; the backend's ``enqueue()`` refuses such a task.
        """
        args, kwargs = checked_arguments(args, kwargs)
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_job(self.model, db, fields, args, kwargs)

    def enqueue_many(
        self,
        task_path: str,
        calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
        *,
        batch_size: int = 1000,
        **options: Any,
    ) -> list[Job]:
        """Insert one pending job per ``(args, kwargs)`` call in as few INSERTs as possible
        (``batch_size`` rows each), in the caller's transaction; the options are those of
        ``enqueue()`` except ``unique_key``, checked once for every call. Every call is
        checked before anything is written: an argument that does not round-trip through
        JSON raises InvalidJobArgument naming the call (``calls[3].args[0]``) and nothing is
        inserted.
        """
        from .exceptions import InvalidLeaseOption

        if "unique_key" in options:
            raise InvalidLeaseOption(
                "unique_key", "enqueue_many() takes no unique_key; use enqueue()"
            )
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_jobs(self.model, db, fields, calls, batch_size)

    # -- the claim and its owner's writes ----------------------------------------------

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
        lease = _checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        queues = None if queues is None else list(queues)
        claimed: list[_Claimed] = []
        if on_postgresql(db):
            template = self._PG_CLAIM if settle else self._PG_CLAIM_DUE
            sql = _pg_sql(template, self.model, db, all_queues=queues is None, returning=returning)
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
        endings = {j.pk: _ending(j) for j in candidates}
        ending = {pk: e for pk, e in endings.items() if e is not None}
        if ending:
            self._settle(db, [j for j in candidates if j.pk in ending], ending)
        wanted = [j for j in candidates if j.pk not in ending]
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
                lease_expires_at=_lease_end_by_job(wanted, lease),
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

    def _settle(self, db: str, jobs: list[Job], ending: dict[Any, str]) -> None:
        """End candidates that must not run again: dead-letter them, or park them."""
        manager = self.model._default_manager.using(db)
        with transaction.atomic(using=db):
            lost = []
            for job in jobs:
                reason = ending[job.pk]
                if reason == "park":
                    changes: dict[str, Any] = {"state": JobState.PENDING, "available_at": None}
                else:
                    changes = {"state": JobState.DEAD, "dead_reason": reason, "finished_at": Now()}
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
                    and job.state == JobState.CLAIMED
                ):
                    lost.append(job)
            self._record_expired(db, lost)

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

    @retry_deadlock_victims
    def renew(self, claims: Iterable[ClaimRef], lease: float | None = None) -> set[Any]:
        """Push the lease of every claim forward in one statement; return the ids still held.

        An id missing from the answer is a lost claim: its handler must stop and its result
        be discarded.
        """
        claims = list(claims)
        if not claims:
            return set()
        lease = _checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        if on_postgresql(db):
            return _pg_ids(
                self.model,
                db,
                self._PG_RENEW,
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
            lease_expires_at=_lease_end_by_job(claims, lease),
            heartbeat_at=Now(),
        )
        if renewed == len(claims):
            return set(ids)
        # Tokens are unique per claim and never return to 'claimed', so this read can only
        # shrink the answer (a job its owner just acknowledged), never grow it.
        return set(held.values_list("pk", flat=True))

    def acked_by_their_claims(self, jobs: Iterable[Any]) -> set[Any]:
        """The ids of ``jobs`` (claimed rows: ``pk``, ``fence``) that succeeded at their
        claim's fence: acknowledged by that claim, since any later claim moves the fence on.
        A renewal that misses such a job raced its handler's own ``fenced(ack=True)``
        commit: the claim ended in success, it was not lost."""
        fences = {job.pk: job.fence for job in jobs}
        ids = list(fences)
        acked = set()
        # In slices: SQLite caps a statement's parameters (999 before 3.32).
        for start in range(0, len(ids), 500):
            done = self.filter(pk__in=ids[start : start + 500], state=JobState.SUCCEEDED)
            acked |= {pk for pk, fence in done.values_list("pk", "fence") if fence == fences[pk]}
        return acked

    def _owned(self, claim: ClaimRef) -> JobQuerySet:
        db = self._db or router.db_for_write(self.model)
        return self.model._default_manager.using(db).filter(
            pk=claim.pk, claim_token=claim.claim_token, state=JobState.CLAIMED
        )

    @retry_deadlock_victims
    def ack(self, claim: ClaimRef, result: Any = None) -> bool:
        """Mark the job succeeded if ``claim`` still owns it. Raise InvalidJobArgument if
        ``result`` does not round-trip through JSON (nothing is written then)."""
        result = ensure_json(result, "result")
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

        The owned rows are locked by a SELECT ... FOR UPDATE before the one UPDATE, so the
        answer names exactly the rows this call moved (the UPDATE clears the tokens that
        would otherwise tell them apart).
        """
        results = {c.pk: ensure_json(r, "result") for c, r in outcomes}
        if not results:
            return set()
        db = self._db or router.db_for_write(self.model)
        if on_postgresql(db):
            return _pg_ids(self.model, db, self._PG_ACK, _ack_params(outcomes, results))
        owned = self.model._default_manager.using(db).filter(
            pk__in=list(results),
            claim_token__in=[c.claim_token for c, _ in outcomes],
            state=JobState.CLAIMED,
        )
        with transaction.atomic(using=db):
            ids = set(owned.select_for_update().values_list("pk", flat=True))
            if not ids:
                return set()
            result: Any = None
            if any(results[pk] is not None for pk in ids):
                result = Case(
                    *[
                        When(pk=pk, then=Value(results[pk], output_field=models.JSONField()))
                        for pk in ids
                    ],
                    output_field=models.JSONField(),
                )
            owned.filter(pk__in=ids).update(
                state=JobState.SUCCEEDED,
                result=result,
                finished_at=Now(),
                claim_token=None,
                lease_expires_at=None,
            )
        return ids

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
        results = {c.pk: ensure_json(r, "result") for c, r in outcomes}
        lease = _checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        queues = None if queues is None else list(queues)
        if limit < 1 or not results or not on_postgresql(db):
            with transaction.atomic(using=db):
                acked = self.ack_many(outcomes)
                return acked, self.claim_rows(worker_id, queues, limit, lease, settle=False)
        sql = _pg_sql(
            self._PG_ACK_CLAIM_DUE,
            self.model,
            db,
            all_queues=queues is None,
            returning=_ROW_RETURNING,
        )
        params = {"worker": worker_id, "queues": queues, "limit": limit, "lease": lease}
        params.update(_ack_params(outcomes, results))
        columns, rows = _pg_answer(db, sql, params)
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
        kind: str = FailureKind.EXCEPTION,
    ) -> bool:
        """Record a failed attempt if ``claim`` still owns the job.

        The job goes back to pending while it has attempts left, its deadline has not passed
        and ``retry`` is true, due after ``retry_in`` seconds on the database clock (by
        default the next step of the job's retry ladder); otherwise it is dead-lettered with
        the reason. The class path, message and traceback are stored as storable.py makes
        them (lone surrogates and NUL escaped, cut at its limits), whoever calls.
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
                    available_at=_lease_end(max(retry_in, 0.0)),
                    claim_token=None,
                    lease_expires_at=None,
                )
                != 1
            ):
                return False
            job = (
                self.model._default_manager.using(db)
                .only("attempts", "fence", "claimed_by")
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
        return True

    @retry_deadlock_victims
    def release(self, claim: ClaimRef) -> bool:
        """Give the job back to pending at once without counting the attempt."""
        return (
            self._owned(claim).update(
                state=JobState.PENDING,
                available_at=Now(),
                attempts=F("attempts") - 1,
                claim_token=None,
                lease_expires_at=None,
            )
            == 1
        )

    @retry_deadlock_victims
    def checkpoint(self, claim: ClaimRef, cursor: Any, lease: float | None = None) -> bool:
        """Commit ``cursor`` and renew the lease in one conditional UPDATE."""
        cursor = ensure_json(cursor, "cursor")
        lease = _checked_lease(lease)
        return (
            self._owned(claim).update(
                cursor=cursor,
                lease_expires_at=_lease_end_by_job([claim], lease),
                heartbeat_at=Now(),
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
