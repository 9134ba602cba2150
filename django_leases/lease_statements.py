"""What the claim and the owner's writes are built from: the lease a caller may ask for,
the lease's end on the database clock, and PostgreSQL's statement templates rendered for a
model's tables and run; with enqueue's, the vendor test, JSON parameters and a time on the
database clock.

Every timestamp written comes from the database clock (``Now()``, or
``statement_timestamp()``, what Now() compiles to on PostgreSQL); no datetime computed in
Python is ever compared with a lease.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol

from django.apps import apps
from django.db import connections
from django.db.models import Case, Value, When
from django.db.models.functions import Now

from . import conf
from .states import FailureKind, JobState, LeaseLostPolicy


def on_postgresql(db: str) -> bool:
    """Whether ``db`` takes the single-statement PostgreSQL paths."""
    return connections[db].vendor == "postgresql"


def json_param(value: Any) -> str | None:
    """``value`` as the JSON text a ``::jsonb`` parameter takes (None stays NULL)."""
    return None if value is None else json.dumps(value)


def after_now(interval: timedelta) -> Any:
    """Now() + ``interval``: a time on the database clock."""
    return Now() + Value(interval)


class ClaimRef(Protocol):
    """What proves a claim: the job's id and the token its claim was given."""

    pk: Any
    claim_token: uuid.UUID | None


def checked_lease(lease: float | None) -> float | None:
    """A caller's lease override, refused (InvalidLeaseOption naming ``lease``) when zero,
    negative, NaN or past 12 h: a claim given such a lease would be open to takeover at once."""
    return None if lease is None else conf.validate_lease(lease, "lease")


def lease_end(lease: float) -> Any:
    """Now() + ``lease`` seconds: the database clock's, never the worker's."""
    return after_now(timedelta(seconds=lease))


def lease_end_by_job(claims: Iterable[Any], override: float | None) -> Any:
    """Now() + each claim's lease (its ``lease_seconds``), on the database clock.

    Claims are grouped by lease, so the CASE has one branch per distinct lease however many
    claims there are.
    """
    if override is not None:
        return lease_end(override)
    by_lease: dict[float, list[Any]] = {}
    for c in claims:
        by_lease.setdefault(
            float(getattr(c, "lease_seconds", conf.DEFAULT_LEASE_SECONDS)), []
        ).append(c.pk)
    if len(by_lease) == 1:
        return lease_end(next(iter(by_lease)))
    whens = [When(pk__in=pks, then=lease_end(v)) for v, pks in sorted(by_lease.items())]
    return Case(*whens, default=lease_end(max(by_lease)))


@functools.lru_cache(maxsize=64)
def pg_sql(
    template: str, model: Any, db: str, *, all_queues: bool = False, returning: str = "j.*"
) -> str:
    """``template`` for ``model``'s tables; the claim's queue filter left out for a claim
    of every queue (the due half is then the same ordered index scan, unfiltered), and the
    claimed rows' columns ``returning`` (every column for a model instance, claiming.py's
    _ROW_RETURNING for plain rows)."""
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


def pg_ids(model: Any, db: str, template: str, params: dict[str, Any]) -> set[Any]:
    """Run ``template`` for ``model``'s tables; the ids it answers (the rows it touched)."""
    with connections[db].cursor() as cursor:
        cursor.execute(pg_sql(template, model, db), params)
        return {row[0] for row in cursor.fetchall()}


def pg_answer(db: str, sql: str, params: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """Run ``sql``; its column names and rows."""
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        return [c[0] for c in cursor.description], cursor.fetchall()
