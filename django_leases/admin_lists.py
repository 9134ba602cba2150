"""What the job list shows and narrows by: the lease column's words, the paginator that
counts a bounded number of rows, and the filters offered from the per-request census.

Ages and countdowns are differences between two database-clock values (``db_now`` is
annotated as Now()), never the web server's clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import FieldDoesNotExist
from django.core.paginator import Paginator
from django.db.models import JSONField, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest
from django.utils.functional import cached_property
from django.utils.translation import gettext_lazy as _

from . import conf
from .durations import duration_text
from .models import Job

if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    from .query import JobQuerySet

    class _LeaseStatus(TypedDict):
        """What JobQuerySet.with_lease_status() annotates."""

        db_now: datetime
        lease_status: str | None
        heartbeat_silent: bool

    # The rows the job list shows (JobAdmin.get_queryset annotates them).
    ListedJob = WithAnnotations[Job, _LeaseStatus]

    # Generic in django-stubs, a plain class at run time.
    _JobPaginatorBase = Paginator[Job]
else:
    _JobPaginatorBase = Paginator

EMPTY = "—"


def heartbeat_seconds() -> float:
    """The renewal period of the first lease backend: what a claim of a worker with no row
    (or a 0.1.0 worker's) is judged by."""
    return conf.get_options().heartbeat_seconds


def age_seconds(now: datetime, then: datetime | None) -> float | None:
    """Seconds from ``then`` to ``now`` (both read from the database clock); None for no
    ``then``."""
    return None if then is None else (now - then).total_seconds()


def lease_text(job: ListedJob) -> str:
    """Say where the claim stands: "expires in 42 s", "expired 3 min ago", "stalled: …"."""
    status = getattr(job, "lease_status", None)
    if status is None or job.lease_expires_at is None:
        return EMPTY
    now = job.db_now
    if status == "expired":
        return f"expired {duration_text(age_seconds(now, job.lease_expires_at) or 0)} ago"
    remaining = duration_text((job.lease_expires_at - now).total_seconds())
    if status == "stalled":
        silent = age_seconds(now, job.heartbeat_at)
        if silent is not None and job.heartbeat_silent:
            return f"stalled: no heartbeat for {duration_text(silent)}"
        return f"stalled: worker gone, expires in {remaining}"
    return f"expires in {remaining}"


class LeaseAdminPaginator(_JobPaginatorBase):
    """Count exactly up to ``exact_limit`` rows and estimate beyond.

    COUNT(*) over a million jobs costs more than the rest of the page together. A bounded
    count is cheap (it stops at the limit), and past it the planner's estimate is good
    enough to number pages; ``is_estimate`` lets the template say "about". An estimate
    below what was just counted is known wrong (the planner misjudges columns that go
    together, such as a claimed state and its lease, or a substring search): then the
    count is ``exact_limit`` + 1 and ``is_lower_bound`` lets the template say "more than".
    """

    exact_limit = 10_000
    is_estimate = False
    is_lower_bound = False

    @cached_property
    def count(self) -> int:
        qs = self.object_list
        if not isinstance(qs, QuerySet):
            return len(qs)
        bounded = qs.order_by().values("pk")[: self.exact_limit + 1].count()
        if bounded <= self.exact_limit:
            return bounded
        # The paginator of JobAdmin: its object_list is the admin's JobQuerySet.
        estimate = cast("JobQuerySet", qs).estimated_count()
        if estimate is None:
            return qs.count()
        if estimate < bounded:
            self.is_lower_bound = True
            return bounded
        self.is_estimate = True
        return estimate

    def get_elided_page_range(
        self, number: int | float | str = 1, *, on_each_side: int = 3, on_ends: int = 2
    ) -> Iterator[str | int]:
        """Past the bound, links only to the pages of the rows counted: a page an estimate
        promises may not exist, and OFFSET reads every row it skips (3.5 s for page 100,000
        of 5,100,000 jobs). A page typed in the address still opens."""
        page = self.validate_number(number)
        counted = Paginator(range(self.exact_limit + 1), self.per_page)
        if (self.is_estimate or self.is_lower_bound) and page <= counted.num_pages:
            return counted.get_elided_page_range(page, on_each_side=on_each_side, on_ends=on_ends)
        return super().get_elided_page_range(page, on_each_side=on_each_side, on_ends=on_ends)


# What a filter in the address may ask of a column: its value, values above or below one,
# none, or empty (EmptyFieldListFilter's); of a date, also a part of it (date_hierarchy's).
# Not __range: Django never splits an address's value into its two bounds, so every
# ?id__range= was refused or a 500.
PLAIN_LOOKUPS = frozenset({"exact", "in", "isnull", "isempty", "gt", "gte", "lt", "lte"})
DATE_PARTS = frozenset({"date", "year", "month", "day", "week", "week_day", "quarter"})
# The values a date part can take: another (?enqueued_at__year=99999) was a 500 when the
# database's answer or the bounds Django computes left Python's datetime range.
PART_RANGES = {
    # Not the calendar's first and last years: Django's bounds of year 1 or 9999, moved
    # to UTC from a TIME_ZONE east or west of it, leave datetime's range (SQLite, MySQL).
    "year": (1000, 9998),
    "month": (1, 12),
    "day": (1, 31),
    "week": (1, 53),
    "week_day": (1, 7),
    "quarter": (1, 4),
}


class TextFilterChangeList(ChangeList):
    """Refuses, as Django's admin refuses a bad lookup (the list again, "?e=1"), a filter
    value with a NUL in it (PostgreSQL cannot hold NUL in text: ``?queue_name=%00`` was a
    DataError, and a 500), and a filter on a column by anything but its value
    (PLAIN_LOOKUPS): Django takes any lookup on a model's own field, so
    ``?claimed_by__regex=(`` was a 500 and ``?args__contains=`` or ``?task_path__icontains=``
    a read of every job at each page."""

    def get_filters_params(self, params: Any = None) -> Any:
        lookup_params = super().get_filters_params(params)
        for key, values in lookup_params.items():
            values = values if isinstance(values, list | tuple) else [values]
            if "\x00" in key or any("\x00" in str(v) for v in values):
                raise IncorrectLookupParameters(f"a NUL character in filter {key!r}")
            if not self._plain(key):
                raise IncorrectLookupParameters(f"filter {key!r} asks more than a value")
            if (part := _date_part(key)) and not all(_in_range(v, part) for v in values):
                raise IncorrectLookupParameters(f"filter {key!r} is not a {part} number")
        return lookup_params

    def _plain(self, key: str) -> bool:
        return plain_lookup(self.model, key)


def plain_lookup(model: Any, key: str) -> bool:
    """Whether filter ``key`` asks no more of ``model``'s columns than PLAIN_LOOKUPS: a
    list filter's own parameter (no field of that name) is; a relation's is judged on the
    related model; a JSON field never is (its lookups read every row)."""
    name, _sep, rest = key.partition(LOOKUP_SEP)
    try:
        field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    except FieldDoesNotExist:
        return True  # a SimpleListFilter's parameter, or refused by Django itself
    if isinstance(field, JSONField):
        return False
    if not rest:
        return True
    if field.is_relation and field.related_model is not None:
        head = rest.partition(LOOKUP_SEP)[0]
        if head not in PLAIN_LOOKUPS:
            return plain_lookup(field.related_model, rest)
    *parts, last = rest.split(LOOKUP_SEP)
    return all(part in DATE_PARTS for part in parts) and last in PLAIN_LOOKUPS | DATE_PARTS


def _date_part(key: str) -> str:
    """The date part a filter ``key`` compares (``enqueued_at__year__gte``: "year"), or ""."""
    return next((p for p in reversed(key.split(LOOKUP_SEP)) if p in PART_RANGES), "")


def _in_range(value: Any, part: str) -> bool:
    """Whether ``value`` (one, or the comma-separated values of ``__in``) is a whole number
    ``part`` can be."""
    low, high = PART_RANGES[part]
    for item in str(value).split(","):
        try:
            number = int(item.strip())
        except ValueError:
            return False
        if not low <= number <= high:
            return False
    return True


class SortableByOnlyChangeList(TextFilterChangeList):
    """Sorts by the columns ``sortable_by`` names, and no other: Django hides the other
    headers' links but still takes ``?o=`` for any column, and sorting a million jobs by
    an unindexed column is a full sort at every page."""

    def get_ordering_field(self, field_name: Any) -> Any:
        if self.sortable_by is not None and field_name not in self.sortable_by:
            return None
        return super().get_ordering_field(field_name)


class CensusFilter(admin.SimpleListFilter):
    """Offer the values present in the table, read from the per-request census (one GROUP BY)
    instead of a SELECT DISTINCT over every job."""

    field = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = {row[self.field] for row in model_admin.census(request)}
        values.update(self.extra_values())
        return [(v, v) for v in sorted(values)]

    def extra_values(self) -> set[str]:
        return set()

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value():
            return queryset.filter(**{self.field: self.value()})
        return None


class QueueFilter(CensusFilter):
    title = _("queue")
    parameter_name = "queue"
    field = "queue_name"

    def extra_values(self) -> set[str]:
        from django.conf import settings
        from django.db import router

        # Only backends whose jobs live where the admin reads them (DATABASE_ROUTERS).
        database = router.db_for_read(Job)
        queues: set[str] = set()
        for alias in conf.lease_backend_aliases():
            params = settings.TASKS[alias]
            if (params.get("OPTIONS") or {}).get("DATABASE", "default") == database:
                queues.update(conf.served_queues(alias) or ())  # absent: "default"
        return queues


class TaskFilter(CensusFilter):
    title = _("task")
    parameter_name = "task"
    field = "task_path"


class LeaseFilter(admin.SimpleListFilter):
    """The lease predicates of query.py, on the database clock."""

    title = _("lease")
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("claimed", _("claimed (lease valid)")),
            ("expired", _("expired (claimed, lease passed)")),
            ("stalled", _("stalled (lease valid, renewals stopped or worker gone)")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        jobs = cast("JobQuerySet", queryset)  # JobAdmin's own queryset
        if value == "claimed":
            return jobs.lease_valid()
        if value == "expired":
            return jobs.expired()
        if value == "stalled":
            return jobs.stalled_claims(heartbeat_seconds())
        return None
