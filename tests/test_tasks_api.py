"""The django.tasks API end to end: enqueue through the public API, run by a real
run_lease_worker process, read back with get_result() / refresh() from this process.

Invariants (design.md): (1) one clock, (2) rowcount is ownership, (3) nothing is lost,
(4) duplicates only after expiry, (5) stale writes rejected.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.tasks import TaskResultStatus, task_backends
from django.test import override_settings
from django.utils import timezone

from django_leases.exceptions import LeaseLost
from django_leases.models import Job
from tests.testapp.models import Effect
from tests.testapp.tasks import (
    add,
    async_add,
    async_nap,
    async_orm_thread,
    boom,
    bulk_add,
    injected,
    note,
    record,
    signalled,
    with_context,
)
from tests.worker_helpers import ROOT, Workers, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LEASE, BEAT, POLL = 2.0, 0.5, 0.2
FAST = ["--lease", str(LEASE), "--heartbeat", str(BEAT), "--poll", str(POLL)]
# Generous: the machine is shared, and a worker's start (django.setup) takes a while.
SETTLE = 30


@pytest.fixture
def workers(tmp_path):
    pool = Workers(tmp_path)
    yield pool
    pool.close()


def finished(result, timeout: float = SETTLE):
    """Refresh ``result`` until it is finished; return it."""

    def done():
        result.refresh()
        return result.is_finished

    wait_for(done, timeout, f"result {result.id} to finish (status {result.status})", interval=0.1)
    return result


def phases(key: str) -> list[str]:
    return list(Effect.objects.filter(key=key).order_by("id").values_list("phase", flat=True))


def stop(worker) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


# -- 1. what the backend declares, honoured by a worker ----------------------------------


def test_the_backend_declares_what_it_supports():
    backend = task_backends["default"]
    assert (
        backend.supports_defer,
        backend.supports_priority,
        backend.supports_get_result,
        backend.supports_async_task,
    ) == (True, True, True, True)


def test_a_deferred_task_does_not_run_before_run_after(workers):
    """A task whose run_after lies ahead stays READY while a worker runs what is due, and
    starts no earlier than run_after (1: due time is compared with the database clock)."""
    run_after = timezone.now() + timedelta(seconds=4)
    later = note.using(run_after=run_after).enqueue("defer", "later")
    now = note.enqueue("defer", "now")
    w = workers.start("defer-w", *FAST)
    finished(now)
    later.refresh()
    assert later.status == TaskResultStatus.READY and later.started_at is None
    finished(later)
    assert later.status == TaskResultStatus.SUCCESSFUL
    assert later.started_at >= run_after
    assert phases("defer") == ["now", "later"]
    stop(w)


def test_a_single_slot_worker_runs_jobs_in_priority_order(workers):
    """With --concurrency 1, due jobs run highest priority first, then oldest first."""
    for priority in (0, 50, -20, 10, 50):
        note.using(priority=priority).enqueue("prio", str(priority))
    w = workers.start("prio-w", *FAST, "--concurrency", "1", "--burst", ready=False)
    assert w.wait_exit(SETTLE) == 0
    assert phases("prio") == ["50", "50", "10", "0", "-20"]


# -- 2. results read back from another process -------------------------------------------


def test_a_result_read_back_from_another_process_carries_times_worker_and_value(workers):
    """get_result/aget_result/refresh in this process see what the worker recorded; every
    time comes from the database clock (1), in causal order."""
    result = async_to_sync(async_add.aenqueue)(2, 3)
    assert result.status == TaskResultStatus.READY and result.enqueued_at is not None
    w = workers.start("result-w", *FAST)
    finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"sum": 5, "fence": 1, "worker": "result-w"}
    assert result.worker_ids == ["result-w"] and result.attempts == 1 and result.errors == []
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    again = async_to_sync(async_add.aget_result)(result.id)
    assert (again.status, again.return_value, again.finished_at) == (
        result.status,
        result.return_value,
        result.finished_at,
    )
    stop(w)


def test_with_use_tz_false_a_results_times_are_time_zones_local_time(workers):
    """(1) With USE_TZ = False Django's datetimes are naive local time (TIME_ZONE), as
    ImmediateBackend's timezone.now() gives them. The rows keep the database clock in UTC
    (SQLite's clock, MySQL's sessions: check E015), which results gave as it was, five
    hours ahead of timezone.now() in New York; PostgreSQL's session runs in TIME_ZONE."""
    local = override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
    with local:
        before = timezone.now()
        result = add.enqueue(2, 3)
        assert result.enqueued_at.tzinfo is None
        assert abs(result.enqueued_at - before) < timedelta(minutes=1)
    w = workers.start("local-w", *FAST)
    wait_for(lambda: Job.objects.get(pk=result.id).state == "succeeded", SETTLE, "the job")
    with local:
        result.refresh()
        now = timezone.now()
        times = [
            result.enqueued_at,
            result.started_at,
            result.last_attempted_at,
            result.finished_at,
        ]
        assert all(t.tzinfo is None and abs(t - now) < timedelta(minutes=1) for t in times), (
            times,
            now,
        )
        assert times == sorted(times)
    stop(w)


def test_errors_carry_tracebacks_and_every_attempt_is_counted(workers):
    """A failing task is FAILED once its attempts are spent, with one error per attempt
    (class and traceback) and one worker id per attempt (3: nothing is dropped)."""
    result = boom.using_lease(max_attempts=2, retry=[0]).enqueue()
    w = workers.start("errors-w", *FAST)
    finished(result)
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in result.errors] == [ValueError, ValueError]
    assert all("Traceback" in e.traceback and "boom" in e.traceback for e in result.errors)
    assert result.worker_ids == ["errors-w", "errors-w"] and result.attempts == 2
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018
    stop(w)


def test_an_expired_claim_stays_running_until_another_worker_takes_it_over(workers):
    """A killed worker's job reads RUNNING while its lease is valid and after it expired;
    once another worker claims and finishes it, it is SUCCESSFUL with two attempts, both
    workers, and the lost lease as a LeaseLost error (3, 4)."""
    result = record.enqueue("takeover", first_seconds=60, later_seconds=0)
    a = workers.start("takeover-a", *FAST)
    wait_for(lambda: phases("takeover"), SETTLE, "the first handler to start")
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and result.worker_ids == ["takeover-a"]
    assert result.started_at is not None and result.finished_at is None
    a.signal(signal.SIGKILL)
    a.wait_exit()
    wait_for(
        lambda: Job.objects.expired().filter(pk=int(result.id)).exists(),
        LEASE + 5,
        "the lease to expire",
    )
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    b = workers.start("takeover-b", *FAST)
    finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.worker_ids == ["takeover-a", "takeover-b"] and result.attempts == 2
    assert [e.exception_class for e in result.errors] == [LeaseLost]
    assert result.last_attempted_at > result.started_at
    stop(b)


# -- 3. context --------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_context_task_gets_djangos_task_context_and_its_lease(workers, isolation):
    """takes_context=True hands the handler Django's TaskContext, whose ``job`` is the
    claim's JobHandle (the same object as current_job()), in both isolation modes."""
    result = with_context.enqueue(f"ctx-{isolation}")
    w = workers.start(f"ctx-{isolation}", *FAST, "--isolation", isolation)
    value = finished(result).return_value
    assert value == {
        "key": f"ctx-{isolation}",
        "is_task_context": True,
        "is_lease_context": True,
        "attempt": 1,
        "id": result.id,
        "status": "RUNNING",
        "worker_ids": [f"ctx-{isolation}"],
        "same_handle": True,
        "fence": 1,
        "lost": False,
        "lease_left": True,
        "pid": value["pid"],
    }
    assert (value["pid"] == w.pid) == (isolation == "thread")
    stop(w)


# -- 4. async tasks ----------------------------------------------------------------------


def test_an_async_task_longer_than_its_lease_keeps_its_claim(workers):
    """An async handler sleeping through several lease lengths blocks no heartbeat: the job
    succeeds on its first claim (4: no duplicate while the lease is renewed)."""
    result = async_nap.enqueue(3 * LEASE)
    w = workers.start("nap-w", *FAST)
    finished(result, timeout=SETTLE + 3 * LEASE)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 1 and result.attempts == 1
    stop(w)


def test_an_async_tasks_orm_calls_run_on_its_own_handler_slot(workers):
    """(6) As under Django's Task.call() (async_to_sync), an async handler's sync_to_async
    calls, the async ORM's included, run on the job's own handler thread, whose
    connection the worker tidies after each job. Before, asyncio.run() sent every async
    handler's ORM calls to one thread shared by all of them: queued behind each other,
    on a connection nothing closed once it broke."""
    results = [async_orm_thread.enqueue(f"orm-{n}") for n in range(4)]
    w = workers.start("orm-w", *FAST, "--concurrency", "4", "--burst")
    assert w.wait_exit(SETTLE) == 0
    names = [finished(r).return_value for r in results]
    assert all(r.status == TaskResultStatus.SUCCESSFUL for r in results), names
    assert all(name.startswith("leases-handler-") for name in names), names


def test_a_task_whose_decorator_gives_an_argument_is_called_as_its_wrapper_is(workers):
    """(6) A call is checked against what the worker calls, a decorator's wrapper, not
    the function functools.wraps points at: injected.enqueue(5) is taken and runs, as
    under Django's own backends (before, InvalidTask: "missing a required argument")."""
    result = injected.enqueue(5)
    w = workers.start("wrapped-w", *FAST, "--burst")
    assert w.wait_exit(SETTLE) == 0
    assert finished(result).status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "client:5"


# -- 5. per-task options honoured by a worker --------------------------------------------


def test_a_per_task_lease_shorter_than_the_workers_heartbeat_is_still_renewed(workers):
    """A task's own short lease (using_lease) is renewed often enough by a worker started
    with the backend's defaults (30 s lease): the job succeeds on its first claim (4)."""
    result = record.using_lease(lease=2).enqueue("short-lease", first_seconds=5)
    w = workers.start("short-w", "--poll", str(POLL))
    finished(result, timeout=SETTLE + 5)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.attempts == 1
    assert result.return_value == {"fence": 1, "worker": "short-w"}
    stop(w)


# -- 7. Django's signals, sent by the worker ---------------------------------------------


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_task_started_and_finished_fire_in_the_process_that_runs_the_handler(workers, isolation):
    """task_started (RUNNING) and task_finished (SUCCESSFUL, or FAILED sent inside the
    exception handler so exc_info is set) reach receivers, sender the backend class, with
    current_job() set; in process isolation they fire in the child."""
    ok = signalled.enqueue(f"sig-ok-{isolation}")
    bad = signalled.using_lease(max_attempts=1).enqueue(f"sig-bad-{isolation}", fail=True)
    w = workers.start(f"sig-{isolation}", *FAST, "--isolation", isolation)
    finished(ok)
    finished(bad)
    assert phases(f"sig-ok-{isolation}") == ["started:RUNNING", "finished:SUCCESSFUL"]
    assert phases(f"sig-bad-{isolation}") == ["started:RUNNING", "finished:FAILED+exc"]
    rows = Effect.objects.filter(key__startswith="sig-", key__endswith=isolation)
    assert {(r.fence, r.worker_id) for r in rows} == {(1, f"sig-{isolation}")}
    pids = {r.pid for r in rows}
    assert (pids == {w.pid}) == (isolation == "thread"), pids
    stop(w)


# -- 6. a backend whose jobs live on their own database ----------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_a_backend_on_another_database_commits_independently_of_the_callers_transaction():
    """OPTIONS["DATABASE"] puts the jobs on "queue": rolling back the caller's transaction
    on "default" keeps the job; only a transaction on "queue" can take it back (3)."""
    with pytest.raises(RuntimeError), transaction.atomic():
        kept = bulk_add.enqueue(1, 2)
        raise RuntimeError("roll back default")
    with pytest.raises(RuntimeError), transaction.atomic(using="queue"):
        bulk_add.enqueue(3, 4)
        raise RuntimeError("roll back queue")
    assert list(Job.objects.using("queue").values_list("pk", flat=True)) == [int(kept.id)]
    assert not Job.objects.using("default").exists()
    assert bulk_add.get_result(kept.id).status == TaskResultStatus.READY


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_a_worker_started_with_backend_alias_runs_that_backends_jobs(workers):
    """run_lease_worker --backend queue claims from the "queue" database; a worker of the
    default backend never sees those jobs."""
    result = bulk_add.enqueue(20, 22)
    other = workers.start("default-w", *FAST)
    w = workers.start("queue-w", *FAST, "--backend", "queue")
    finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 42
    assert result.worker_ids == ["queue-w"]
    assert not Job.objects.using("default").exists()
    stop(w)
    stop(other)


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_a_bulk_enqueue_on_the_backends_own_database_is_run_by_its_worker(workers):
    """enqueue_many writes to the backend's DATABASE, all or nothing in a transaction there,
    and a worker of that backend runs every job (3)."""
    with pytest.raises(RuntimeError), transaction.atomic(using="queue"):
        bulk_add.enqueue_many([((i, i), {}) for i in range(3)])
        raise RuntimeError("roll back queue")
    assert not Job.objects.using("queue").exists()
    results = bulk_add.enqueue_many([((i, i), {}) for i in range(12)])
    assert not Job.objects.using("default").exists()
    w = workers.start("queue-bulk", *FAST, "--backend", "queue")
    assert [finished(r).return_value for r in results] == [2 * i for i in range(12)]
    stop(w)


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_task_sent_to_another_backend_with_using_is_run_by_that_backends_worker(
    workers, isolation
):
    """Task.using(backend=...) is Django's way to send a task to another backend: add,
    declared for "default", sent to "queue", is run by the "queue" worker, its results
    that backend's (before: the worker, which had it declared for "default" only, ended
    the job dead as an UnknownTask). So is a task declared for Django's ImmediateBackend,
    which no lease backend declares (before: dead as an UnknownTask). A path declared for
    no backend still ends dead."""
    from django.tasks import TaskResultStatus as Status

    from tests.testapp.tasks import immediate_add

    sent = add.using(backend="queue", queue_name="bulk")
    result = sent.enqueue(20, 22)
    from_immediate = immediate_add.using(backend="queue", queue_name="bulk").enqueue(1, 2)
    stray = Job.objects.db_manager("queue").enqueue(
        "tests.testapp.tasks.not_a_task", [], None, queue_name="bulk"
    )
    w = workers.start(
        f"using-{isolation}", *FAST, "--backend", "queue", "--isolation", isolation, "--burst"
    )
    assert w.wait_exit(SETTLE) == 0
    assert finished(result).status == Status.SUCCESSFUL and result.return_value == 42
    assert result.worker_ids == [f"using-{isolation}"] and result.backend == "queue"
    assert sent.get_result(result.id).status == Status.SUCCESSFUL
    assert finished(from_immediate).status == Status.SUCCESSFUL
    assert from_immediate.return_value == 3 and from_immediate.backend == "queue"
    # Run, never declared: the schedules and lookup() see only what each backend declares
    # (send_receipt: add's copy made above is declared for "queue" in this process).
    from django_leases import registry

    moved = registry.runnable("queue", "tests.testapp.tasks.send_receipt", "bulk")
    assert (moved.backend, moved.queue_name) == ("queue", "bulk")
    assert registry.lookup("queue", "tests.testapp.tasks.send_receipt") is None
    stray.refresh_from_db()
    assert stray.state == "dead"


# -- 9. the enqueue-on-commit pattern the docs recommend ---------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_enqueue_on_commit_writes_nothing_when_the_caller_rolls_back():
    """transaction.on_commit(lambda: task.enqueue(...)) enqueues only after the caller's
    commit, so a rolled-back order never runs a job (3 for the caller's intent)."""
    with pytest.raises(RuntimeError), transaction.atomic():
        transaction.on_commit(lambda: bulk_add.enqueue(1, 1))
        raise RuntimeError("roll back")
    assert not Job.objects.using("queue").exists()
    with transaction.atomic():
        transaction.on_commit(lambda: bulk_add.enqueue(2, 2))
        assert not Job.objects.using("queue").exists()
    assert Job.objects.using("queue").count() == 1


# -- 10. options the worker processes share: TASK_MODULES, MAX_ATTEMPTS ------------------

OPTIONS_SETTINGS = "--settings=tests.testapp.options_settings"
TASK_MODULES = {"TASK_MODULES": ["tests.testapp.jobs"]}
# A process that only reads results (a status page): it never imports a task module itself.
READER = """
import json, sys
import django
django.setup()
from django.tasks import task_backends
result = task_backends["default"].get_result(sys.argv[1])
print(json.dumps({"status": result.status, "task": result.task.module_path,
                  "type": type(result.task).__name__, "errors": len(result.errors),
                  "value": result.return_value if result.status == "SUCCESSFUL" else None,
                  "imported": "tests.testapp.jobs" in sys.modules}))
"""


def with_options(settings, **options) -> None:
    """The default backend's OPTIONS in this process, as options_settings gives workers."""
    tasks = copy.deepcopy(settings.TASKS)
    tasks["default"]["OPTIONS"].update(options)
    settings.TASKS = tasks


def read_elsewhere(result_id, options=None, env_extra=None) -> dict:
    """get_result() in a fresh process of the project, with OPTIONS ``options``."""
    from django.db import connection

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.testapp.options_settings",
        "LEASES_WORKER_DB_NAME": connection.settings_dict["NAME"],
        "PYTHONPATH": str(ROOT),
        "LEASES_TEST_OPTIONS": json.dumps(options or {}),
        **(env_extra or {}),
    }
    done = subprocess.run(
        [sys.executable, "-c", READER, str(result_id)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A process of the project that imports task modules before anything runs discovery (a
# view module loaded by the URLconf): what enqueue() and the check say must not depend on it.
VIEW_FIRST = """
import json
import django
django.setup()
from tests.shopapp.jobs import packed
from tests.shopapp.jobs_only import forgotten
from django.tasks import task_backends
from django.tasks.exceptions import InvalidTask
accepted = packed.enqueue(5)
try:
    forgotten.enqueue(6)
    refused = None
except InvalidTask as e:
    refused = str(e)
print(json.dumps({"accepted": accepted.id, "refused": refused,
                  "checks": [[m.id, m.msg] for m in task_backends["default"].check()]}))
"""


def test_a_task_its_apps_tasks_module_imports_is_accepted_and_runs(workers):
    """Issue 15.3. tests/shopapp/tasks.py imports packed from tests/shopapp/jobs.py, so every
    worker declares it: enqueue() accepts it and a worker runs it, in a process that
    imported jobs.py before discovery ran too. forgotten, in jobs_only.py, which no
    discovered module imports, is refused with the fix and listed by check E018 (3)."""
    from django.db import connection
    from django.tasks.exceptions import InvalidTask

    from tests.shopapp.jobs import packed
    from tests.shopapp.jobs_only import forgotten

    result = packed.enqueue(3)
    with pytest.raises(InvalidTask, match="TASK_MODULES") as refusal:
        forgotten.enqueue(4)
    assert "'tests.shopapp.jobs_only'" in str(refusal.value)

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.worker_settings",
        "LEASES_WORKER_DB_NAME": connection.settings_dict["NAME"],
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", VIEW_FIRST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        "'tests.shopapp.jobs_only'" in elsewhere["refused"]
        and "TASK_MODULES" in elsewhere["refused"]
    )
    [e018] = [msg for check_id, msg in elsewhere["checks"] if check_id == "django_leases.E018"]
    assert "tests.shopapp.jobs_only.forgotten" in e018 and "tests.shopapp.jobs.packed" not in e018

    w = workers.start("shop", *FAST, "--burst", ready=False)
    assert w.wait_exit(SETTLE) == 0
    assert finished(result).return_value == "packed 3"
    assert finished(packed.get_result(elsewhere["accepted"])).return_value == "packed 5"
    assert not Job.objects.filter(task_path=forgotten.module_path).exists()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_task_in_a_module_its_tasks_package_does_not_import_runs(workers, isolation):
    """Invariant 3: tests/reportapp/tasks/ is a package whose __init__ imports none of its
    modules. enqueue() accepts a task of tasks/summaries.py, so a worker must declare it:
    discovery imports every module of a tasks package. Before, enqueue() accepted it
    (any submodule counted) while the worker imported the package alone, and each such
    job ended dead as an UnknownTask. A task in the package's test module, or in a folder
    of it with no __init__.py, which discovery leaves out, is refused at enqueue (6)."""
    from django.tasks.exceptions import InvalidTask

    from tests.reportapp.tasks.drafts.old import draft
    from tests.reportapp.tasks.summaries import tally
    from tests.reportapp.tasks.tests import left_out

    for stray in (left_out, draft):
        with pytest.raises(InvalidTask, match="TASK_MODULES"):
            stray.enqueue()
    result = tally.enqueue(1, 2, 3)
    w = workers.start(
        f"report-{isolation}", *FAST, "--burst", "--isolation", isolation, ready=False
    )
    assert w.wait_exit(SETTLE) == 0, w.log()
    done = finished(result)
    assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 6), w.log()
    assert not Job.objects.filter(task_path__in=[left_out.module_path, draft.module_path])


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_tasks_listed_in_task_modules_run_and_read_back_in_any_process(
    workers, settings, tmp_path, isolation
):
    """Issue 15.3. A @task in tests/testapp/jobs.py: a row for it is dead-lettered by a
    worker that does not list the module, with the fix in the message; with TASK_MODULES
    the worker runs it (and the requeued dead one). A process that only reads results
    gets them whatever it imported: the declared modules are imported for it, and a task
    nobody declares reads with a stand-in; the row's own path is never imported (3). In
    process isolation the handler's child process finds the task the same way."""
    from tests.testapp.jobs import shipped

    written = Job.objects.enqueue("tests.testapp.jobs.shipped", [8])
    w = workers.start("no-modules", *FAST, "--burst", ready=False)
    assert w.wait_exit(SETTLE) == 0
    written.refresh_from_db()
    assert written.state == "dead"
    message = written.failures.get().message
    assert "TASK_MODULES" in message and "requeue" in message, message

    with_options(settings, **TASK_MODULES)
    result = shipped.enqueue(7)
    Job.objects.filter(pk=written.pk).requeue()
    w = workers.start(
        "with-modules",
        *FAST,
        "--burst",
        "--isolation",
        isolation,
        OPTIONS_SETTINGS,
        ready=False,
        env_extra={"LEASES_TEST_OPTIONS": json.dumps(TASK_MODULES)},
    )
    assert w.wait_exit(SETTLE) == 0
    assert finished(result).return_value == "shipped 7"
    assert Job.objects.get(pk=written.pk).result == "shipped 8"

    assert read_elsewhere(result.id, TASK_MODULES) == {
        "status": "SUCCESSFUL",
        "task": "tests.testapp.jobs.shipped",
        "type": "LeaseTask",
        "errors": 0,
        "value": "shipped 7",
        "imported": True,
    }
    assert read_elsewhere(result.id) == {
        "status": "SUCCESSFUL",
        "task": "tests.testapp.jobs.shipped",
        "type": "UndeclaredTask",
        "errors": 0,
        "value": "shipped 7",
        "imported": False,
    }
    trap = tmp_path / "trap-imported"
    stray = Job.objects.enqueue("tests.testapp.trap.explode", [])
    assert read_elsewhere(stray.pk, TASK_MODULES, {"LEASES_TRAP": str(trap)}) == {
        "status": "READY",
        "task": "tests.testapp.trap.explode",
        "type": "UndeclaredTask",
        "errors": 0,
        "value": None,
        "imported": True,
    }
    assert not trap.exists()


def test_max_attempts_1_gives_the_semantics_of_djangos_own_backends(workers, settings):
    """Issue 15.6, as docs/django-tasks.md ("Coming from another backend") says: with the
    default MAX_ATTEMPTS (5) a task that raised is READY again, its error recorded, waiting
    for its retry; with MAX_ATTEMPTS 1 it is FAILED after one attempt with one error, as
    Django's built-in backends and django-tasks-db leave it (3)."""
    retried = boom.enqueue()
    with_options(settings, MAX_ATTEMPTS=1)
    once = boom.enqueue()
    w = workers.start(
        "django-semantics",
        *FAST,
        "--burst",
        OPTIONS_SETTINGS,
        ready=False,
        env_extra={"LEASES_TEST_OPTIONS": json.dumps({"MAX_ATTEMPTS": 1})},
    )
    assert w.wait_exit(SETTLE) == 0
    failed = boom.get_result(once.id)
    assert (failed.status, failed.attempts, len(failed.errors)) == (TaskResultStatus.FAILED, 1, 1)
    assert failed.errors[0].exception_class is ValueError and "boom" in failed.errors[0].traceback
    again = boom.get_result(retried.id)
    assert (again.status, again.attempts, len(again.errors)) == (TaskResultStatus.READY, 1, 1)
    assert again.finished_at is None
