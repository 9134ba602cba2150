"""Enqueue's insert paths: the jobs of one call, their ``JobFields`` checked by
enqueue_options.py, written through the ORM or, on PostgreSQL, one constant statement; a
held unique key refused or merged, and a missing migration named.

Every time written comes from the database clock or is the caller's own absolute time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.db import (
    IntegrityError,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)

from .enqueue_options import EnqueueOptions as EnqueueOptions  # its import path before
from .enqueue_options import JobFields, checked_calls
from .jsonsafe import statement_runs
from .lease_statements import json_param, on_postgresql
from .states import JobState
from .storable import first_line

if TYPE_CHECKING:
    from .models import Job


# What each database says when a table or column a migration adds is missing: PostgreSQL's
# SQLSTATEs, MySQL's error numbers, SQLite's words.
_PG_UNDEFINED = {"42P01", "42703"}
_MYSQL_UNDEFINED = {1146, 1054}
_SQLITE_UNDEFINED = ("no such table", "no such column", "has no column named")


@contextmanager
def migrated(
    model: type[Job], db: str, error: Callable[[str], Exception] | None = None
) -> Iterator[None]:
    """Turn the database's "no such table/column" into the same error (or ``error``, a
    command's CommandError) saying what to run."""
    try:
        yield
    except (ProgrammingError, OperationalError) as e:
        cause = e.__cause__
        undefined = (
            getattr(cause, "sqlstate", None) in _PG_UNDEFINED
            or (connections[db].vendor == "mysql" and e.args and e.args[0] in _MYSQL_UNDEFINED)
            or any(words in str(e) for words in _SQLITE_UNDEFINED)
        )
        if not undefined:
            raise
        raise (error or type(e))(
            f"The tables of django_leases ({model._meta.db_table!r} and the others) are "
            f"missing or out of date on database "
            f"{db!r} ({first_line(e)}): run `python manage.py migrate django_leases "
            f"--database {db}`."
        ) from e


def insert_job(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> Job:
    """Insert one job of checked ``fields`` and JSON-safe arguments (see JobQuerySet.enqueue);
    a held unique key is refused (DuplicateJob) or merged per ``fields.on_duplicate``."""
    return insert_or_merge_job(model, db, fields, args, kwargs)[0]


def insert_or_merge_job(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> tuple[Job, bool]:
    """insert_job(), answering (the job, whether it is the job that held the unique key,
    merged into: as it is, running or not, and no new job)."""
    with migrated(model, db):
        return _insert_job(model, db, fields, args, kwargs)


def _insert_job(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> tuple[Job, bool]:
    insert = _pg_insert_one if on_postgresql(db) else _insert_one
    if fields.unique_key is None:
        # Without a unique key there is no conflict: the insert always answers a job.
        return cast("Job", insert(model, db, fields, args, kwargs)), False
    from .exceptions import DuplicateJob

    for _ in range(3):
        job = insert(model, db, fields, args, kwargs)
        if job is not None:
            return job, False
        # The key is held; unless its holder finished in the meantime, that is the answer.
        # By the unique active_key: one index entry, so the locking read below locks the
        # holder's row alone (by unique_key and state it would lock every row it scans).
        holding = model._default_manager.using(db).filter(active_key=fields.unique_key)
        holder = holding.first()
        if holder is None and connections[db].vendor == "mysql":
            # Under REPEATABLE READ (check W006) a plain read inside the caller's
            # transaction sees the jobs of when it began, not the holder committed since:
            # a locking read sees the latest.
            with transaction.atomic(using=db):
                holder = holding.select_for_update().first()
        if holder is not None:
            if fields.on_duplicate == "merge":
                return holder, True
            raise DuplicateJob(fields.unique_key, holder.pk)
    raise IntegrityError(f"unique_key {fields.unique_key!r} kept conflicting; try again")


def insert_jobs(
    model: type[Job],
    db: str,
    fields: JobFields,
    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
    batch_size: int | None,
) -> list[Job]:
    """Insert one job per call, all or none, ``batch_size`` rows per INSERT (see
    JobQuerySet.enqueue_many); every call is checked before the first INSERT."""
    bounds: list[int] = []
    checked = checked_calls(calls, batch_size, bounds=bounds)
    with migrated(model, db):
        if not on_postgresql(db):
            return _insert_many(model, db, fields, checked, bounds, batch_size)
        return _saved_jobs(
            model, db, fields, checked, _pg_insert_many(model, db, fields, checked, batch_size)
        )


def insert_job_rows(
    model: type[Job],
    db: str,
    fields: JobFields,
    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
    batch_size: int | None,
    fits: Callable[[list[Any], dict[str, Any], str], None] | None = None,
) -> list[tuple[Any, datetime, list[Any], dict[str, Any]]]:
    """insert_jobs(), answering (id, enqueued_at, args, kwargs) for each job: what a
    TaskResult needs, its arguments taken as Django's TaskResult normalizes them (the
    Tasks API's enqueue_many()). On PostgreSQL no model instance is built, which is most
    of the time a bulk enqueue of thousands of jobs would otherwise take. ``fits`` as for
    checked_calls."""
    bounds: list[int] = []
    checked = checked_calls(calls, batch_size, fits, bounds, as_django_stores=True)
    with migrated(model, db):
        if not on_postgresql(db):
            return [
                (j.pk, j.enqueued_at, j.args, j.kwargs)
                for j in _insert_many(model, db, fields, checked, bounds, batch_size)
            ]
        rows = _pg_insert_many(model, db, fields, checked, batch_size)
    return [
        (row[0], row[1], args, kwargs) for (args, kwargs), row in zip(checked, rows, strict=True)
    ]


def _insert_many(
    model: type[Job],
    db: str,
    fields: JobFields,
    calls: list[tuple[list[Any], dict[str, Any]]],
    bounds: list[int],
    batch_size: int | None,
) -> list[Job]:
    """The ORM path (SQLite, MariaDB, MySQL): bulk_create, itself all or nothing, in
    INSERTs of at most SENT_LIMIT as sent (``bounds``: each call's upper bound, plus
    ROW_SIZE for the rest of its row): MariaDB drops the connection for a statement past
    its max_allowed_packet, and one call may already take 8 MiB."""
    manager = model._default_manager.using(db)
    jobs = [fields.new_job(model, args, kwargs) for args, kwargs in calls]
    if connections[db].features.can_return_rows_from_bulk_insert:
        with transaction.atomic(using=db):
            return [
                job
                for sized in statement_runs(jobs, [bound + ROW_SIZE for bound in bounds])
                for job in manager.bulk_create(sized, batch_size=batch_size)
            ]
    # MySQL has no RETURNING: bulk_create would leave every id unset. One INSERT per job
    # (its id comes back as the last insert id), in one transaction, then one read of the
    # times the database gave them.
    with transaction.atomic(using=db):
        for job in jobs:
            job.save(using=db, force_insert=True)
    times = {
        pk: row
        for pk, *row in manager.filter(pk__in=[j.pk for j in jobs]).values_list(
            "pk", *_INSERT_CLOCK_FIELDS
        )
    }
    for job in jobs:
        for name, value in zip(_INSERT_CLOCK_FIELDS, times[job.pk], strict=True):
            setattr(job, name, value)
    return jobs


# More than a row takes besides its arguments, in bytes as sent: the task path (255
# characters), the queue (100) and the unique key (200), each character at most 4 bytes of
# UTF-8 (a quote counted twice is 2), the retry ladder (at most retry.MAX_STEPS delays of
# at most 24 characters, a float's repr, and a separator) and the other columns.
ROW_SIZE = 4096


# What an INSERT leaves to the database clock (db_default Now(), Now() + an interval).
_INSERT_CLOCK_FIELDS = ("enqueued_at", "available_at", "deadline")


def _insert_one(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> Job | None:
    """The ORM path (SQLite, MariaDB): save(); None when the unique key is held."""
    job = fields.new_job(model, args, kwargs)
    if fields.unique_key is None:
        job.save(using=db, force_insert=True)
        return job
    try:
        # A savepoint, so a refused insert leaves the caller's transaction usable.
        with transaction.atomic(using=db):
            job.save(using=db, force_insert=True)
    except IntegrityError:
        return None
    return job


# Fields whose new values the claim sets on the database clock; dropped from the returned


# -- PostgreSQL: enqueue in one constant statement ------------------------------------------
# The ORM's INSERT is compiled anew for every row (and for every batch of a bulk_create, a
# statement with one placeholder per row and column); this one is a constant string whatever
# the row count: the options every job of a call shares are scalars, the args and kwargs of
# many jobs are one JSON document. The due time and the deadline are the caller's absolute
# time or the database clock plus an interval, as Now() + interval is on the ORM path. The
# statement trigger of migration 0002 sends the NOTIFY, as for any INSERT.

_PG_ENQUEUE = """
INSERT INTO {job} (task_path, queue_name, priority, lease_seconds, max_attempts, retry,
                   on_lease_lost, unique_key, run_after, available_at, deadline,
                   state, fence, attempts, leases_lost, claimed_by, dead_reason, args, kwargs)
{rows}
{on_conflict}RETURNING id, enqueued_at, available_at, deadline, active_key
"""
# What every job of one call gets: the call's options, the due time and deadline from the
# caller's own time or the database clock plus an interval, the model's defaults.
_PG_SHARED = f"""%(task_path)s::varchar, %(queue_name)s::varchar, %(priority)s::smallint,
    %(lease_seconds)s::float8, %(max_attempts)s::integer, %(retry)s::jsonb,
    %(on_lease_lost)s::varchar, %(unique_key)s::varchar, %(run_after)s::timestamptz,
    COALESCE(%(run_after)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    COALESCE(%(deadline)s::timestamptz,
             GREATEST(%(run_after)s::timestamptz, statement_timestamp()) + %(max_age)s::interval),
    '{JobState.PENDING.value}', 0, 0, 0, '', ''"""
# One job: plain VALUES, which the server plans in half the time of a SELECT.
_PG_ONE_ROW = f"VALUES ({_PG_SHARED}, %(args)s::jsonb, %(kwargs)s::jsonb)"
# Many: one JSON array of [args, kwargs] pairs, whose elements come out in array order. One
# json.dumps() of the batch and one document for the server to parse, rather than two
# json.dumps() per job and two text arrays of JSON for the driver to quote element by
# element: 10,000 no-op jobs, 14 against 20 us per job; with three arguments, 20 against 38.
_PG_ROWS = f"""SELECT {_PG_SHARED}, c.value -> 0, c.value -> 1
FROM jsonb_array_elements(%(calls)s::jsonb) AS c"""
# ... answered in one row: the ids, drawn from the sequence in the order of insertion, and
# the times, which are the same for every row of one statement (statement_timestamp() and
# the call's own options), so that the client parses one row, not three times per job.
_PG_MANY = """WITH inserted AS ({insert})
SELECT array_agg(id ORDER BY id), min(enqueued_at), min(available_at), min(deadline) FROM inserted"""
# A held unique key inserts nothing and returns no row: no error, so no savepoint either.
_PG_KEY_HELD = "ON CONFLICT (active_key) DO NOTHING\n"
# The columns of Job the INSERT returns, in the order of its RETURNING.
_RETURNED = ("id", "enqueued_at", "available_at", "deadline", "active_key")

_pg_enqueue_cache: dict[tuple[str, str, bool], str] = {}


def _pg_enqueue_sql(model: type[Job], db: str, rows: str, unique: bool) -> str:
    key = (model._meta.db_table, rows, unique)
    if key not in _pg_enqueue_cache:
        table = connections[db].ops.quote_name(model._meta.db_table)
        insert = _PG_ENQUEUE.format(
            job=table, rows=rows, on_conflict=_PG_KEY_HELD if unique else ""
        )
        _pg_enqueue_cache[key] = insert if rows == _PG_ONE_ROW else _PG_MANY.format(insert=insert)
    return _pg_enqueue_cache[key]


def _pg_insert_one(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> Job | None:
    """One INSERT ... RETURNING; None when an active job holds the unique key."""
    row = _pg_insert_row(model, db, fields, args, kwargs)
    return None if row is None else _saved_jobs(model, db, fields, [(args, kwargs)], [row])[0]


def insert_job_row(
    model: type[Job], db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]
) -> tuple[Any, datetime, list[Any], dict[str, Any]]:
    """insert_job(), answering (id, enqueued_at, args, kwargs): what a TaskResult needs. On
    PostgreSQL without a unique key (which may answer another job) no Job is built."""
    if fields.unique_key is None and on_postgresql(db):
        with migrated(model, db):
            row = _pg_insert_row(model, db, fields, args, kwargs, _RETURNED[:2])
        assert row is not None  # without a unique key an INSERT always answers its row
        return row[0], row[1], args, kwargs
    job = insert_job(model, db, fields, args, kwargs)
    return job.pk, job.enqueued_at, job.args, job.kwargs


def _pg_insert_row(
    model: type[Job],
    db: str,
    fields: JobFields,
    args: list[Any],
    kwargs: dict[str, Any],
    returning: tuple[str, ...] = _RETURNED,
) -> tuple[Any, ...] | None:
    """The RETURNING row of one job's INSERT, starting with the columns ``returning`` names
    (a prefix of _RETURNED); None when an active job holds the unique key."""
    connection = connections[db]
    sql = _pg_bound_sql(model, db, fields, returning)
    with connection.cursor() as cursor:
        if sql is None:
            params = fields.pg_params()
            params["args"], params["kwargs"] = json_param(args), json_param(kwargs)
            cursor.execute(
                _pg_enqueue_sql(model, db, _PG_ONE_ROW, fields.unique_key is not None), params
            )
        else:
            cursor.execute(sql, [json_param(args), json_param(kwargs)])
        return cast("tuple[Any, ...] | None", cursor.fetchone())


# One job's INSERT with the options every job of a task shares already bound (the driver's
# own quoting, as its client-side binding does on every call): binding fifteen parameters
# took most of an enqueue's time in Python; now each enqueue binds its args and kwargs.
# Only for a task's constant options: a call's own absolute time or unique key would make
# every statement new. Kept per database, table, JobFields and RETURNING list, at most 256.
_pg_bound_cache: dict[tuple[str, str, JobFields, tuple[str, ...]], str] = {}
# The statement is as short as the server can parse and plan, since with Django's default
# client-side binding it arrives as text and is parsed and planned at every call: run_after
# and unique_key are left to their NULL, no COALESCE, no casts but the intervals' and the
# arguments'. Against _PG_ONE_ROW, returning two columns rather than five, 484 against
# 502 us per statement here (interleaved), the commit included.
_PG_BOUND_ONE = f"""
INSERT INTO {{job}} (task_path, queue_name, priority, lease_seconds, max_attempts, retry,
                   on_lease_lost, available_at, deadline,
                   state, fence, attempts, leases_lost, claimed_by, dead_reason, args, kwargs)
VALUES (%(task_path)s, %(queue_name)s, %(priority)s, %(lease_seconds)s, %(max_attempts)s,
    %(retry)s, %(on_lease_lost)s, statement_timestamp() + %(delay)s::interval,
    statement_timestamp() + %(max_age)s::interval, '{JobState.PENDING.value}', 0, 0, 0, '', '',
    """
_PG_BOUND_ARGS = "%s::jsonb, %s::jsonb)\nRETURNING "


def _pg_bound_sql(
    model: type[Job], db: str, fields: JobFields, returning: tuple[str, ...]
) -> str | None:
    """The one-row INSERT of ``fields`` taking only args and kwargs (``%s``, ``%s``) and
    returning the columns ``returning`` names, or None for fields that change from call to
    call (run_after, deadline, unique_key)."""
    if fields.run_after is not None or fields.deadline is not None or fields.unique_key is not None:
        return None
    key = (db, model._meta.db_table, fields, returning)
    try:
        return _pg_bound_cache[key]
    except KeyError:
        pass
    except TypeError:  # a field that cannot be hashed: bind it on every call instead
        return None
    connection = connections[db]
    head = _PG_BOUND_ONE.format(job=connection.ops.quote_name(model._meta.db_table))
    # What the options became is text now: a % in it (a queue named "50%") stays a %.
    # compose_sql is the PostgreSQL backend's (the driver's mogrify); the stubs know only
    # the base class.
    composed: str = connection.ops.compose_sql(head, fields.pg_params())  # type: ignore[attr-defined]
    bound = composed.replace("%", "%%")
    if len(_pg_bound_cache) >= 256:
        _pg_bound_cache.clear()
    _pg_bound_cache[key] = sql = bound + _PG_BOUND_ARGS + ", ".join(returning)
    return sql


def _pg_insert_many(
    model: type[Job],
    db: str,
    fields: JobFields,
    calls: list[tuple[list[Any], dict[str, Any]]],
    batch_size: int | None,
) -> list[tuple[Any, ...]]:
    """One INSERT ... SELECT FROM jsonb_array_elements(calls) per ``batch_size`` calls, in one
    transaction (as bulk_create): all the jobs or none. Answer the RETURNING columns of
    each job, in the order of the calls."""
    if not calls:
        return []
    sql = _pg_enqueue_sql(model, db, _PG_ROWS, False)
    params = fields.pg_params()
    rows: list[tuple[Any, ...]] = []
    with transaction.atomic(using=db, savepoint=False), connections[db].cursor() as cursor:
        for batch in _batches(calls, batch_size):
            for document in _calls_documents(batch):
                params["calls"] = document
                cursor.execute(sql, params)
                ids, enqueued_at, available_at, deadline = cursor.fetchone()
                rows.extend((pk, enqueued_at, available_at, deadline, None) for pk in ids)
    return rows


# PostgreSQL refuses a jsonb value whose elements take more than 256 MB (268,435,455 bytes)
# in its stored form, which can be 6 times the JSON text: a 4-byte entry per element and a
# number in 8 bytes, so "0," (2 characters) takes 12. A batch whose JSON passes this many
# characters (ASCII: as many bytes), a sixth of that and then some, goes in halves, down
# to one call, whose args and kwargs together must then fit under PostgreSQL's limit.
CALLS_DOCUMENT_LIMIT = 32 * 2**20


def _calls_documents(batch: list[tuple[list[Any], dict[str, Any]]]) -> Iterator[str]:
    """``batch`` as JSON arrays of [args, kwargs] pairs, in order, each of at most
    CALLS_DOCUMENT_LIMIT characters unless it holds a single call."""
    document = json.dumps(batch)
    if len(document) <= CALLS_DOCUMENT_LIMIT or len(batch) == 1:
        yield document
        return
    half = len(batch) // 2
    yield from _calls_documents(batch[:half])
    yield from _calls_documents(batch[half:])


def _batches(
    calls: list[tuple[list[Any], dict[str, Any]]], batch_size: int | None
) -> Iterable[list[tuple[list[Any], dict[str, Any]]]]:
    """``calls`` in slices of ``batch_size`` (None: one slice), as bulk_create takes it."""
    size = batch_size or len(calls)
    return (calls[start : start + size] for start in range(0, len(calls), size))


def _saved_jobs(
    model: type[Job],
    db: str,
    fields: JobFields,
    calls: list[tuple[list[Any], dict[str, Any]]],
    rows: list[tuple[Any, ...]],
) -> list[Job]:
    """The jobs as saved, without a second query: what the call wrote, the model's defaults
    for the columns it left alone, and what the database computed (RETURNING)."""
    layout = _job_layout(model)
    template = [*layout.defaults]
    for name, value in fields.columns().items():
        template[layout.slot[name]] = value
    jobs = []
    for (args, kwargs), row in zip(calls, rows, strict=True):
        values = template.copy()
        for slot, value in zip(
            layout.per_row, (args, kwargs, fields.retry_json(), *row), strict=True
        ):
            values[slot] = value
        jobs.append(model.from_db(db, layout.names, values))
    return jobs


@dataclass(frozen=True)
class _Layout:
    """A model's concrete columns in order, their defaults, the position of each, and where
    each job's own values go (args, kwargs, its fresh retry JSON, the RETURNING columns)."""

    names: list[str]
    defaults: list[Any]  # callable defaults (args, kwargs) are always replaced
    slot: dict[str, int]
    per_row: tuple[int, ...]


_layouts: dict[Any, _Layout] = {}


def _job_layout(model: type[Job]) -> _Layout:
    if model not in _layouts:
        fields = model._meta.concrete_fields
        slot = {f.attname: i for i, f in enumerate(fields)}
        _layouts[model] = _Layout(
            [f.attname for f in fields],
            [f.get_default() for f in fields],
            slot,
            tuple(slot[n] for n in ("args", "kwargs", "retry", *_RETURNED)),
        )
    return _layouts[model]
