"""The schedules page: where each periodic schedule stands, and pause, resume, run now.

Like the jobs page it only reads, and acts through ScheduleQuerySet verbs. "In 4 min" and
"3 min ago" are differences between database-clock values (``db_now`` annotated as Now()).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db import router
from django.db.models.functions import Now
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from .admin_lists import TextFilterChangeList
from .admin_log import atomic_with_log, log_changed
from .exceptions import DuplicateJob
from .models import Schedule
from .schedules import Periodic

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from .schedule_query import ScheduleQuerySet

    _ScheduleAdminBase = admin.ModelAdmin[Schedule]
else:
    _ScheduleAdminBase = admin.ModelAdmin


EMPTY = "—"


def humanize_seconds(seconds: float) -> str:
    """42 s, 3 min, 5 h, 2 d (admin.py's jobs page reads durations the same way)."""
    s = abs(seconds)
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if s < limit:
            return f"{int(s // size)} {unit}"
    return f"{int(s // 86400)} d"


def job_link(job: Any) -> str:
    """A job's id and state, linked to its page."""
    url = reverse("admin:django_leases_job_change", args=[job.pk])
    return format_html('<a href="{}">job {}</a> ({})', url, job.pk, job.get_state_display())


def schedule_link(schedule: Any) -> str:
    url = reverse("admin:django_leases_schedule_change", args=[schedule.pk])
    return format_html('<a href="{}">{}</a>', url, schedule.name)


@admin.register(Schedule)
class ScheduleAdmin(_ScheduleAdminBase):
    """Periodic schedules, read-only; pause, resume and run now call ScheduleQuerySet verbs."""

    list_display = [
        "name",
        "task_path",
        "when",
        "next_run",
        "last_run",
        "paused",
        "misfires",
        "skipped",
    ]
    list_filter = ["paused", "backend"]
    search_fields = ["name", "task_path"]
    empty_value_display = EMPTY
    actions = ["pause", "resume", "run_now"]
    shown = [
        "name",
        "backend",
        "task_path",
        "when",
        "arguments",
        "policies",
        "paused",
        "next_run",
        "last_run",
        "ticks",
        "misfires",
        "skipped",
        "removed_at",
        "created_at",
        "synced_at",
        "recent_runs",
    ]
    fieldsets = [(None, {"fields": list[Any](shown)})]
    readonly_fields = shown

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[TextFilterChangeList]:
        return TextFilterChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        # Schedules are declared in code; the change permission gates the actions only.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        return super().get_queryset(request).select_related("last_job").annotate(db_now=Now())

    @admin.display(description=_("when"))
    def when(self, schedule: Schedule) -> str:
        try:
            return Periodic.from_json(schedule.spec).describe()
        except Exception:  # noqa: BLE001 -- a row written by another version: show it raw
            return str(schedule.spec)

    @admin.display(description=_("arguments"))
    def arguments(self, schedule: Schedule) -> str:
        spec = schedule.spec or {}
        return f"args={spec.get('args')!r} kwargs={spec.get('kwargs')!r}"

    @admin.display(description=_("policies"))
    def policies(self, schedule: Schedule) -> str:
        spec = schedule.spec or {}
        misfire = spec.get("misfire")
        if misfire == "each":
            misfire = f"each (up to {spec.get('misfire_limit')})"
        return f"misfire: {misfire}; overlap: {spec.get('overlap')}"

    @admin.display(description=_("next run"), ordering="next_tick_at")
    def next_run(self, schedule: Schedule) -> str:
        if schedule.removed_at is not None:
            return str(_("removed from code"))
        if schedule.paused:
            return str(_("paused"))
        if schedule.next_tick_at is None:
            return str(_("planned at the next worker poll"))
        now = schedule.db_now  # type: ignore[attr-defined]
        seconds = (schedule.next_tick_at - now).total_seconds()
        if seconds <= 0:
            return f"due {humanize_seconds(-seconds)} ago"
        return f"in {humanize_seconds(seconds)}"

    @admin.display(description=_("last run"), ordering="last_tick_at")
    def last_run(self, schedule: Schedule) -> str:
        if schedule.last_tick_at is None:
            return EMPTY
        now = schedule.db_now  # type: ignore[attr-defined]
        ago = humanize_seconds((now - schedule.last_tick_at).total_seconds())
        if schedule.last_job is None:
            return f"{ago} ago"
        return format_html("{} ago: {}", ago, job_link(schedule.last_job))

    @admin.display(description=_("recent runs"))
    def recent_runs(self, schedule: Schedule) -> str:
        runs = list(schedule.runs.select_related("job").order_by("-id")[:20])
        if not runs:
            return EMPTY
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                "<li>{} {}: {}</li>",
                (
                    (
                        r.get_kind_display(),
                        r.tick_at.isoformat() if r.tick_at else "",
                        job_link(r.job) if r.job else EMPTY,
                    )
                    for r in runs
                ),
            ),
        )

    # -- actions -------------------------------------------------------------------

    def _selection(self, queryset: QuerySet[Schedule]) -> ScheduleQuerySet:
        # Without the list's annotations: the verb's statement is the plain UPDATE.
        return Schedule.objects.filter(pk__in=queryset.values("pk"))

    def _switch(self, request: HttpRequest, queryset: QuerySet[Schedule], pause: bool) -> None:
        """Pause or resume the selection: the schedules it would change locked, then
        changed, in one transaction, so the log names the ones this action changed and
        none another session did meanwhile."""
        db = router.db_for_write(Schedule)
        selection = self._selection(queryset).using(db)
        verb = "paused" if pause else "resumed from now"
        with atomic_with_log(db):
            total = selection.count()
            locked = selection.filter(paused=not pause).select_for_update().order_by("pk")
            switched = list(locked.only("pk", "name", "paused"))
            them = Schedule.objects.using(db).filter(pk__in=[s.pk for s in switched])
            done = them.pause() if pause else them.resume()
            # In the same transaction: no change committed without its entries.
            log_changed(request, switched, f"{verb.capitalize()} by the admin action.")
        self.message_user(request, f"{done} of {total} {verb}.")

    @admin.action(description=_("Pause selected schedules"), permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, pause=True)

    @admin.action(description=_("Resume selected schedules"), permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, pause=False)

    @admin.action(
        description=_("Run now: one job of each selected schedule (not a tick)"),
        permissions=["change"],
    )
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        made, refused = [], []
        for schedule in self._selection(queryset):
            try:
                # The job and its entry in one transaction.
                with atomic_with_log(router.db_for_write(Schedule)):
                    job = Schedule.objects.run_now(schedule)
                    log_changed(request, [schedule], f"Run now by the admin action: job {job.pk}.")
            except (LookupError, ValueError, DuplicateJob) as e:
                refused.append(f"{schedule.name}: {e}")
                continue
            made.append(job)
        if made:
            self.message_user(
                request,
                format_html(
                    "Enqueued {}.",
                    format_html_join(", ", "{}", ((job_link(j),) for j in made)),
                ),
            )
        if refused:
            self.message_user(request, "Not run: " + "; ".join(refused), messages.WARNING)


def made_by(job: Any) -> str:
    """The schedule a job came from, linked (for the jobs page), or an em dash."""
    run = getattr(job, "schedule_run", None)
    if run is None:
        return EMPTY
    what = "run now" if run.kind == "run_now" else f"tick {run.tick_at.isoformat()}"
    return format_html("{} ({})", schedule_link(run.schedule), what)
