"""Periodic jobs declared in code: what a schedule says, checked, and its tick arithmetic.

Pure Python, no database: the tick verbs (``schedule_query.py``) hand ``plan()`` the
database's own now, so that which ticks are due never depends on a worker's clock.

Cron expressions are read by cronsim (small, no dependencies, kept by the author of
Healthchecks.io, who runs it on millions of checks): in a time zone with daylight saving,
a tick in the skipped hour (02:30 on the spring-forward night) fires once at the first
instant after the gap (03:00), and a daily tick in the repeated hour fires once, at its
first occurrence; an expression that fires every few minutes fires in both passes of the
repeated hour, since real time goes on. That is Debian cron's behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .exceptions import InvalidJobArgument, InvalidLeaseOption, InvalidSchedule
from .jsonsafe import shown

MISFIRE_POLICIES = ("once", "each", "skip")
OVERLAP_POLICIES = ("allow", "skip")
NAME_LENGTH = 200
# The shortest interval: a tick is decided at a worker's look, about once a second.
MIN_EVERY_SECONDS = 1.0
MAX_EVERY_SECONDS = 366 * 86400.0
# "each" runs at most this many missed ticks; one decision looks at most this many ticks.
MAX_MISFIRE_LIMIT = 1000
MAX_TICKS_SCANNED = 10_000
DEFAULT_GRACE_SECONDS = 60.0
# The least default grace: a tick is decided at a worker's look (at each poll, once a second
# by default, plus the decision's own statements), so a healthy fleet decides a 1 s tick
# up to about a second late; a grace of one interval counted such ticks as missed.
MIN_DEFAULT_GRACE_SECONDS = 5.0
# The least grace given: a tick is decided after its time, at a worker's look (every half
# a grace at most, worker/ticker.py); a grace of 0 counted every tick as missed.
MIN_GRACE_SECONDS = 1.0


@dataclass(frozen=True, kw_only=True)
class Periodic:
    """When a task runs by itself, and with what: ``@task(schedule=Periodic(...))`` on
    Django 6.1, or ``OPTIONS["SCHEDULES"]`` (the same fields plus ``task``) on 6.0.

    - ``cron`` (five fields, in ``timezone``) or ``every`` (seconds), not both;
    - ``args``, ``kwargs``: the call each tick makes (JSON values);
    - ``misfire``: ticks later than ``grace`` seconds (workers down) are "missed";
      ``"once"`` runs one job for all of them, ``"each"`` runs the last ``misfire_limit``
      of them, ``"skip"`` runs none; a tick on time always runs;
    - ``overlap``: ``"skip"`` records a tick as skipped while the previous tick's job is
      still pending or claimed; ``"allow"`` enqueues it anyway;
    - ``name``: the schedule's key in the database (default: the task's dotted path).
    """

    cron: str | None = None
    every: float | None = None
    timezone: str = "UTC"
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    misfire: str = "once"
    misfire_limit: int = 1
    grace: float | None = None
    overlap: str = "allow"
    name: str | None = None

    def __post_init__(self) -> None:
        check_periodic(self)

    def to_json(self) -> dict[str, Any]:
        """The canonical stored form: what a schedule's row keeps and compares at sync.
        The arguments as JSON gives them back (a tuple as a list, as Django's TaskResult
        normalizes them): compared with the row as declared, a tuple made the schedule
        "changed", re-planned from now, at every worker's start."""
        from .enqueue_options import checked_arguments

        args, kwargs = checked_arguments(list(self.args), dict(self.kwargs), as_django_stores=True)
        return {
            "cron": self.cron,
            "every": None if self.every is None else float(self.every),
            "timezone": self.timezone,
            "args": args,
            "kwargs": kwargs,
            "misfire": self.misfire,
            "misfire_limit": self.misfire_limit,
            "grace": None if self.grace is None else float(self.grace),
            "overlap": self.overlap,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], name: str | None = None) -> Periodic:
        """A Periodic from a dict (the settings form or a stored row); unknown keys are an
        InvalidSchedule naming them."""
        if not isinstance(data, Mapping):
            raise InvalidSchedule("schedule", f"must be a dict, got {shown(data)}")
        known = {"cron", "every", "timezone", "args", "kwargs", "misfire", "misfire_limit"}
        known |= {"grace", "overlap", "name"}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidSchedule(unknown[0], f"is not a schedule field; use {sorted(known)}")
        values = dict(data)
        if name is not None:
            values.setdefault("name", name)
        return cls(**values)

    @property
    def grace_seconds(self) -> float:
        """How late a tick may be decided and still count as on time."""
        if self.grace is not None:
            return float(self.grace)
        if self.every is not None:
            return max(min(DEFAULT_GRACE_SECONDS, float(self.every)), MIN_DEFAULT_GRACE_SECONDS)
        return DEFAULT_GRACE_SECONDS

    def describe(self) -> str:
        if self.every is not None:
            return f"every {self.every:g} s"
        return f"cron {self.cron} ({self.timezone})"

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment`` (aware), in UTC."""
        if self.every is not None:
            return (moment + timedelta(seconds=self.every)).astimezone(UTC)
        assert self.cron is not None
        local = moment.astimezone(ZoneInfo(self.timezone))
        return next(iter(CronSim(self.cron, local))).astimezone(UTC)

    def latest_until(self, moment: datetime) -> datetime:
        """The last cron tick at or before ``moment`` (cron schedules only)."""
        assert self.cron is not None
        local = moment.astimezone(ZoneInfo(self.timezone))
        return next(
            iter(CronSim(self.cron, local + timedelta(seconds=1), reverse=True))
        ).astimezone(UTC)


def _fail(name: str, reason: str) -> None:
    raise InvalidSchedule(name, reason)


def _fail_unstorable(name: str, value: str) -> None:
    """Refuse a name the schedule table cannot hold (a NUL on PostgreSQL, a lone
    surrogate anywhere): a worker's sync would fail at every poll, and no schedule of the
    backend would tick."""
    from .enqueue_options import checked_text

    try:
        checked_text(name, value, NAME_LENGTH)
    except InvalidLeaseOption as e:
        _fail(name, e.reason)


def _seconds(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(name, f"must be a number of seconds, got {shown(value)}")
    if not (low <= value <= high) or math.isnan(value):
        _fail(
            name, f"must be between {_amount(low)} and {_amount(high)} seconds, got {shown(value)}"
        )


def _amount(seconds: float) -> str:
    """Seconds as people write them: 31,622,400 (366 days), not 3.16224e+07."""
    if float(seconds).is_integer():
        whole = int(seconds)
        days = f" ({whole // 86400:,} days)" if whole >= 86400 and whole % 86400 == 0 else ""
        return f"{whole:,}{days}"
    return f"{seconds:g}"


def check_periodic(p: Periodic) -> None:
    """Raise InvalidSchedule naming the first field that cannot work."""
    if (p.cron is None) == (p.every is None):
        _fail("cron", "give either cron (an expression) or every (seconds), not both or neither")
    if p.cron is not None:
        if not isinstance(p.cron, str) or not p.cron.strip() or len(p.cron) > NAME_LENGTH:
            _fail("cron", f"must be a cron expression of five fields, got {shown(p.cron)}")
        if len(p.cron.split()) != 5:
            _fail("cron", f"must have five fields (minute hour day month weekday): {p.cron!r}")
    if p.every is not None:
        _seconds("every", p.every, MIN_EVERY_SECONDS, MAX_EVERY_SECONDS)
    if not isinstance(p.timezone, str) or not p.timezone or len(p.timezone) > 100:
        _fail("timezone", f"must be an IANA time zone name, got {shown(p.timezone)}")
    if p.timezone.lower() == "localtime":
        # /etc/localtime, read by zoneinfo: each host's own zone, so workers on hosts set
        # differently would tick the same schedule at different hours.
        _fail("timezone", "'localtime' is each host's own zone: give an IANA name")
    try:
        zone = ZoneInfo(p.timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        _fail("timezone", f"is not a known time zone: {p.timezone!r}")
    if p.cron is not None:
        try:
            # The expression is read, and one tick found, up front: an expression that
            # never fires (30 February) is refused here rather than by a worker.
            next(iter(CronSim(p.cron, datetime(2000, 1, 1, tzinfo=zone))))
        except (CronSimError, StopIteration, ValueError, IndexError) as e:
            _fail("cron", f"is not a cron expression cronsim can read: {p.cron!r} ({e})")
    if p.misfire not in MISFIRE_POLICIES:
        _fail("misfire", f"must be one of {list(MISFIRE_POLICIES)}, got {shown(p.misfire)}")
    if (
        isinstance(p.misfire_limit, bool)
        or not isinstance(p.misfire_limit, int)
        or not 1 <= p.misfire_limit <= MAX_MISFIRE_LIMIT
    ):
        _fail(
            "misfire_limit",
            f"must be a whole number from 1 to {MAX_MISFIRE_LIMIT}, got {shown(p.misfire_limit)}",
        )
    if p.grace is not None:
        _seconds("grace", p.grace, MIN_GRACE_SECONDS, MAX_EVERY_SECONDS)
    if p.overlap not in OVERLAP_POLICIES:
        _fail("overlap", f"must be one of {list(OVERLAP_POLICIES)}, got {shown(p.overlap)}")
    if p.name is not None and (
        not isinstance(p.name, str) or not p.name.strip() or len(p.name) > NAME_LENGTH
    ):
        _fail("name", f"must be a non-empty string of at most {NAME_LENGTH} characters")
    if p.name is not None:
        _fail_unstorable("name", p.name)
    if isinstance(p.args, str | bytes) or not isinstance(p.args, Sequence):
        _fail("args", f"must be a list, got {shown(p.args)}")
    if not isinstance(p.kwargs, Mapping):
        _fail("kwargs", f"must be a dict, got {shown(p.kwargs)}")
    from .enqueue_options import checked_arguments

    try:
        checked_arguments(list(p.args), dict(p.kwargs))
    except InvalidJobArgument as e:
        _fail(e.path, e.reason)


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule a backend declares: its name, the task it calls and when."""

    name: str
    task_path: str
    periodic: Periodic

    def to_json(self) -> dict[str, Any]:
        return self.periodic.to_json()


@dataclass(frozen=True)
class Plan:
    """What one decision does: the ticks that get a job, how many were missed, and where
    the schedule stands afterwards."""

    run: list[datetime]
    due: int
    misfired: int
    latest: datetime
    next: datetime


def plan(p: Periodic, next_tick: datetime, now: datetime) -> Plan:
    """Which of the ticks from ``next_tick`` up to ``now`` (the database's now) get a job.

    Ticks decided within ``grace`` of their time are on time and each runs; older ones are
    missed, and the misfire policy says which of them run (the newest ones). Long outages
    are not walked tick by tick: an interval schedule's ticks are counted exactly; a cron
    schedule walks at most MAX_TICKS_SCANNED ticks from each end of the outage and
    estimates the ones between from their spacing."""
    due: list[datetime] = []
    skipped_uncounted = 0
    if p.every is not None:
        step = timedelta(seconds=p.every)
        count = int((now - next_tick) / step) + 1
        if count > MAX_TICKS_SCANNED:
            skipped_uncounted = count - MAX_TICKS_SCANNED
            first = next_tick + step * skipped_uncounted
        else:
            first = next_tick
        due = [first + step * i for i in range(min(count, MAX_TICKS_SCANNED))]
    else:
        tick = next_tick
        while tick <= now and len(due) < MAX_TICKS_SCANNED:
            due.append(tick)
            tick = p.next_after(tick)
        if tick <= now:
            # More than the scan: the newest ticks are walked back from now (they are the
            # ones "each" runs), and the ticks between the two walks are counted from
            # the walked ticks' spacing (an estimate, exact for evenly spaced crons).
            newest = _ticks_back(p, now, after=due[-1])
            if newest:
                walked = (due[-1] - due[0]) + (newest[-1] - newest[0])
                spacing = walked / (len(due) - 1 + len(newest) - 1)
                gap = newest[0] - due[-1]
                skipped_uncounted = max(round(gap / spacing) - 1, 0) if spacing else 0
                due.extend(newest)
    grace = timedelta(seconds=p.grace_seconds)
    on_time = [t for t in due if now - t <= grace]
    missed = due[: len(due) - len(on_time)]
    if p.misfire == "each":
        kept = missed[-p.misfire_limit :]
    elif p.misfire == "once" and missed and not on_time:
        kept = missed[-1:]
    else:
        kept = []
    latest = due[-1]
    return Plan(
        run=kept + on_time,
        due=len(due) + skipped_uncounted,
        misfired=len(missed) - len(kept) + skipped_uncounted,
        latest=latest,
        next=p.next_after(latest),
    )


def _ticks_back(p: Periodic, now: datetime, after: datetime) -> list[datetime]:
    """The newest cron ticks at or before ``now`` and after ``after``, at most
    MAX_TICKS_SCANNED of them, oldest first."""
    assert p.cron is not None
    zone = ZoneInfo(p.timezone)
    start = now.astimezone(zone) + timedelta(seconds=1)
    back: list[datetime] = []
    for local in CronSim(p.cron, start, reverse=True):
        tick = local.astimezone(UTC)
        if tick <= after or len(back) >= MAX_TICKS_SCANNED:
            break
        back.append(tick)
    return back[::-1]


def first_tick(p: Periodic, now: datetime) -> datetime:
    """Where a new (or resumed, or changed) schedule starts: its first tick after now."""
    return p.next_after(now)


def declared_schedules(alias: str, listed: Any = None) -> list[ScheduleSpec]:
    """The schedules backend ``alias`` declares: each declared task's ``schedule`` option,
    then ``OPTIONS["SCHEDULES"]`` (or ``listed``, for the system check). Raise
    InvalidSchedule naming the schedule and field."""
    from django.conf import settings

    from . import registry

    registry.discover()
    specs: dict[str, ScheduleSpec] = {}

    def add(spec: ScheduleSpec, where: str) -> None:
        if spec.name in specs:
            raise InvalidSchedule(f"{where}.name", "is declared twice")
        specs[spec.name] = spec

    for task in registry.declared_tasks(alias):
        option = registry.own_schedule(alias, task)
        if option is None:
            continue
        for p in option if isinstance(option, list | tuple) else [option]:
            name = p.name or task.module_path
            if (why := call_misfit(task, p)) is not None:
                raise InvalidSchedule(f"{name}.args/kwargs", why)
            add(ScheduleSpec(name, task.module_path, p), name)
    if listed is None:
        listed = (settings.TASKS[alias].get("OPTIONS") or {}).get("SCHEDULES") or {}
    for name, spec in listed_schedules(alias, listed).items():
        add(spec, f"SCHEDULES[{name!r}]")
    if specs and not settings.USE_TZ:
        # Ticks are UTC instants; naive datetime columns would store them shifted.
        raise InvalidSchedule("USE_TZ", "periodic schedules need USE_TZ = True")
    return list(specs.values())


def listed_schedules(alias: str, listed: Any) -> dict[str, ScheduleSpec]:
    """``OPTIONS["SCHEDULES"]`` of backend ``alias`` read (checked_settings()), each naming
    a task declared for it whose function takes the schedule's call. Raise InvalidSchedule
    naming the schedule and field."""
    from . import registry

    specs = checked_settings(listed)
    for name, spec in specs.items():
        listed_task = registry.lookup(alias, spec.task_path)
        if listed_task is None:
            raise InvalidSchedule(
                f"SCHEDULES[{name!r}].task",
                f"{spec.task_path!r} is not a task declared for backend {alias!r}",
            )
        if (why := call_misfit(listed_task, spec.periodic)) is not None:
            raise InvalidSchedule(f"SCHEDULES[{name!r}].args/kwargs", why)
    return specs


def call_misfit(task: Any, p: Periodic) -> str | None:
    """Why ``task``'s function cannot take the call each tick of ``p`` makes (as enqueue()
    would refuse it, and the worker end each tick's job dead), or None."""
    from .fits import task_misfit

    return task_misfit(task, list(p.args), dict(p.kwargs))


def declared_names(alias: str, listed: Any = None) -> set[str]:
    """The names of the schedules backend ``alias`` declares; none where they cannot be
    read (an unknown alias, E020, a broken tasks module: each is reported where it
    matters)."""
    try:
        return {spec.name for spec in declared_schedules(alias, listed)}
    except Exception:  # noqa: BLE001 -- the declaration's own check or the worker says why
        return set()


def checked_settings(listed: Any) -> dict[str, ScheduleSpec]:
    """``OPTIONS["SCHEDULES"]`` read: ``{name: {"task": path, "cron"|"every": ..., ...}}``.
    Raise InvalidSchedule naming ``SCHEDULES[name].field``."""
    if not isinstance(listed, Mapping):
        raise InvalidSchedule("SCHEDULES", f"must be a dict of name: schedule, got {shown(listed)}")
    specs: dict[str, ScheduleSpec] = {}
    for name, entry in listed.items():
        where = f"SCHEDULES[{name!r}]"
        if not isinstance(name, str) or not name.strip() or len(name) > NAME_LENGTH:
            raise InvalidSchedule(where, "a schedule's name must be a non-empty short string")
        _fail_unstorable(where, name)
        if not isinstance(entry, Mapping):
            raise InvalidSchedule(where, f"must be a dict, got {shown(entry)}")
        values = dict(entry)
        task_path = values.pop("task", None)
        if not isinstance(task_path, str) or not task_path:
            raise InvalidSchedule(f"{where}.task", "must be the dotted path of a task")
        if "name" in values and values["name"] != name:
            # The entry's key names it: another name here was silently dropped.
            raise InvalidSchedule(
                f"{where}.name",
                f"is {shown(values['name'])}, but the key names this schedule; leave it out",
            )
        try:
            periodic = Periodic.from_json({**values, "name": name})
        except InvalidSchedule as e:
            raise InvalidSchedule(f"{where}.{e.field}", e.reason) from None
        except TypeError as e:
            raise InvalidSchedule(where, str(e)) from None
        specs[name] = ScheduleSpec(name, task_path, periodic)
    return specs
