"""The job list's actions. Each calls one JobQuerySet verb, a conditional UPDATE (or
DELETE) whose rowcount is reported back, so the message says what really changed, not
what was asked for, and logs an entry for each job it changed; those that stop or delete
a job ask first, as Django's delete_selected does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db import OperationalError, connections, router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .admin_lists import heartbeat_seconds
from .admin_log import atomic_with_log, log_changed, log_deleted
from .deadlocks import TRIES as DEADLOCK_TRIES
from .deadlocks import is_deadlock
from .id_chunks import id_chunks
from .models import Job

if TYPE_CHECKING:
    from django.utils.functional import _StrOrPromise

    from .query import JobQuerySet

    # For the type checker the mixin is the ModelAdmin it is mixed into.
    _JobAdminBase = admin.ModelAdmin[Job]
else:
    _JobAdminBase = object

# What an action can change; a job whose values differ afterwards is logged as changed.
_WATCHED = ("state", "available_at", "lease_expires_at", "claim_token")


def _watched(job: Job) -> tuple[Any, ...]:
    return tuple(getattr(job, name) for name in _WATCHED)


# Why jobs a verb may change stayed as they were, per verb that can leave some.
_HELD = {
    "requeue": (
        "%(n)d stays: another active job holds its unique key",
        "%(n)d stay: other active jobs hold their unique keys",
    ),
    "purge": (
        "%(n)d stays: a row of the project protects it",
        "%(n)d stay: rows of the project protect them",
    ),
}

# The jobs each action's verb may change (its JobQuerySet.*_candidates()): the only ones
# it locks.
Eligible = Callable[["JobQuerySet"], "JobQuerySet"]


def _acted(
    selection: JobQuerySet,
    eligible: Eligible,
    verb: Callable[[JobQuerySet], int],
    *,
    no_key: bool,
    log: Callable[[dict[Any, Job], dict[Any, Job]], None],
) -> tuple[int, dict[Any, Job], int, dict[Any, Job]]:
    """(how many are selected, the eligible jobs before, the verb's count, those jobs
    after), in one transaction with the eligible jobs locked and the verb run on them
    alone (as many times as a statement's parameters need, id_chunks.py): what differs
    after is the verb's own change, never a worker's claim or ack, a prune or another
    person's action in between. Jobs the verb cannot change are not
    locked, so nothing waits on them. ``no_key``: the verb's UPDATE leaves the columns of
    unique indexes alone (not ``state``, which the unique active_key follows), so on
    PostgreSQL the rows are locked FOR NO KEY UPDATE as that UPDATE would lock them, which
    a handler's rows pointing at its job (FOR KEY SHARE) do not hold up; otherwise FOR
    UPDATE, the lock that UPDATE or DELETE takes anyway. Sent again if the database picked
    it as a deadlock victim (it changed nothing then), unless it runs inside the caller's
    transaction, which only the caller can redo. ``log(before, after)`` writes the admin
    log's entries in the same transaction (admin_log.atomic_with_log): a change is never
    committed without its entries."""
    db = router.db_for_write(Job)
    selection = selection.using(db)  # every read in the transaction, never a replica
    connection = connections[db]
    weakest = no_key and connection.features.has_select_for_no_key_update
    own = not connection.in_atomic_block and connection.get_autocommit()
    tries = DEADLOCK_TRIES if own else 1
    for tries_left in range(tries - 1, -1, -1):
        try:
            with atomic_with_log(db):
                locked = eligible(selection).select_for_update(no_key=weakest).order_by("pk")
                before = {job.pk: job for job in locked.only("task_path", *_WATCHED)}
                total = max(selection.count(), len(before))
                changed, after = 0, dict[Any, Job]()
                # Newest first: of jobs sharing a unique key in different chunks, requeue
                # puts back the newest, as it does within one call.
                for ids in id_chunks(db, sorted(before, reverse=True)):
                    jobs = Job.objects.using(db).filter(pk__in=ids)
                    changed += verb(jobs)
                    after.update((job.pk, job) for job in jobs.only(*_WATCHED))
                log(before, after)
            return total, before, changed, after
        except OperationalError as error:
            if not tries_left or not is_deadlock(error):
                raise
    raise AssertionError("unreachable")


# The most finished jobs one purge action deletes: a request must end well inside a proxy's
# timeout (10,000 take a few seconds; leases_prune deletes any number in short batches).
PURGE_LIMIT = 10_000


def _picked(request: HttpRequest) -> int:
    """How many jobs the person ticked (0 for "all N" across pages): Django acts on those
    still inside the list's filter, and one that left it meanwhile (a pending job a worker
    ran, on ?state__exact=pending) is still one they asked for, to be counted as left alone."""
    from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME

    if request.POST.get("select_across") == "1":
        return 0
    return len(set(request.POST.getlist(ACTION_CHECKBOX_NAME)))


class JobActions(_JobAdminBase):
    """The actions of JobAdmin (a mixin of its ModelAdmin)."""

    def _act(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        eligible: Eligible,
        verb: Callable[[JobQuerySet], int],
        done: str,
        not_eligible: str,
        *,
        held_because: str = "",
        no_key: bool = False,
    ) -> None:
        # Rebuild the selection without the list's annotations, so the verb's statement is
        # the plain conditional UPDATE operators.py wrote.
        selection = Job.objects.filter(pk__in=queryset.values("pk"))

        def log(before: dict[Any, Job], after: dict[Any, Job]) -> None:
            changed = [
                job
                for pk, job in before.items()
                if pk not in after or _watched(after[pk]) != _watched(job)
            ]
            self._log(request, changed, done, after)

        total, before, changed, after = _acted(selection, eligible, verb, no_key=no_key, log=log)
        total = max(total, _picked(request))
        # Eligible jobs the verb left alone for a reason of its own (a held unique key, a
        # project's row), counted apart from the ineligible ones.
        held = len(before) - changed if held_because else 0
        message = f"{changed} of {total} {done}"
        skipped = total - changed - held
        if skipped > 0:
            message += "; " + ngettext("%(n)d was %(why)s", "%(n)d were %(why)s", skipped) % {
                "n": skipped,
                "why": not_eligible,
            }
        if held > 0:
            message += "; " + ngettext(*_HELD[held_because], held) % {"n": held}
        self.message_user(
            request, message + ".", messages.SUCCESS if skipped + held <= 0 else messages.WARNING
        )

    def _log(
        self, request: HttpRequest, changed: list[Job], done: str, after: dict[Any, Job]
    ) -> None:
        """One admin log entry per job the action changed (deletion for a purged one). A
        changed job is named as the action left it ("#5 (cancelled)"), as Django logs an
        object after its save; its task path is the one read before (not read again)."""
        message = f"{done.capitalize()} by the admin action."
        as_left = []
        for job in changed:
            if job.pk in after:
                after[job.pk].task_path = job.task_path
                as_left.append(after[job.pk])
        log_changed(request, as_left, message)
        log_deleted(request, [j for j in changed if j.pk not in after], message)

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
        across = request.POST.get("select_across", "0")
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
                "total": max(queryset.count(), _picked(request)),
                # Across every page the filter in the URL is the selection, acted on again
                # at post=yes: one id is carried, as Django asks for one to act, not every
                # one (a page of a million ids; DATA_UPLOAD_MAX_NUMBER_FIELDS refuses more
                # than 1,000 fields).
                # Not across: every id ticked, those that left the list's filter since
                # included, so that the answer counts them as left alone (_picked()).
                "selected": request.POST.getlist(ACTION_CHECKBOX_NAME)[:1]
                if across == "1"
                else request.POST.getlist(ACTION_CHECKBOX_NAME),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "select_across": across,
                "back": request.get_full_path(),
            },
        )

    @admin.action(
        description=_("Retry now: make selected pending jobs due"), permissions=["change"]
    )
    def retry_now(self, request: HttpRequest, queryset: JobQuerySet) -> None:
        self._act(
            request,
            queryset,
            lambda qs: qs.retry_now_candidates(),
            lambda qs: qs.retry_now(),
            "made due now",
            "not pending",
            no_key=True,
        )

    @admin.action(description=_("Requeue selected dead or cancelled jobs"), permissions=["change"])
    def requeue(self, request: HttpRequest, queryset: JobQuerySet) -> None:
        self._act(
            request,
            queryset,
            lambda qs: qs.requeue_candidates(),
            lambda qs: qs.requeue(),
            "requeued",
            "no longer dead or cancelled",
            held_because="requeue",
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
            request,
            queryset,
            lambda qs: qs.cancel_candidates(),
            lambda qs: qs.cancel(),
            "cancelled",
            "no longer pending or claimed",
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
            # Claimed ones: the verb's own UPDATE re-checks which are stalled.
            lambda qs: qs.expire_now_candidates(),
            lambda qs: qs.expire_stalled_now(period),
            "expired",
            "not stalled claims",
            no_key=True,
        )
        return None

    def has_purge_permission(self, request: HttpRequest) -> bool:
        """Purge deletes: the job model's change and delete permissions, as Django's own
        "Delete selected" asks for the delete one (the admin deletes no job otherwise)."""
        from django.contrib.auth import get_permission_codename

        codename = get_permission_codename("delete", self.opts)
        return self.has_change_permission(request) and request.user.has_perm(
            f"{self.opts.app_label}.{codename}"
        )

    @admin.action(
        description=_("Purge selected finished jobs (succeeded or cancelled)"),
        permissions=["purge"],
    )
    def purge_finished(self, request: HttpRequest, queryset: JobQuerySet) -> Any:
        finished = Job.objects.filter(pk__in=queryset.values("pk")).purge_finished_candidates()
        if finished[: PURGE_LIMIT + 1].count() > PURGE_LIMIT:
            # Refused before asking: 180,000 took 100 s in one request, every row locked,
            # past any proxy's timeout (a 502, and nothing purged).
            self.message_user(
                request,
                f"More than {PURGE_LIMIT:,} finished jobs selected: the admin purges at most "
                f"{PURGE_LIMIT:,} in one request. Narrow the selection (a queue, a task, a "
                "state), or let manage.py leases_prune delete finished jobs past the "
                "retention in short batches.",
                messages.ERROR,
            )
            return None
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
            lambda qs: qs.purge_finished_candidates(),
            lambda qs: qs.purge_finished(),
            "purged",
            "not succeeded or cancelled",
            held_because="purge",
        )
        return None
