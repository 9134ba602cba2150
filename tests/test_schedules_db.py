"""The schedule verbs on a real database (schedule_query.py): sync, the tick decision,
misfires, overlap, pause, resume and run-now. Time passing is a row moved back on the
database's own clock, never a sleep."""

from __future__ import annotations

import threading
from datetime import timedelta

import django
import pytest
from django.db import connection
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings

from django_leases.enqueue_options import EnqueueOptions
from django_leases.models import Job, Schedule, ScheduleRun
from django_leases.schedules import Periodic, ScheduleSpec, declared_schedules
from django_leases.states import JobState
from tests.worker_helpers import held_open

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "tests.testapp.tasks.add"


def fields_for(schedule):
    return EnqueueOptions.of({}).check(schedule.task_path)


def spec(name="s", **kw):
    kw.setdefault("every", 60)
    kw.setdefault("args", [1, 2])
    return ScheduleSpec(name, TASK, Periodic(**kw))


def due():
    return list(Schedule.objects.due("default"))


def started(name="s", **kw):
    """A synced schedule whose first tick is planned (the first decision)."""
    Schedule.objects.sync("default", [spec(name, **kw)])
    Schedule.objects.enqueue_due("default", fields_for)
    return Schedule.objects.get(name=name)


def back(name, seconds):
    """Move the schedule's next tick ``seconds`` before the database's now."""
    Schedule.objects.filter(name=name).update(
        next_tick_at=Now() - timedelta(seconds=seconds), revision=F("revision") + 1
    )


def test_workers_starting_together_each_sync_without_a_duplicate_key_error():
    """Invariant 3: two workers' first syncs at once. One's locking read finds no row
    (nothing to lock yet) while the other's insert is uncommitted; its own insert then
    waited for that commit and failed on the unique name, and the worker logged the
    IntegrityError as "Schedules not ticked". It reads again and finds the row; one row.
    (On MariaDB the locking read itself waits for the uncommitted row and then reads it.)"""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's IMMEDIATE transactions take turns: the second reads the row")
    outcome = []

    def second_worker():
        try:
            outcome.append(Schedule.objects.sync("default", [spec("s", every=120)]))
        except Exception as e:  # noqa: BLE001 -- the failure this test is about
            outcome.append(e)
        finally:
            connection.close()

    first = {"name": "s", "backend": "default", "task_path": TASK, "spec": spec("s").to_json()}
    with held_open(lambda: Schedule.objects.create(**first)) as held:
        second = threading.Thread(target=second_worker)
        second.start()
        # Its insert reached the first one's uncommitted row: without this wait the test
        # could pass with no race at all.
        assert held.until_it_blocks_another(), "the second sync never waited: no race"
    second.join(30)
    [report] = outcome
    assert not isinstance(report, Exception), report
    assert (report.added, report.changed) == ([], ["s"])
    assert list(Schedule.objects.values_list("name", flat=True)) == ["s"]
    assert Schedule.objects.get(name="s").spec["every"] == 120


def test_every_decision_this_process_made_is_told_even_one_that_only_planned():
    """The worker ends a schedule's trouble (schedule_failed) when it decides it; it saw
    only the decisions that made or skipped ticks, so one that only planned the next tick
    (the first decision) left the trouble on. Every decision made is told to
    ``decided``; the outcomes returned are still those with ticks."""
    Schedule.objects.sync("default", [spec("s")])
    decided = []
    outcomes = Schedule.objects.enqueue_due("default", fields_for, decided=decided.append)
    assert (outcomes, [row.name for row in decided]) == ([], ["s"])


def test_sync_reports_added_changed_and_removed():
    """Invariant 3: what the code declares is what the table says, and each change is
    reported; a removed schedule keeps its row (and history) but stops ticking."""
    report = Schedule.objects.sync("default", [spec("a"), spec("b")])
    assert (report.added, report.changed, report.removed) == (["a", "b"], [], [])
    report = Schedule.objects.sync("default", [spec("a", every=120), spec("c")])
    assert (report.added, report.changed, report.removed) == (["c"], ["a"], ["b"])
    assert Schedule.objects.get(name="a").spec["every"] == 120
    assert Schedule.objects.get(name="b").removed_at is not None
    assert {s.name for s in due()} == {"a", "c"}
    report = Schedule.objects.sync("default", [spec("a", every=120), spec("b"), spec("c")])
    assert (report.added, report.changed, report.unchanged) == ([], ["b"], ["a", "c"])
    assert Schedule.objects.get(name="b").removed_at is None


def test_arguments_json_gives_back_otherwise_leave_a_schedule_unchanged_at_the_next_sync():
    """Invariant 3: a tuple in a schedule's arguments is stored as a list; compared with
    the row as declared, the schedule read as changed at every worker's start and was
    re-planned from now each time (a daily one restarted daily never ticked)."""
    declared = spec("t", args=[(1, 2)], kwargs={"pair": ("a", "b")})
    assert Schedule.objects.sync("default", [declared]).added == ["t"]
    started_tick = Schedule.objects.get(name="t").next_tick_at
    report = Schedule.objects.sync("default", [declared])
    assert (report.changed, report.unchanged) == ([], ["t"])
    row = Schedule.objects.get(name="t")
    assert (row.spec["args"], row.spec["kwargs"]) == ([[1, 2]], {"pair": ["a", "b"]})
    assert row.next_tick_at == started_tick


def test_the_first_decision_plans_on_the_database_clock():
    """Invariant 1: a new cron schedule's first tick is the next minute after the
    database's now; no job is made for it yet."""
    Schedule.objects.sync("default", [spec("m", every=None, cron="* * * * *")])
    Schedule.objects.enqueue_due("default", fields_for)
    row = Schedule.objects.annotate(db_now=Now()).get(name="m")
    assert row.next_tick_at.second == 0 and row.next_tick_at.microsecond == 0
    assert row.db_now < row.next_tick_at <= row.db_now + timedelta(seconds=60)
    assert Job.objects.count() == 0


def test_a_tick_is_enqueued_only_by_the_decision_whose_update_touched_the_row():
    """Invariant 2: two workers that read the same due row both try; the second one's
    conditional UPDATE touches nothing, and it inserts nothing."""
    started("s")
    back("s", 1)
    first, second = due(), due()
    won = Schedule.objects.decide(first[0], fields_for(first[0]))
    lost = Schedule.objects.decide(second[0], fields_for(second[0]))
    assert won is not None and len(won.jobs) == 1
    assert lost is None
    assert Job.objects.count() == 1
    run = ScheduleRun.objects.get()
    row = Schedule.objects.get(name="s")
    assert (run.kind, run.job_id, row.last_job_id) == ("tick", won.jobs[0].pk, won.jobs[0].pk)
    assert row.last_tick_at == run.tick_at and row.ticks == 1
    job = Job.objects.get()
    assert (job.task_path, job.args) == (TASK, [1, 2])


@pytest.mark.parametrize(
    ("policy", "jobs", "misfires"), [("once", 1, 11), ("each", 3, 9), ("skip", 0, 12)]
)
def test_misfire_policy_decides_ticks_missed_while_no_worker_ran(policy, jobs, misfires):
    """Invariants 1 and 3: twelve ticks missed (the schedule 11.5 minutes behind on the
    database clock, grace 10 s): one job, the last three, or none, and the rest counted."""
    started("s", misfire=policy, misfire_limit=3, grace=10)
    back("s", 690)
    outcomes = Schedule.objects.enqueue_due("default", fields_for)
    assert [len(o.jobs) for o in outcomes] == ([jobs] if jobs else [0])
    row = Schedule.objects.annotate(db_now=Now()).get(name="s")
    assert (Job.objects.count(), row.misfires, row.ticks) == (jobs, misfires, 12)
    assert row.db_now < row.next_tick_at <= row.db_now + timedelta(seconds=60)


def test_overlap_skip_records_the_tick_while_the_previous_job_is_active():
    """Invariant 3: the skipped tick is visible (a skipped run, the counter), and the next
    tick after the job finished enqueues again."""
    started("s", overlap="skip")
    back("s", 1)
    Schedule.objects.enqueue_due("default", fields_for)
    first = Job.objects.get()
    back("s", 1)
    [outcome] = Schedule.objects.enqueue_due("default", fields_for)
    assert (outcome.jobs, outcome.skipped) == ([], 1)
    assert Schedule.objects.get(name="s").skipped == 1
    assert list(ScheduleRun.objects.order_by("id").values_list("kind", flat=True)) == [
        "tick",
        "skipped",
    ]
    Job.objects.filter(pk=first.pk).update(state=JobState.SUCCEEDED)
    back("s", 1)
    Schedule.objects.enqueue_due("default", fields_for)
    assert Job.objects.count() == 2


def test_a_paused_schedule_keeps_its_place_and_resumes_from_now():
    """Invariant 3: paused, it makes nothing; its last tick and job stay; resumed, it is
    planned from the database's now (ticks that fell while paused are not run)."""
    started("s")
    back("s", 1)
    Schedule.objects.enqueue_due("default", fields_for)
    before = Schedule.objects.get(name="s")
    assert Schedule.objects.filter(name="s").pause() == 1
    back("s", 3600)
    assert Schedule.objects.enqueue_due("default", fields_for) == []
    assert Job.objects.count() == 1
    assert Schedule.objects.filter(name="s").resume() == 1
    Schedule.objects.enqueue_due("default", fields_for)
    row = Schedule.objects.annotate(db_now=Now()).get(name="s")
    assert (row.last_tick_at, row.last_job_id, row.misfires) == (
        before.last_tick_at,
        before.last_job_id,
        0,
    )
    assert row.next_tick_at > row.db_now and Job.objects.count() == 1


def test_run_now_makes_a_job_that_is_not_a_tick():
    """Invariant 3: a run-now job links back to its schedule; ticks and the next tick are
    untouched."""
    row = started("s")
    job = Schedule.objects.run_now(row, fields_for(row))
    after = Schedule.objects.get(name="s")
    assert (after.ticks, after.last_tick_at, after.next_tick_at) == (0, None, row.next_tick_at)
    assert job.schedule_run.kind == "run_now" and job.schedule_run.schedule == row


def test_run_now_needs_only_the_schedule():
    """Invariant 6: ``run_now(schedule)``, as docs/periodic.md shows it, enqueues with what
    the task's backend gives its jobs (before, ``fields`` had to be built from a private
    helper of the admin: a dict raised AttributeError)."""
    row = started("s")
    job = Schedule.objects.run_now(row)
    assert (job.task_path, job.args, job.queue_name) == (TASK, [1, 2], "default")
    assert job.schedule_run.kind == "run_now"
    gone = started("gone")
    Schedule.objects.filter(pk=gone.pk).update(task_path="tests.testapp.tasks.not_declared")
    with pytest.raises(LookupError, match="not_declared"):
        Schedule.objects.run_now(Schedule.objects.get(pk=gone.pk))
    # Its name instead of the row: AttributeError on 'removed_at' before.
    with pytest.raises(TypeError, match=r"^schedule: must be a Schedule row .* got 's'"):
        Schedule.objects.run_now("s")


def test_a_removed_schedule_stops_ticking():
    """Invariant 3: removed from code, it is never due again."""
    started("s")
    back("s", 120)
    Schedule.objects.sync("default", [])
    assert Schedule.objects.enqueue_due("default", fields_for) == []
    assert Job.objects.count() == 0


def test_the_settings_form_declares_schedules():
    """Invariant 6: OPTIONS["SCHEDULES"] of a declared task is read; a task no worker knows
    is refused naming the schedule's task."""
    from django.conf import settings

    tasks = {**settings.TASKS}
    tasks["default"] = {
        **tasks["default"],
        "OPTIONS": {"SCHEDULES": {"tick": {"task": TASK, "every": 5, "args": [1, 1]}}},
    }
    with override_settings(TASKS=tasks):
        [found] = [s for s in declared_schedules("default") if s.name == "tick"]
        assert (found.task_path, found.periodic.every) == (TASK, 5)
    tasks["default"]["OPTIONS"]["SCHEDULES"]["tick"]["task"] = "tests.testapp.tasks.nope"
    with override_settings(TASKS=tasks), pytest.raises(Exception, match=r"SCHEDULES\['tick'\]"):
        declared_schedules("default")


@pytest.mark.parametrize(
    "twin",
    ["Report", "report ", "r\u00e9port", "\U0001f600"],
    ids=["case", "trailing space", "accent", "beyond the BMP"],
)
def test_schedule_names_that_differ_in_any_character_are_schedules_of_their_own(twin):
    """Invariant 3: MariaDB's default collation compares names without case, accents and
    trailing spaces, and takes any two characters beyond the Basic Multilingual Plane as
    one: "\U0001f600" and "\U0001f389" passed the check, then every sync broke the unique
    name and no schedule of the backend ticked. Names compare as spelled on every
    database (migration 0009): each is a row of its own, synced with the others."""
    from django.conf import settings

    other = "\U0001f389" if twin == "\U0001f600" else "report"
    entry = {"task": TASK, "every": 5, "args": [1, 1]}
    tasks = {**settings.TASKS}
    tasks["default"] = {
        **tasks["default"],
        "OPTIONS": {"SCHEDULES": {other: entry, twin: entry, "tidy": entry}},
    }
    with override_settings(TASKS=tasks):
        report = Schedule.objects.sync("default", declared_schedules("default"))
    assert sorted(report.added) == sorted([other, twin, "tidy"])
    assert Schedule.objects.get(name=twin).name == twin
    assert Schedule.objects.get(name=other).name == other


def test_a_schedule_renamed_in_case_alone_is_a_new_one_on_every_database():
    """Invariant 3: "report" renamed "Report" is a new schedule and the old one is removed,
    on MariaDB too (its default collation found the old row under the new spelling)."""
    Schedule.objects.sync("default", [spec("report"), spec("other")])
    report = Schedule.objects.sync("default", [spec("Report"), spec("other")])
    assert report.unchanged == ["other"]
    assert set(Schedule.objects.filter(removed_at__isnull=True).values_list("name", flat=True)) == {
        "Report",
        "other",
    }
    assert (report.added, report.changed, report.removed) == (["Report"], [], ["report"])


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(schedule=...) needs Django 6.1")
def test_the_task_option_declares_schedules():
    """Invariant 6: @task(schedule=...) declares one schedule per Periodic, named by the
    Periodic or the task's path."""
    import tests.testapp.periodic  # noqa: F401

    found = {s.name: s for s in declared_schedules("default")}
    assert found["tests.every-minute"].task_path == "tests.testapp.periodic.scheduled_add"
    assert found["tests.nightly"].periodic.cron == "30 2 * * *"
    assert found["tests.hourly"].periodic.overlap == "skip"
    report = Schedule.objects.sync("default", list(found.values()))
    assert {"tests.every-minute", "tests.nightly", "tests.hourly"} <= set(report.added)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(schedule=...) needs Django 6.1")
def test_a_copy_sent_to_another_backend_with_using_declares_no_schedule_there():
    """Invariant 4 for schedules: ``housekeeping.using(backend="queue")`` made at import
    (a module sending some calls elsewhere), and any copy of that, carries housekeeping's
    schedules, which are not "queue"'s: its workers do not tick them a second time
    (before: both backends' workers enqueued each tick). The copy is still "queue"'s
    task, and its jobs run there."""
    from django_leases import registry
    from tests.testapp.periodic import housekeeping

    path = "tests.testapp.periodic.housekeeping"
    sent = housekeeping.using(backend="queue", queue_name="bulk")
    assert (sent.backend, sent.schedule) == ("queue", housekeeping.schedule)
    assert sent.using_lease(lease=60).schedule is housekeeping.schedule
    assert registry.runnable("queue", path, "bulk").backend == "queue"
    assert not {"tests.nightly", "tests.hourly"} & {s.name for s in declared_schedules("queue")}
    assert {"tests.nightly", "tests.hourly"} <= {s.name for s in declared_schedules("default")}


def test_only_a_copied_schedule_is_left_to_the_backend_it_was_declared_for(monkeypatch):
    """Invariant 4 for schedules, whatever the order of declarations: a copy carrying the
    schedule of a declaration for another backend, not the first one (a -> b -> copy to
    c), does not tick where it was sent; a declaration of its own, even one made after a
    copy for the same backend, does."""
    from types import SimpleNamespace

    from django_leases import registry

    # The process's declarations restored after this test's made-up ones.
    monkeypatch.setattr(registry, "_declared", {a: dict(t) for a, t in registry._declared.items()})
    monkeypatch.setattr(registry, "_inherited", set(registry._inherited))

    def function():
        pass

    def declared(alias, path, schedule):
        # One function: the declarations of a path are copies of one task (another
        # function at a declared path is refused).
        registry.declare(alias, SimpleNamespace(module_path=path, schedule=schedule, func=function))
        return registry.own_schedule(alias, registry.lookup(alias, path))

    p, q = object(), object()
    assert declared("order-a", "tests.registry.chain", None) is None
    assert declared("order-b", "tests.registry.chain", p) is p
    assert declared("order-c", "tests.registry.chain", p) is None  # b's, copied to c
    assert declared("order-b", "tests.registry.late", p) is p
    assert declared("order-d", "tests.registry.late", p) is None  # a copy, first for d
    assert declared("order-d", "tests.registry.late", q) is q  # d's own, declared after


def test_a_row_taken_from_a_backend_that_declares_it_too_is_warned_of(monkeypatch, caplog):
    """Check E021's case met at run time (a worker started with --skip-checks): two
    backends of one database declaring one name take its row from each other. The worker
    that takes it warns, naming the other backend (before: only "changed" in the synced
    line); moving a schedule to another backend on purpose (the old one no longer declares
    it) is a change like any other, reported as taken, with no warning."""
    from django.conf import settings

    from django_leases import registry
    from django_leases.worker.ticker import Ticker
    from tests.testapp.tasks import add

    monkeypatch.setattr(registry, "_declared", {a: dict(t) for a, t in registry._declared.items()})
    monkeypatch.setattr(registry, "_inherited", set(registry._inherited))
    sweep = {"sweep": {"task": TASK, "every": 60, "args": [1, 2]}}

    def tasks(default, twin):
        default_options = {**settings.TASKS["default"].get("OPTIONS", {}), "SCHEDULES": default}
        return {
            **settings.TASKS,
            "default": {**settings.TASKS["default"], "OPTIONS": default_options},
            "twin": {**settings.TASKS["default"], "OPTIONS": {"SCHEDULES": twin}},
        }

    synced = []

    def contested(alias):
        caplog.clear()
        with caplog.at_level("INFO", logger="django_leases.worker"):
            Ticker(alias, "default", f"w-{alias}", every=0).sync()
        synced[:] = [
            r.taken for r in caplog.records if getattr(r, "event", "") == "schedules_synced"
        ]
        return [
            (r.levelname, r.schedule, r.backend, r.worker)
            for r in caplog.records
            if getattr(r, "event", "") == "schedule_contested"
        ]

    with override_settings(TASKS=tasks(sweep, sweep)):
        add.using(backend="twin")  # declared for twin: its SCHEDULES may name it
        assert contested("default") == []  # a new row
        assert contested("twin") == [("WARNING", "sweep", "default", "w-twin")]
        assert synced == [{"sweep": "default"}]
        assert Schedule.objects.get(name="sweep").backend == "twin"
        assert contested("twin") == []  # its own already
    with override_settings(TASKS=tasks(sweep, {})):  # moved back to default on purpose
        report = Schedule.objects.sync("default", declared_schedules("default"))
        assert report.changed == ["sweep"] and report.taken == {"sweep": "twin"}
        Schedule.objects.filter(name="sweep").update(backend="twin")
        assert contested("default") == []
        assert synced == [{"sweep": "twin"}]  # taken on purpose: in the synced line only
        assert Schedule.objects.get(name="sweep").backend == "default"


def test_the_system_check_names_a_bad_schedule_setting():
    """Invariant 6: manage.py check reports OPTIONS["SCHEDULES"] errors as E020, naming
    the schedule and the field."""
    from django_leases.checks import check_backend

    bad = {"SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * * *", "timezone": "Nowhere"}}}
    [error] = [m for m in check_backend("default", bad) if m.id == "django_leases.E020"]
    assert "SCHEDULES['nightly'].timezone" in error.msg
    good = {"SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * * *", "args": [1, 2]}}}
    assert not [m for m in check_backend("default", good) if m.id == "django_leases.E020"]
    # Every bad entry at once, not the first alone (one more per run of check).
    two = {
        "SCHEDULES": {
            "nightly": {"task": TASK, "cron": "0 3 * * *", "timezone": "Nowhere"},
            "fine": {"task": TASK, "every": 60, "args": [1, 2]},
            "hourly": {"task": TASK, "every": -1},
        }
    }
    errors = [m.msg for m in check_backend("default", two) if m.id == "django_leases.E020"]
    assert len(errors) == 2, errors
    assert "SCHEDULES['nightly'].timezone" in errors[0]
    assert "SCHEDULES['hourly'].every" in errors[1]


def test_a_schedule_whose_call_the_task_cannot_take_is_refused_naming_it():
    """Invariant 6: a schedule's args/kwargs are checked against its task's signature, as
    enqueue() checks a call (before: check passed, and each tick made a job that ended
    dead on InvalidJobArgument, forever). E020 names the schedule and args/kwargs."""
    from django_leases.checks import check_backend

    def errors(entry):
        options = {"SCHEDULES": {"sum": {"task": TASK, "every": 60, **entry}}}
        return [m.msg for m in check_backend("default", options) if m.id == "django_leases.E020"]

    [missing] = errors({})
    assert "SCHEDULES['sum'].args/kwargs: do not fit" in missing and "'a'" in missing
    [extra] = errors({"args": [1, 2, 3]})
    assert "SCHEDULES['sum'].args/kwargs" in extra and "too many" in extra
    [unknown] = errors({"args": [1, 2], "kwargs": {"c": 3}})
    assert "SCHEDULES['sum'].args/kwargs" in unknown and "'c'" in unknown
    assert errors({"args": [1], "kwargs": {"b": 2}}) == []


def _takes_nothing() -> None:
    """A task function of no arguments (module level, as Django's @task needs)."""


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(schedule=...) needs Django 6.1")
def test_a_task_option_schedule_whose_call_the_task_cannot_take_is_refused_when_made(
    monkeypatch,
):
    """Invariant 6: @task(schedule=Periodic(args=...)) whose call its function cannot
    take raises InvalidTask when the task is made (before: it was declared, and each tick
    made a job that ended dead), naming the schedule's args/kwargs; nothing is declared."""
    from django.tasks import task
    from django.tasks.exceptions import InvalidTask

    from django_leases import registry

    # The process's declarations restored after the one this test makes last.
    monkeypatch.setattr(registry, "_declared", {a: dict(t) for a, t in registry._declared.items()})
    monkeypatch.setattr(registry, "_inherited", set(registry._inherited))
    with pytest.raises(InvalidTask, match=r"schedule args/kwargs do not fit .*too many"):
        task(schedule=Periodic(every=60, args=[1, 2, 3]))(_takes_nothing)
    with pytest.raises(InvalidTask, match=r"schedule args/kwargs do not fit"):
        task(schedule=[Periodic(every=60), Periodic(every=30, kwargs={"x": 1}, name="x")])(
            _takes_nothing
        )
    assert registry.lookup("default", f"{__name__}._takes_nothing") is None
    assert task(schedule=Periodic(every=60, name="nothing"))(_takes_nothing).schedule


def test_a_schedule_this_code_cannot_enqueue_is_left_to_other_workers():
    """Invariant 6: a worker of another version (fields_for answers None) decides nothing
    for that schedule and writes nothing; a stored schedule that no longer reads is
    skipped, not fatal, told to the caller (the worker logs it), and the other schedules
    still tick."""
    Schedule.objects.sync("default", [spec("s"), spec("t")])
    Schedule.objects.enqueue_due("default", fields_for)  # both planned
    back("s", 1)
    back("t", 1)
    assert Schedule.objects.enqueue_due("default", lambda row: None) == []
    assert [r.ticks for r in Schedule.objects.order_by("name")] == [0, 0]
    assert len(due()) == 2
    Schedule.objects.filter(name="s").update(spec={"every": 60, "timezone": "Nowhere/Gone"})
    told = []
    [outcome] = Schedule.objects.enqueue_due(
        "default", fields_for, lambda row, error: told.append((row.name, str(error)))
    )
    assert outcome.name == "t" and len(outcome.jobs) == 1
    [(name, error)] = told
    assert name == "s" and "Nowhere/Gone" in error


def test_a_held_unique_key_skips_the_tick():
    """Invariant 3: a task whose unique_key is held (even with on_duplicate="merge") skips
    the tick, recorded as skipped, instead of claiming another call's job as its own."""
    started("s")
    keyed = EnqueueOptions.of({"unique_key": "report", "on_duplicate": "merge"}).check(TASK)
    held = Job.objects.enqueue(TASK, [0, 0], unique_key="report")
    back("s", 1)
    outcome = Schedule.objects.decide(due()[0], keyed)
    assert outcome is not None and (outcome.jobs, outcome.skipped) == ([], 1)
    assert Job.objects.get().pk == held.pk
    assert not ScheduleRun.objects.filter(job=held).exists()


def test_one_failing_schedule_does_not_stall_the_others():
    """Invariant 6: a decision that fails on the database (here a priority no integer
    column holds) rolls back alone; the pass goes on and the other schedule ticks."""
    from dataclasses import replace

    Schedule.objects.sync("default", [spec("s"), spec("t")])
    Schedule.objects.enqueue_due("default", fields_for)
    back("s", 1)
    back("t", 1)

    def bad_for_s(row):
        fields = fields_for(row)
        return replace(fields, priority=2**70) if row.name == "s" else fields

    assert [row.name for row in due()] == ["s", "t"]
    told = []
    [outcome] = Schedule.objects.enqueue_due(
        "default", bad_for_s, failed=lambda row, e: told.append(row.name)
    )
    assert outcome.name == "t" and len(outcome.jobs) == 1
    assert told == ["s"]
    assert Schedule.objects.get(name="s").ticks == 0
    assert not ScheduleRun.objects.filter(schedule__name="s").exists()


def test_run_now_refuses_a_held_unique_key_and_never_links_another_job():
    """Invariant 3: run now on a task whose unique_key is held raises DuplicateJob, even
    with on_duplicate="merge", and writes nothing: no run links a job some other call
    made."""
    from django_leases.exceptions import DuplicateJob

    row = started("s")
    held = Job.objects.enqueue(TASK, [0, 0], unique_key="report")
    for policy in ("merge", "refuse"):
        keyed = EnqueueOptions.of({"unique_key": "report", "on_duplicate": policy}).check(TASK)
        with pytest.raises(DuplicateJob):
            Schedule.objects.run_now(row, keyed)
    assert list(Job.objects.values_list("pk", flat=True)) == [held.pk]
    assert not ScheduleRun.objects.exists()


def test_a_ticker_of_a_backend_without_schedules_sends_no_statement_per_look():
    """Most projects declare no schedule: each worker still read the schedule table at
    every poll, and in an outage its first warning was "Schedules not ticked". After the
    sync at its start (which marks rows of schedules no longer declared removed), a look
    sends nothing."""
    from django.conf import settings
    from django.test.utils import CaptureQueriesContext

    from django_leases.worker.ticker import Ticker

    tasks = {**settings.TASKS, "plain": {"BACKEND": settings.TASKS["default"]["BACKEND"]}}
    Schedule.objects.sync("plain", [spec("gone")])
    ticker = Ticker("plain", "default", "w1", every=0)
    with override_settings(TASKS=tasks):
        ticker.maybe_tick()
        assert Schedule.objects.get(name="gone").removed_at is not None
        with CaptureQueriesContext(connection) as looked:
            ticker.maybe_tick()
    assert looked.captured_queries == []


def test_the_ticker_survives_a_schedule_setting_that_cannot_work(caplog):
    """Invariant 6: SCHEDULES naming a task no code declares makes the ticker log
    schedules_trouble, naming the schedule; nothing escapes into the worker's loop."""
    from django.conf import settings

    from django_leases.worker.ticker import Ticker

    tasks = {**settings.TASKS}
    typo = {"x": {"task": "tests.testapp.tasks.typo", "every": 60}}
    tasks["default"] = {**tasks["default"], "OPTIONS": {"SCHEDULES": typo}}
    ticker = Ticker("default", "default", "w1", every=0)
    with override_settings(TASKS=tasks), caplog.at_level("WARNING"):
        ticker.maybe_tick()
    [trouble] = [r for r in caplog.records if getattr(r, "event", "") == "schedules_trouble"]
    assert "SCHEDULES['x'].task" in trouble.getMessage()
    assert not Schedule.objects.exists()


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(schedule=...) needs Django 6.1")
def test_the_system_check_names_use_tz_off_for_schedules_declared_by_tasks():
    """Invariant 6: a backend whose schedules are all @task(schedule=...), with USE_TZ =
    False: E020, as for OPTIONS["SCHEDULES"] (before: only W003, and each worker logged
    "Schedules not ticked" and never ticked)."""
    import tests.testapp.periodic  # noqa: F401
    from django_leases.checks import check_backend

    assert not [m for m in check_backend("default", {}) if m.id == "django_leases.E020"]
    with override_settings(USE_TZ=False):
        [error] = [m for m in check_backend("default", {}) if m.id == "django_leases.E020"]
    assert "USE_TZ" in error.msg and "TASKS['default'] (its tasks' schedules)" in error.msg


def test_the_system_check_names_a_missing_task_and_use_tz_off():
    """Invariant 6: E020 reports, before any worker starts, a schedule naming a task no
    code declares and schedules with USE_TZ = False (ticks are UTC instants)."""
    from django_leases.checks import check_backend

    typo = {"SCHEDULES": {"x": {"task": "tests.testapp.tasks.typo", "every": 60}}}
    [error] = [m for m in check_backend("default", typo) if m.id == "django_leases.E020"]
    assert "SCHEDULES['x'].task" in error.msg and "typo" in error.msg
    good = {"SCHEDULES": {"x": {"task": TASK, "every": 60, "args": [1, 2]}}}
    with override_settings(USE_TZ=False):
        [error] = [m for m in check_backend("default", good) if m.id == "django_leases.E020"]
    assert "USE_TZ" in error.msg
