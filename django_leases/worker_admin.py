"""The workers page: worker processes as they last reported themselves, the claims each
holds (counted for the whole page in one grouped statement) and who looks gone, on the
database clock. Read-only: a worker's row is its own to write.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.db.models import F
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _

from .admin_lists import EMPTY, TextFilterChangeList, age_seconds
from .durations import duration_text
from .models import Job, WorkerProcess
from .states import JobState

if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    from .worker_registry import WorkerQuerySet

    class _WorkerStatus(TypedDict):
        """What WorkerQuerySet.with_status() annotates."""

        db_now: datetime
        looks_gone: bool

    # The rows the workers page shows (get_queryset annotates them).
    ListedWorker = WithAnnotations[WorkerProcess, _WorkerStatus]

    # Generic in django-stubs, a plain class at run time.
    _WorkerAdminBase = admin.ModelAdmin[WorkerProcess]
else:
    _WorkerAdminBase = admin.ModelAdmin


class WorkerChangeList(TextFilterChangeList):
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
        return cast("WorkerQuerySet", super().get_queryset(request)).with_status()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[WorkerChangeList]:
        return WorkerChangeList

    @admin.display(description=_("queues"))
    def queue_list(self, worker: WorkerProcess) -> str:
        return ", ".join(map(str, worker.queues or [])) or EMPTY

    @admin.display(description=_("last seen"), ordering="last_seen_at")
    def last_seen(self, worker: ListedWorker) -> str:
        return f"{duration_text(age_seconds(worker.db_now, worker.last_seen_at) or 0)} ago"

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
            text = f"gone: stopped {duration_text(age_seconds(now, worker.stopped_at) or 0)} ago"
        elif worker.looks_gone:
            text = f"gone: not seen for {duration_text(age_seconds(now, worker.last_seen_at) or 0)}"
        else:
            return format_html('<span class="leases-worker-alive">{}</span>', "alive")
        return format_html('<span class="leases-worker-gone">{}</span>', text)
