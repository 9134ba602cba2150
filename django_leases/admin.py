"""The admin: claimed, expired and stalled jobs at a glance, and safe actions on them.

Pages only read. Every change an operator asks for goes through a JobQuerySet verb
(admin_actions.py), whose rowcount is reported back. What the job list shows and filters
by is in admin_lists.py; the workers page in worker_admin.py, the schedules page in
schedule_admin.py, both registered by importing them here. Ages and countdowns are
differences between two database-clock values, never the web server's clock.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import smart_split, unescape_string_literal
from django.utils.translation import gettext_lazy as _

from .admin_actions import JobActions
from .admin_lists import (
    EMPTY,
    LeaseAdminPaginator,
    LeaseFilter,
    QueueFilter,
    SortableByOnlyChangeList,
    TaskFilter,
    age_seconds,
    heartbeat_seconds,
    lease_text,
)
from .durations import duration_text
from .models import Job, WorkerProcess
from .schedule_admin import ScheduleAdmin, made_by
from .states import JobState
from .worker_admin import WorkerProcessAdmin

if TYPE_CHECKING:
    from .admin_lists import ListedJob
    from .query import JobQuerySet

    # Generic in django-stubs, a plain class at run time.
    _JobAdminBase = admin.ModelAdmin[Job]
else:
    _JobAdminBase = admin.ModelAdmin


def _pretty_json(value: Any) -> str:
    if value is None:
        return EMPTY
    return format_html(
        '<pre class="leases-json">{}</pre>',
        json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False),
    )


def _present(*names: str) -> list[str]:
    """The named Job fields that exist: the record grows (deadlines, unique keys, retry
    ladders) and the page shows whatever is there without failing the admin checks."""
    known = {f.name for f in Job._meta.get_fields()}
    return [n for n in names if n in known]


LEASE_FIELDS = (
    "lease_seconds",
    "lease_expires_at",
    "claim_token",
    "fence",
    "attempts",
    "max_attempts",
    "leases_lost",
    "releases",
    "claimed_by",
    "heartbeat_at",
)


# The failed attempts a job's page shows, the latest ones.
HISTORY_SHOWN = 50


@admin.register(Job)
class JobAdmin(JobActions, _JobAdminBase):
    """Jobs, read-only; operator actions (JobActions) call the conditional verbs of
    JobQuerySet."""

    list_display = [
        "id",
        "task_path",
        "queue_name",
        "state",
        "lease",
        "attempts_of_max",
        "fence",
        "claimed_by",
        "heartbeat_age",
        "due",
    ]
    list_display_links = ["id", "task_path"]
    empty_value_display = EMPTY
    list_filter = ["state", QueueFilter, TaskFilter, LeaseFilter]
    search_fields = ["id__exact", "task_path", "claimed_by__exact"]  # see get_search_fields
    search_help_text = _("A job id, part of a task path, or a worker id.")
    ordering = ["-id"]
    sortable_by = ["id"]  # and ?o= for no other column (SortableByOnlyChangeList)
    list_per_page = 50
    list_max_show_all = 500
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = LeaseAdminPaginator
    actions = ["retry_now", "requeue", "cancel", "expire_stalled", "purge_finished"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "task_path",
                    "queue_name",
                    "priority",
                    "state",
                    *_present("dead_reason", "unique_key"),
                    "made_by_schedule",
                ]
            },
        ),
        (_("Arguments"), {"fields": ["args_pretty", "kwargs_pretty"]}),
        (_("Lease"), {"fields": ["lease", *LEASE_FIELDS, *_present("on_lease_lost")]}),
        (_("Progress and result"), {"fields": ["cursor_pretty", "result_pretty"]}),
        (
            _("Timestamps"),
            {
                "fields": [
                    "enqueued_at",
                    "available_at",
                    *_present("deadline"),
                    "started_at",
                    "last_attempted_at",
                    "finished_at",
                ]
            },
        ),
        (_("Error history"), {"fields": ["error_history"]}),
    ]
    # Every fieldset above lists plain field names (no nested rows).
    readonly_fields = [
        name for _title, opts in fieldsets for name in cast("list[str]", opts["fields"])
    ]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return SortableByOnlyChangeList

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        # A number is a job id: searching the task names for it too would turn an index
        # lookup into a scan of every row.
        if request.GET.get("q", "").strip().isdigit():
            return ["id__exact"]
        return ["task_path", "claimed_by__exact"]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        """A word that is the id of a worker on record finds its jobs; one that is part of a
        task path present (the census lists them all) finds the jobs of those tasks by
        leases_job_census_idx; any other word is a worker id still. Each word narrows. A
        LIKE '%word%' over every row, OR-ed with an unindexed claimed_by, read the whole
        table: seconds on millions of jobs for a task with few of them. Quoted phrases are
        one word, as in Django's own search."""
        words = [
            unescape_string_literal(bit) if bit[:1] in "\"'" and bit[0] == bit[-1] else bit
            for bit in smart_split(search_term)
        ]
        if not words or search_term.strip().isdigit():
            return super().get_search_results(request, queryset, search_term)
        census = self.census(request)
        # Every queue present, so that the index's leading column is constrained too.
        queues = sorted({row["queue_name"] for row in census})
        known = set(
            WorkerProcess.objects.using(queryset.db)
            .filter(worker_id__in=words)
            .values_list("worker_id", flat=True)
        )
        for word in words:
            if word in known:
                queryset = queryset.filter(claimed_by=word)
                continue
            tasks = sorted(
                {
                    row["task_path"]
                    for row in census
                    if word.casefold() in row["task_path"].casefold()
                }
            )
            if tasks:
                queryset = queryset.filter(queue_name__in=queues, task_path__in=tasks)
            else:
                queryset = queryset.filter(claimed_by=word)
        return queryset, False

    # -- permissions: the admin views and acts, it never adds, edits or deletes rows --

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        # The model-level change permission gates the actions; no single job is editable,
        # since a hand-edited lease or token would break ownership.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False

    # -- reading -------------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> JobQuerySet:
        # Job's default manager is a JobQuerySet's.
        return cast("JobQuerySet", super().get_queryset(request)).with_lease_status(
            heartbeat_seconds()
        )

    def census(self, request: HttpRequest) -> list[dict[str, Any]]:
        """Counts per (queue, task, state), computed once per request."""
        if not hasattr(request, "_leases_census"):
            # Kept on the request, which declares no such attribute.
            request._leases_census = Job.objects.census()  # type: ignore[attr-defined]
        census: list[dict[str, Any]] = request._leases_census  # type: ignore[attr-defined]
        return census

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        return super().changelist_view(request, {**self.summary(request), **(extra_context or {})})

    def summary(self, request: HttpRequest) -> dict[str, Any]:
        """The header above the list: jobs per state and queue, and the lease problems."""
        states = list(JobState)
        per_queue: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(states, 0))
        for row in self.census(request):
            per_queue[row["queue_name"]][row["state"]] += row["n"]
        url = reverse("admin:django_leases_job_changelist")

        def link(**params: str) -> str:
            return f"{url}?{urlencode(params)}"

        rows: list[dict[str, Any]] = [
            {
                "queue": queue,
                "link": link(queue=queue),
                "total": sum(counts.values()),
                "cells": [(counts[s], link(queue=queue, state__exact=s)) for s in states],
            }
            for queue, counts in sorted(per_queue.items())
        ]
        totals = [
            (sum(r["cells"][i][0] for r in rows), link(state__exact=s))
            for i, s in enumerate(states)
        ]
        period = heartbeat_seconds()
        return {
            "leases_states": [s.label for s in states],
            "leases_rows": rows,
            "leases_totals": totals,
            "leases_total": sum(r["total"] for r in rows),
            "leases_expired": (Job.objects.expired().count(), link(lease="expired")),
            "leases_stalled": (Job.objects.stalled_claims(period).count(), link(lease="stalled")),
            "leases_heartbeat": duration_text(period),
            # On a big table the census estimates groups of over CENSUS_CAP jobs.
            "leases_estimated": any(row.get("estimated") for row in self.census(request)),
        }

    @admin.display(description=_("lease"))
    def lease(self, job: ListedJob) -> str:
        text = lease_text(job)
        status = getattr(job, "lease_status", None) or "none"
        return format_html('<span class="leases-lease leases-{}">{}</span>', status, text)

    @admin.display(description=_("attempts"))
    def attempts_of_max(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=_("heartbeat"))
    def heartbeat_age(self, job: ListedJob) -> str:
        if job.state != JobState.CLAIMED or job.heartbeat_at is None:
            return EMPTY
        return f"{duration_text(age_seconds(job.db_now, job.heartbeat_at) or 0)} ago"

    @admin.display(description=_("due"))
    def due(self, job: ListedJob) -> str:
        if job.state != JobState.PENDING:
            return EMPTY
        if job.available_at is None:
            return "parked"
        wait = (job.available_at - job.db_now).total_seconds()
        return f"in {duration_text(wait)}" if wait > 0 else "now"

    @admin.display(description=_("made by schedule"))
    def made_by_schedule(self, job: Job) -> str:
        return made_by(job)

    @admin.display(description=_("args"))
    def args_pretty(self, job: Job) -> str:
        return _pretty_json(job.args)

    @admin.display(description=_("kwargs"))
    def kwargs_pretty(self, job: Job) -> str:
        return _pretty_json(job.kwargs)

    @admin.display(description=_("checkpoint cursor"))
    def cursor_pretty(self, job: Job) -> str:
        return _pretty_json(job.cursor)

    @admin.display(description=_("result"))
    def result_pretty(self, job: Job) -> str:
        return _pretty_json(job.result)

    @admin.display(description=_("failed attempts"))
    def error_history(self, job: Job) -> str:
        """The last HISTORY_SHOWN failed attempts, oldest first, and how many came before:
        a job requeued over and over gathers thousands (a page of 20,000 was 107 MB)."""
        last = list(job.failures.order_by("-id")[:HISTORY_SHOWN])[::-1]
        earlier = job.failures.count() - len(last) if len(last) == HISTORY_SHOWN else 0
        return render_to_string(
            "admin/django_leases/job/error_history.html",
            {"failures": last, "earlier": earlier},
        )

    # -- the lease advisor: manage.py lease_report as a page ---------------------------

    def get_urls(self) -> list[Any]:
        from django.urls import path

        return [
            path(
                "advisor/",
                self.admin_site.admin_view(self.advisor_view),
                name="django_leases_job_advisor",
            ),
            *super().get_urls(),
        ]

    def advisor_view(self, request: HttpRequest) -> Any:
        """Per task: handler durations, lease, heartbeat and the advisor's verdict."""
        from django.core.exceptions import PermissionDenied
        from django.template.response import TemplateResponse

        from .advisor import report

        if not self.has_view_permission(request):
            raise PermissionDenied
        days = _days(request.GET.get("days"))
        return TemplateResponse(
            request,
            "admin/django_leases/job/advisor.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": _("Lease advisor"),
                "days": days,
                "rows": [
                    {
                        "advice": r,
                        "p50": duration_text(r.p50, precise=True),
                        "p99": duration_text(r.p99, precise=True),
                        "p999": duration_text(r.p999, precise=True),
                        "max": duration_text(r.max, precise=True),
                        "lease": duration_text(r.lease, precise=True),
                        "heartbeat": "lease/3"
                        if r.heartbeat is None
                        else duration_text(r.heartbeat, precise=True),
                        "recommended": duration_text(r.recommended_lease, precise=True),
                    }
                    for r in report(days)
                ],
            },
        )


def _days(value: str | None) -> float | None:
    """The advisor's window: 7 days unless the query asks for 0 (all time) or a sane number."""
    try:
        days = float(value if value is not None else 7)
    except ValueError:
        return 7.0
    if days == 0:
        return None
    return days if math.isfinite(days) and 0 < days <= 3650 else 7.0


__all__ = [
    "JobAdmin",
    "LeaseAdminPaginator",
    "ScheduleAdmin",
    "WorkerProcessAdmin",
    "heartbeat_seconds",
]
