"""The admin: claimed, expired and stalled jobs at a glance, and safe actions on them.

Pages only read. Every change an operator asks for goes through a JobQuerySet verb, a
conditional UPDATE (or DELETE) whose rowcount is reported back, so the message says what
really changed, not what was asked for. Ages and countdowns are differences between two
database-clock values (``db_now`` is annotated as Now()), never the web server's clock.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import smart_split, unescape_string_literal
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import conf
from .durations import duration_text
from .models import Job, WorkerProcess
from .schedule_admin import ScheduleAdmin, made_by
from .states import JobState

if TYPE_CHECKING:
    from typing import TypedDict

    from django.utils.functional import _StrOrPromise
    from django_stubs_ext import WithAnnotations

    from .query import JobQuerySet
    from .worker_registry import WorkerQuerySet

    class _LeaseStatus(TypedDict):
        """What JobQuerySet.with_lease_status() annotates."""

        db_now: datetime
        lease_status: str | None

    class _WorkerStatus(TypedDict):
        """What WorkerQuerySet.with_status() annotates."""

        db_now: datetime
        looks_gone: bool

    # The rows the admin's lists show (get_queryset annotates them).
    ListedJob = WithAnnotations[Job, _LeaseStatus]
    ListedWorker = WithAnnotations[WorkerProcess, _WorkerStatus]

    # Generic in django-stubs, plain classes at run time.
    _JobPaginatorBase = Paginator[Job]
    _JobAdminBase = admin.ModelAdmin[Job]
    _WorkerAdminBase = admin.ModelAdmin[WorkerProcess]
else:
    _JobPaginatorBase = Paginator
    _JobAdminBase = _WorkerAdminBase = admin.ModelAdmin

EMPTY = "—"


def heartbeat_seconds() -> float:
    """The renewal period of the first lease backend: "stalled" means two of them missed."""
    return conf.get_options().heartbeat_seconds


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else (now - then).total_seconds()


def lease_text(job: ListedJob, period: float) -> str:
    """Say where the claim stands: "expires in 42 s", "expired 3 min ago", "stalled: …"."""
    status = getattr(job, "lease_status", None)
    if status is None or job.lease_expires_at is None:
        return EMPTY
    now = job.db_now
    if status == "expired":
        return f"expired {duration_text(_age(now, job.lease_expires_at) or 0)} ago"
    remaining = duration_text((job.lease_expires_at - now).total_seconds())
    if status == "stalled":
        silent = _age(now, job.heartbeat_at)
        if silent is not None and silent > 2 * period:
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
                queues.update(params.get("QUEUES", []))
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
    "claimed_by",
    "heartbeat_at",
)


# What an action can change; a job whose values differ afterwards is logged as changed.
_WATCHED = ("state", "available_at", "lease_expires_at", "claim_token")


def _watched(job: Job) -> tuple[Any, ...]:
    return tuple(getattr(job, name) for name in _WATCHED)


def after_count(selection: JobQuerySet, verb: str) -> int:
    """Selected jobs a verb had to leave in place: for requeue, the dead or cancelled jobs
    still dead or cancelled afterwards (their unique key is held by an active job)."""
    if verb == "requeue":
        return selection.filter(state__in=[JobState.DEAD, JobState.CANCELLED]).count()
    return 0


@admin.register(Job)
class JobAdmin(_JobAdminBase):
    """Jobs, read-only; operator actions call the conditional verbs of JobQuerySet."""

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
    sortable_by = ["id"]
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
        text = lease_text(job, heartbeat_seconds())
        status = getattr(job, "lease_status", None) or "none"
        return format_html('<span class="leases-lease leases-{}">{}</span>', status, text)

    @admin.display(description=_("attempts"))
    def attempts_of_max(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=_("heartbeat"))
    def heartbeat_age(self, job: ListedJob) -> str:
        if job.state != JobState.CLAIMED or job.heartbeat_at is None:
            return EMPTY
        return f"{duration_text(_age(job.db_now, job.heartbeat_at) or 0)} ago"

    @admin.display(description=_("due"))
    def due(self, job: ListedJob) -> str:
        if job.state != JobState.PENDING:
            return EMPTY
        if job.available_at is None:
            return "parked"
        wait = (job.available_at - job.db_now).total_seconds()
        return f"in {duration_text(wait)}" if wait > 0 else "now"

    @admin.display(description=_("args"))
    @admin.display(description=_("made by schedule"))
    def made_by_schedule(self, job: Job) -> str:
        return made_by(job)

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
        return render_to_string(
            "admin/django_leases/job/error_history.html",
            {"failures": list(job.failures.order_by("attempt", "id"))},
        )

    # -- actions: each calls one verb, reports its rowcount and logs what changed --------

    def _act(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        verb: Callable[[JobQuerySet], int],
        done: str,
        not_eligible: str,
        *,
        waiting: str = "",
    ) -> None:
        # Rebuild the selection without the list's annotations, so the verb's statement is
        # the plain conditional UPDATE operators.py wrote.
        selection = Job.objects.filter(pk__in=queryset.values("pk"))
        before = {job.pk: job for job in selection.only("task_path", *_WATCHED)}
        changed = verb(selection)
        after = {job.pk: job for job in Job.objects.filter(pk__in=before).only(*_WATCHED)}
        self._log(
            request,
            [
                job
                for pk, job in before.items()
                if pk not in after or _watched(after[pk]) != _watched(job)
            ],
            done,
            after,
        )
        total = len(before)
        # Jobs the verb left alone for a reason of their own (a held unique key), counted
        # apart from the ineligible ones.
        held = after_count(selection, waiting) if waiting else 0
        message = f"{changed} of {total} {done}"
        skipped = total - changed - held
        if skipped > 0:
            message += "; " + ngettext("%(n)d was %(why)s", "%(n)d were %(why)s", skipped) % {
                "n": skipped,
                "why": not_eligible,
            }
        if held > 0:
            message += "; " + ngettext(
                "%(n)d stays: another active job holds its unique key",
                "%(n)d stay: other active jobs hold their unique keys",
                held,
            ) % {"n": held}
        self.message_user(
            request, message + ".", messages.SUCCESS if skipped + held <= 0 else messages.WARNING
        )

    def _log(
        self, request: HttpRequest, changed: list[Job], done: str, after: dict[Any, Job]
    ) -> None:
        """One admin log entry per job the action changed (deletion for a purged one)."""
        from django.contrib.admin.models import CHANGE, DELETION, LogEntry

        for flag, jobs in (
            (CHANGE, [j for j in changed if j.pk in after]),
            (DELETION, [j for j in changed if j.pk not in after]),
        ):
            if jobs:
                # single_object is known at run time only; django-stubs types it by literal.
                LogEntry.objects.log_actions(  # type: ignore[call-overload]
                    user_id=request.user.pk,
                    queryset=jobs,
                    action_flag=flag,
                    change_message=f"{done.capitalize()} by the admin action.",
                    single_object=len(jobs) == 1,
                )

    def _confirmation(
        self, request: HttpRequest, queryset: QuerySet[Job], action: str, question: _StrOrPromise
    ) -> Any:
        """Django's delete_selected pattern: the first POST shows what the action would
        touch and asks (this page); the second (post=yes) gets None and acts."""
        from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
        from django.template.response import TemplateResponse

        if request.POST.get("post") == "yes":
            return None
        jobs = list(Job.objects.filter(pk__in=queryset.values("pk")).order_by("-id")[:100])
        return TemplateResponse(
            request,
            "admin/django_leases/job/action_confirmation.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": _("Are you sure?"),
                "question": question,
                "action": action,
                "jobs": jobs,
                "total": queryset.count(),
                "selected": [str(pk) for pk in queryset.values_list("pk", flat=True)],
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "select_across": request.POST.get("select_across", "0"),
            },
        )

    @admin.action(
        description=_("Retry now: make selected pending jobs due"), permissions=["change"]
    )
    def retry_now(self, request: HttpRequest, queryset: JobQuerySet) -> None:
        self._act(request, queryset, lambda qs: qs.retry_now(), "made due now", "not pending")

    @admin.action(description=_("Requeue selected dead or cancelled jobs"), permissions=["change"])
    def requeue(self, request: HttpRequest, queryset: JobQuerySet) -> None:
        self._act(
            request,
            queryset,
            lambda qs: qs.requeue(),
            "requeued",
            "no longer dead or cancelled",
            waiting="requeue",
        )

    @admin.action(description=_("Cancel selected pending or claimed jobs"), permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: JobQuerySet) -> Any:
        if asking := self._confirmation(
            request,
            queryset,
            "cancel",
            _(
                "Cancel these jobs? A running handler is told to stop at its next renewal, "
                "and its result is discarded."
            ),
        ):
            return asking
        self._act(
            request, queryset, lambda qs: qs.cancel(), "cancelled", "no longer pending or claimed"
        )
        return None

    @admin.action(
        description=_("Expire selected stalled claims now (their worker is gone)"),
        permissions=["change"],
    )
    def expire_stalled(self, request: HttpRequest, queryset: JobQuerySet) -> Any:
        if asking := self._confirmation(
            request,
            queryset,
            "expire_stalled",
            _(
                "End these stalled leases now? Another worker may claim the jobs at once; if "
                "their worker is in fact alive, both run them."
            ),
        ):
            return asking
        period = heartbeat_seconds()
        self._act(
            request,
            queryset,
            lambda qs: qs.expire_stalled_now(period),
            "expired",
            "not stalled claims",
        )
        return None

    @admin.action(
        description=_("Purge selected finished jobs (succeeded or cancelled)"),
        permissions=["change"],
    )
    def purge_finished(self, request: HttpRequest, queryset: JobQuerySet) -> Any:
        if asking := self._confirmation(
            request,
            queryset,
            "purge_finished",
            _(
                "Delete these finished jobs, their results and their failure history? "
                "This cannot be undone."
            ),
        ):
            return asking
        self._act(
            request,
            queryset,
            lambda qs: qs.purge_finished(),
            "purged",
            "not succeeded or cancelled",
        )
        return None

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


class WorkerChangeList(ChangeList):
    """The workers of a page, each with the claims it holds (``claims``: held, expired),
    counted for the whole page in one grouped statement."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        workers = list(self.result_list)  # evaluated here, the template reads the same rows
        held = Job.objects.claims_per_worker(w.worker_id for w in workers)
        for worker in workers:
            # An attribute of the listed row, as an annotation would be.
            worker.claims = held.get(worker.worker_id, (0, 0))


@admin.register(WorkerProcess)
class WorkerProcessAdmin(_WorkerAdminBase):
    """Worker processes as they last reported themselves, with the claims they hold."""

    list_display = [
        "worker_id",
        "hostname",
        "pid",
        "queue_list",
        "started_at",
        "last_seen",
        "claims",
        "status",
    ]
    search_fields = ["worker_id", "hostname"]
    # Running workers first, then the most recently stopped.
    ordering = [F("stopped_at").desc(nulls_first=True), "-last_seen_at"]
    show_full_result_count = False
    readonly_fields = [
        "worker_id",
        "hostname",
        "pid",
        "queues",
        "started_at",
        "last_seen_at",
        "stopped_at",
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: WorkerProcess | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: WorkerProcess | None = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> WorkerQuerySet:
        # WorkerProcess's default manager is a WorkerQuerySet's.
        return cast("WorkerQuerySet", super().get_queryset(request)).with_status(
            heartbeat_seconds()
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[WorkerChangeList]:
        return WorkerChangeList

    @admin.display(description=_("queues"))
    def queue_list(self, worker: WorkerProcess) -> str:
        return ", ".join(map(str, worker.queues or [])) or EMPTY

    @admin.display(description=_("last seen"), ordering="last_seen_at")
    def last_seen(self, worker: ListedWorker) -> str:
        return f"{duration_text(_age(worker.db_now, worker.last_seen_at) or 0)} ago"

    @admin.display(description=_("claims held"))
    def claims(self, worker: WorkerProcess) -> str:
        held, expired = getattr(worker, "claims", (0, 0))  # set by WorkerChangeList
        if not held:
            return "0"
        url = reverse("admin:django_leases_job_changelist")
        query = urlencode({"claimed_by": worker.worker_id, "state__exact": JobState.CLAIMED})
        label = f"{held} ({expired} expired)" if expired else str(held)
        return format_html('<a href="{}?{}">{}</a>', url, query, label)

    @admin.display(description=_("status"))
    def status(self, worker: ListedWorker) -> str:
        now = worker.db_now
        if worker.stopped_at is not None:
            text = f"gone: stopped {duration_text(_age(now, worker.stopped_at) or 0)} ago"
        elif worker.looks_gone:
            text = f"gone: not seen for {duration_text(_age(now, worker.last_seen_at) or 0)}"
        else:
            return format_html('<span class="leases-worker-alive">{}</span>', "alive")
        return format_html('<span class="leases-worker-gone">{}</span>', text)


__all__ = ["JobAdmin", "ScheduleAdmin", "WorkerProcessAdmin"]
