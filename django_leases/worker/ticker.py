"""Periodic schedules from the worker's side: synced at start, due ticks enqueued from the
main loop about once per poll interval, or every half of the shortest grace if sooner.

Every worker does this; the schedule's row decides which one makes each tick's job
(Schedule.objects verbs, schedule_query.py). The worker's own clock only paces the
looking; whether a tick is due is the database's answer.
"""

from __future__ import annotations

import time
from typing import Any

from .. import registry
from ..safe_logging import WorkerLogger
from ..schedules import declared_names, declared_schedules
from ..storable import first_line
from .dberrors import DB_ERRORS
from .repeats import Trouble

logger = WorkerLogger()

# After trouble that is not the database's (a declaration that cannot work), the next look
# waits this many ``every`` intervals: the warning is not repeated every poll.
TROUBLE_BACKOFF = 10
# A look is due once this share of ``every`` has passed: the loop's jittered poll wait
# (0.9 to 1.1 of it) skipped every look that came a little early, and so every other one.
ON_TIME = 0.9


class Ticker:
    """Sync the backend's schedules once, then enqueue due ticks about every ``every``
    seconds (from ON_TIME of it on): the poll interval, or half the shortest grace of the
    declared schedules if less (a worker run with --poll 10 decided a 2 s tick up to 20 s
    late, past its 5 s grace: missed while the worker was up). When less, the main loop's
    waits look at the schedules whenever due_in() says (looks_between_polls)."""

    def __init__(self, alias: str, database: str, worker_id: str, every: float) -> None:
        from ..models import Schedule

        self.Schedule = Schedule
        self.alias, self.database, self.worker_id = alias, database, worker_id
        self.poll = self.every = every
        self._last = float("-inf")
        self._synced = False
        self._declares = True
        self._unrunnable: set[str] = set()
        self._unreadable: set[str] = set()
        self.failing = Trouble("schedules_trouble", worker_id)
        # Per schedule whose decision raised: told as a trouble, not at every poll.
        self._decisions_failing: dict[str, Trouble] = {}

    def sync(self) -> None:
        """Make the schedule rows say what this code declares, and log what changed. A
        declaration that cannot work raises (InvalidSchedule): the worker does not start."""
        specs = declared_schedules(self.alias)
        report = self.Schedule.objects.using(self.database).sync(self.alias, specs)
        self._synced = True
        # None declared: nothing of this backend's to tick (the sync marked any rows it
        # had removed), so a look sends no statement, nor says "not ticked" in an outage.
        self._declares = bool(specs)
        self.every = min([self.poll, *(spec.periodic.grace_seconds / 2 for spec in specs)])
        if specs or report.removed:
            logger.info(
                "Schedules synced worker=%s added=%s changed=%s removed=%s unchanged=%d taken=%s",
                self.worker_id,
                ",".join(report.added) or "-",
                ",".join(report.changed) or "-",
                ",".join(report.removed) or "-",
                len(report.unchanged),
                ",".join(f"{name}<-{other}" for name, other in sorted(report.taken.items())) or "-",
                extra={
                    "event": "schedules_synced",
                    "worker": self.worker_id,
                    "added": report.added,
                    "changed": report.changed,
                    "removed": report.removed,
                    "unchanged": len(report.unchanged),
                    "taken": report.taken,
                },
            )
        for name, other in sorted(report.taken.items()):
            if name in declared_names(other):
                # Check E021's case, met by a worker started with --skip-checks (or by
                # backends the check did not see): the row moves at every start.
                logger.warning(
                    "Schedule taken from another backend that declares it too schedule=%s "
                    "from=%s worker=%s: the backends of one database share a schedule's "
                    "row, so each one's workers take it at their start and only the last "
                    "one's ticks; give one of them its own name (check django_leases.E021)",
                    name,
                    other,
                    self.worker_id,
                    extra={
                        "event": "schedule_contested",
                        "worker": self.worker_id,
                        "schedule": name,
                        "backend": other,
                    },
                )

    @property
    def looks_between_polls(self) -> bool:
        """Whether a look is due more often than the poll interval."""
        return self.every < self.poll

    def due_in(self) -> float:
        """Seconds until the next look is due (0: now)."""
        return max(0.0, self._last + self.every * ON_TIME - time.monotonic())

    def maybe_tick(self) -> None:
        """Enqueue the due ticks if ON_TIME of ``every`` seconds passed since the last look
        (monotonic); database trouble is logged and left to the next look."""
        now = time.monotonic()
        if now - self._last < self.every * ON_TIME:
            return
        self._last = now
        try:
            if not self._synced:
                self.sync()
            if not self._declares:
                self.failing.over()
                return
            outcomes = self.Schedule.objects.using(self.database).enqueue_due(
                self.alias, self._fields_for, self._left_alone, self._failed, self._decided
            )
        except Exception as e:  # config and task code are untrusted input
            # Database trouble, or a declaration that cannot work (InvalidSchedule, a
            # missing task, USE_TZ...): logged, looked at again after a longer pause; the
            # worker keeps running its jobs.
            if not isinstance(e, DB_ERRORS):
                self._last = now + self.every * (TROUBLE_BACKOFF - 1)
            self.failing.warn(
                "Schedules not ticked worker=%s: %s",
                self.worker_id,
                first_line(e),
                error=first_line(e),
            )
            return
        self.failing.over()
        for outcome in outcomes:
            logger.info(
                "Schedule ticked schedule=%s jobs=%s skipped=%d misfired=%d worker=%s",
                outcome.name,
                ",".join(str(j.pk) for j in outcome.jobs) or "-",
                outcome.skipped,
                outcome.misfired,
                self.worker_id,
                extra={
                    "event": "schedule_ticked",
                    "worker": self.worker_id,
                    "schedule": outcome.name,
                    "jobs": [j.pk for j in outcome.jobs],
                    "skipped": outcome.skipped,
                    "misfired": outcome.misfired,
                },
            )

    def _fields_for(self, schedule: Any) -> Any:
        """The job fields of ``schedule``'s task, as the backend enqueues it; None (the
        schedule left to other workers, said once) when this code cannot enqueue it: a
        worker of another version during a rolling deploy."""
        from django.tasks import task_backends
        from django.tasks.exceptions import InvalidTask

        try:
            task = registry.lookup(self.alias, schedule.task_path)
            if task is None:
                raise InvalidTask(f"no task {schedule.task_path!r} is declared here")
            return task_backends[self.alias].job_fields(task)  # type: ignore[attr-defined]
        except Exception as e:  # InvalidTask, InvalidLeaseOption, ...
            if schedule.name not in self._unrunnable:
                self._unrunnable.add(schedule.name)
                logger.warning(
                    "Schedule left to other workers schedule=%s worker=%s: %s",
                    schedule.name,
                    self.worker_id,
                    e,
                    extra={
                        "event": "schedule_unrunnable",
                        "worker": self.worker_id,
                        "schedule": schedule.name,
                        "error": str(e),
                    },
                )
            return None

    def _decided(self, schedule: Any) -> None:
        """This process decided ``schedule`` (ticks or not): a trouble of its decisions is
        over. One another worker was deciding (skipped here) keeps its trouble, or a
        failure each look and an end each other look would be told by turns."""
        if (trouble := self._decisions_failing.pop(schedule.name, None)) is not None:
            trouble.over()

    def _failed(self, schedule: Any, error: Exception) -> None:
        """One schedule's decision raised (a value its database refuses, a lock wait): it
        was rolled back alone, the other schedules were still decided. Told when it
        starts, then once a minute (it stays due, so each look tries it again)."""
        name = schedule.name
        if name not in self._decisions_failing:
            self._decisions_failing[name] = Trouble(
                "schedule_failed", self.worker_id, schedule=name
            )
        said = first_line(error)
        self._decisions_failing[name].warn(
            "Schedule not decided schedule=%s worker=%s: %s",
            name,
            self.worker_id,
            said,
            error=said,
        )

    def _left_alone(self, schedule: Any, error: Exception) -> None:
        """Said once per schedule: its stored spec does not read in this version (a row a
        newer version wrote, a time zone this machine lacks); the others still tick."""
        if schedule.name not in self._unreadable:
            self._unreadable.add(schedule.name)
            logger.warning(
                "Schedule left alone schedule=%s worker=%s: its stored schedule reads %s",
                schedule.name,
                self.worker_id,
                error,
                extra={
                    "event": "schedule_unreadable",
                    "worker": self.worker_id,
                    "schedule": schedule.name,
                    "error": str(error),
                },
            )
