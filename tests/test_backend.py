"""Enqueueing through django.tasks: job rows written in the caller's transaction."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from datetime import timedelta

import pytest
from django.db import transaction
from django.tasks import TaskResultStatus, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from django_leases import registry
from django_leases.exceptions import InvalidJobArgument
from django_leases.models import Job, JobFailure
from django_leases.states import JobState
from tests.testapp.tasks import add, send_receipt

pytestmark = pytest.mark.django_db


def test_task_enqueue_writes_a_job_row_that_get_result_reads_back():
    result = add.enqueue(2, 3)
    job = Job.objects.get(pk=int(result.id))
    assert (job.task_path, job.args, job.state) == (
        "tests.testapp.tasks.add",
        [2, 3],
        JobState.PENDING,
    )
    assert result.status == TaskResultStatus.READY
    assert result.enqueued_at == job.enqueued_at
    again = add.get_result(result.id)
    assert again.args == [2, 3] and again.task.func is add.func


def test_queue_priority_and_run_after_reach_the_row():
    when = timezone.now() + timedelta(hours=1)
    result = send_receipt.using(run_after=when).enqueue(7)
    job = Job.objects.get(pk=int(result.id))
    assert (job.queue_name, job.priority, job.available_at) == ("emails", 10, when)


def test_enqueue_inside_a_rolled_back_transaction_leaves_no_job():
    """Invariant 3: the job exists exactly when the caller's transaction commits."""
    with pytest.raises(RuntimeError), transaction.atomic():
        add.enqueue(1, 1)
        assert Job.objects.count() == 1
        raise RuntimeError("rollback")
    assert Job.objects.count() == 0


def test_arguments_that_do_not_round_trip_raise_invalid_task_naming_them():
    """Invariant 3: a refused enqueue writes nothing and says which argument. The error
    is InvalidTask, and the TypeError (ValueError for bytes that are not UTF-8) Django's
    own backends raise, so an ``except`` written from Django's docs catches it."""
    with pytest.raises(InvalidTask, match=r"args\[1\]") as refused:
        add.enqueue(1, timezone.now())
    assert isinstance(refused.value, TypeError)
    with pytest.raises(TypeError, match=r"kwargs\['b'\]"):
        add.enqueue(1, b={1, 2})
    with pytest.raises(ValueError, match=r"args\[0\]"):
        add.enqueue(b"\xff", 1)
    with pytest.raises(TypeError, match=r"calls\[0\]\.args\[0\]"):
        add.enqueue_many([((object(), 2), {})])
    assert Job.objects.count() == 0


def test_the_tasks_api_takes_arguments_as_djangos_taskresult_normalizes_them():
    """Conformance: Django's TaskResult normalizes a call's arguments
    (django.utils.json.normalize_json: UTF-8 bytes as str, any sequence as a list, any
    mapping as a dict), and Django's own backends accept them so. task.enqueue() took them
    the same way here (before: refused, "does not round-trip"); the row, the result and
    get_result() hold the normalized values, which the handler gets. The manager's
    Job.objects.enqueue() stays strict (3)."""
    from types import MappingProxyType

    from tests.testapp.tasks import echo

    result = echo.enqueue(b"caf\xc3\xa9", range(3), data=MappingProxyType({"k": b"v"}))
    assert (result.args, result.kwargs) == (["café", [0, 1, 2]], {"data": {"k": "v"}})
    job = Job.objects.get(pk=int(result.id))
    assert (job.args, job.kwargs) == (["café", [0, 1, 2]], {"data": {"k": "v"}})
    again = echo.get_result(result.id)
    assert (again.args, again.kwargs) == (result.args, result.kwargs)
    [many] = echo.enqueue_many([((b"x", range(2)), {})])
    assert Job.objects.get(pk=int(many.id)).args == ["x", [0, 1]] == many.args
    # A bytes key too, as normalize_json decodes it (before: refused, "key of type bytes").
    keyed = echo.enqueue({b"k\xc3\xa9": 1})
    assert Job.objects.get(pk=int(keyed.id)).args == [{"ké": 1}] == keyed.args
    with pytest.raises(ValueError, match=r"args\[0\]\[b'\\xff'\]: is bytes that are not UTF-8"):
        echo.enqueue({b"\xff": 1})
    with pytest.raises(InvalidJobArgument, match="key of type bytes"):
        Job.objects.enqueue(echo.module_path, [{b"k": 1}])
    with pytest.raises(InvalidJobArgument, match=r"args\[0\]"):
        Job.objects.enqueue(echo.module_path, [b"abc"])

    class Unreadable(Sequence):
        """A caller's sequence whose items cannot be read."""

        def __len__(self):
            return 1

        def __getitem__(self, i):
            raise RuntimeError("no")

    before = Job.objects.count()
    for enqueue in (
        lambda: echo.enqueue(Unreadable()),
        lambda: echo.enqueue_many([((Unreadable(),), {})]),
    ):
        with pytest.raises(InvalidTask, match=r"args\[0\]: raised RuntimeError"):
            enqueue()
    assert Job.objects.count() == before


def test_enqueue_sends_task_enqueued():
    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append(task_result.id)

    task_enqueued.connect(receiver)
    try:
        result = add.enqueue(1, 2)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [result.id]


def test_status_follows_the_job_state():
    result = add.enqueue(1, 2)
    [job] = Job.objects.claim("w")
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and result.worker_ids == ["w"]
    Job.objects.filter(pk=job.pk).expire_now()
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING  # expired but not yet reclaimed
    [job] = Job.objects.claim("w2")
    Job.objects.ack(job, 3)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3
    assert result.worker_ids == ["w", "w2"] and result.attempts == 2
    assert result.finished_at is not None


def test_a_dead_job_is_failed_with_its_errors():
    result = add.enqueue(1, 2)
    Job.objects.filter(pk=int(result.id)).update(max_attempts=1)
    [job] = Job.objects.claim("w")
    Job.objects.fail(
        job,
        exception_class_path="builtins.ZeroDivisionError",
        message="division by zero",
        traceback="Traceback: ZeroDivisionError",
    )
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class is ZeroDivisionError
    assert "ZeroDivisionError" in error.traceback


def test_unknown_result_id_raises_does_not_exist():
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("not-a-number")


def test_get_results_reads_ids_as_get_result_does_and_keys_them_as_results():
    """(6) get_results() is get_result() for many: each id read as get_result() reads it
    (an id of no job left out, whatever its type), the answer keyed by TaskResult.id
    (before: a string's characters were taken as ids, "01" named job 1, "abc" raised
    ValueError and 2**70 OverflowError, and the keys were ints)."""
    backend = task_backends["default"]
    one, two = (Job.objects.enqueue("tests.testapp.tasks.add", [n, n]) for n in (1, 2))
    ids = [str(one.pk), two.pk, f"0{one.pk}", "abc", 2**70, None, -1, True]
    results = backend.get_results(ids)
    assert sorted(results) == sorted([str(one.pk), str(two.pk)])
    assert all(key == result.id for key, result in results.items())
    assert results[str(two.pk)].args == [2, 2]
    with pytest.raises(TypeError, match="result_ids must be an iterable of result ids"):
        backend.get_results(str(one.pk))
    assert backend.get_results([]) == {}
    # None of the ids that name no job names one alone either.
    assert backend.get_results([f"0{one.pk}", True, "abc", 2**70, -1, None]) == {}


def test_a_row_naming_an_undeclared_function_is_never_imported():
    """The registry, not the row, decides what code runs: the result still reads, with a
    stand-in task that names the path and can neither be enqueued nor called."""
    job = Job.objects.enqueue(
        "tests.testapp.tasks.not_a_task", [7], queue_name="emails", priority=3
    )
    assert registry.lookup("default", "tests.testapp.tasks.not_a_task") is None
    result = task_backends["default"].get_result(str(job.pk))
    # It pickles, as a cache of results does (before: ValueError, the path imported back).
    again = pickle.loads(pickle.dumps(result))
    assert (again.id, again.task.module_path, again.task.priority) == (
        result.id,
        "tests.testapp.tasks.not_a_task",
        3,
    )
    assert (result.status, result.args, result.task.module_path) == (
        TaskResultStatus.READY,
        [7],
        "tests.testapp.tasks.not_a_task",
    )
    assert (result.task.queue_name, result.task.priority, result.task.backend) == (
        "emails",
        3,
        "default",
    )
    with pytest.raises(InvalidTask, match="not a task declared"):
        result.task.enqueue(7)
    with pytest.raises(InvalidTask, match="not a task declared"):
        result.task.call(7)
    assert registry.lookup("default", "tests.testapp.tasks.not_a_task") is None
    assert "tests.testapp.tasks.add" in registry.declared("default")


def test_a_second_task_at_a_declared_path_is_refused_and_a_reload_is_not(tmp_path, monkeypatch):
    """A worker finds a job's code by the path in its row. Two functions at one path (a
    name bound twice, two lambdas of one module) were both taken at enqueue, and the
    worker ran the first for both, the jobs ending successful with the wrong result (6).
    The second declaration is refused, naming the path, decorated or not; the module
    imported again unchanged (importlib.reload()) declares its task anew, as before."""
    import importlib
    import sys

    (tmp_path / "twice_declared.py").write_text(
        "from django.tasks import task\n\n"
        "@task\ndef dup(x):\n    return 'first'\n\n"
        "@task\ndef dup(x):  # noqa: F811\n    return 'second'\n"
    )
    (tmp_path / "two_lambdas.py").write_text(
        "from django.tasks import task\n\n"
        "triple = task(lambda x: x * 3)\nhundred = task(lambda x: x * 100)\n"
    )
    (tmp_path / "twice_wrapped.py").write_text(
        "import functools\nfrom django.tasks import task\n\n"
        "def logged(f):\n    @functools.wraps(f)\n    def wrapper(*a, **k):\n"
        "        return f(*a, **k)\n    return wrapper\n\n"
        "@task\n@logged\ndef dup(x):\n    return 'first'\n\n"
        "@task\n@logged\ndef dup(x):  # noqa: F811\n    return 'second'\n"
    )
    (tmp_path / "once_declared.py").write_text(
        "from django.tasks import task\n\n@task\ndef once(x):\n    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # Two wrappers of one decorator share its code: what they wrap tells them apart.
    cases = (("twice_declared", "dup"), ("two_lambdas", "<lambda>"), ("twice_wrapped", "dup"))
    for module, path in cases:
        with pytest.raises(InvalidTask, match=rf"^{module}\.{path}: another task is declared"):
            importlib.import_module(module)
        first = registry.lookup("default", f"{module}.{path}")
        assert first is not None and first.call(1) in ("first", 3)
        sys.modules.pop(module, None)
    once = importlib.import_module("once_declared")
    try:
        again = importlib.reload(once)
        assert registry.lookup("default", "once_declared.once") is again.once
    finally:
        sys.modules.pop("once_declared", None)


def test_queues_outside_the_backend_are_refused():
    """(6) Django's own words named neither the task nor the setting to change."""
    with pytest.raises(InvalidTask) as refused:
        add.using(queue_name="nope")
    assert str(refused.value).startswith(
        "tests.testapp.tasks.add: Queue 'nope' is not valid for backend 'default': "
        "queue_name must be one of TASKS['default']['QUEUES'] ("
    ), refused.value


needs_task_kwargs = pytest.mark.skipif(
    __import__("django").VERSION < (6, 1),
    reason="Django 6.0's @task passes no extra options; per-queue OPTIONS cover it there",
)


@needs_task_kwargs
def test_per_task_lease_options_reach_the_job():
    from django.tasks import task

    from tests.testapp.tasks import build_report

    report = task(queue_name="reports", lease=120, max_attempts=9)(build_report)
    job = Job.objects.get(pk=int(report.enqueue("q3").id))
    assert (job.lease_seconds, job.max_attempts) == (120, 9)


@needs_task_kwargs
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lease": 0.1}, "lease"),
        ({"lease": 50_000}, "lease"),
        ({"lease": float("nan")}, "lease"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"retry": [1e9]}, r"retry\.delays\[0\]"),
        ({"non_retryable": ValueError}, "non_retryable"),
        ({"non_retryable": ("x",)}, "non_retryable"),
        ({"unique_key": 5}, "unique_key"),
        ({"unique_key": ""}, "unique_key"),
    ],
)
def test_bad_per_task_options_fail_at_decoration_time_naming_the_option(options, named):
    from django.tasks import task

    from tests.testapp.tasks import build_report

    with pytest.raises(InvalidTask, match=named):
        task(**options)(build_report)


def test_per_queue_options_apply_where_the_task_sets_none(settings):
    settings.TASKS = {
        "default": {
            "BACKEND": "django_leases.backends.LeaseBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {
                "LEASE_SECONDS": 40,
                "QUEUE_OPTIONS": {"emails": {"LEASE_SECONDS": 300, "MAX_ATTEMPTS": 2}},
            },
        }
    }
    receipt = send_receipt.enqueue(1)
    total = add.enqueue(1, 1)
    assert Job.objects.filter(pk=int(receipt.id)).values_list(
        "lease_seconds", "max_attempts"
    ).get() == (300, 2)
    assert Job.objects.filter(pk=int(total.id)).values_list(
        "lease_seconds", "max_attempts"
    ).get() == (40, 5)


def test_using_lease_sets_per_task_options_on_every_django_version():
    from django_leases.retry import Retry

    tuned = add.using_lease(
        lease=90, max_attempts=3, retry=[5, 50], on_lease_lost="park", unique_key="sum-1-2"
    )
    job = Job.objects.get(pk=int(tuned.enqueue(1, 2).id))
    assert (job.lease_seconds, job.max_attempts, job.on_lease_lost, job.unique_key) == (
        90,
        3,
        "park",
        "sum-1-2",
    )
    assert Retry.from_json(job.retry) == Retry(delays=(5, 50))


def test_a_task_with_list_or_dict_options_stays_hashable():
    """Django's Task is a frozen dataclass, usable as a dict key or in a set; a ladder
    given as a list (as the docs show) or a dict, or a list of schedules, made hashing
    the task raise TypeError."""
    from django_leases.schedules import Periodic

    variants = [
        add.using_lease(retry=[5, 50]),
        add.using_lease(retry={"base": 5, "factor": 2}),
        add.using_lease(schedule=[Periodic(every=60, args=[1, 2])]),
    ]
    assert {task: i for i, task in enumerate(variants)}[variants[0]] == 0
    assert hash(variants[0]) == hash(add.using_lease(retry=[5, 50]))
    assert variants[0] == add.using_lease(retry=[5, 50]) != variants[1]


def test_a_duplicate_unique_key_through_django_tasks_raises_and_writes_nothing():
    from django_leases.exceptions import DuplicateJob

    once = add.using_lease(unique_key="nightly-2026-11-30")
    once.enqueue(1, 1)
    with pytest.raises(DuplicateJob):
        once.enqueue(1, 1)
    assert Job.objects.count() == 1


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"on_lease_lost": "sometimes"}, "on_lease_lost"),
        ({"retry": [-1]}, "retry"),
    ],
)
def test_bad_using_lease_options_raise_invalid_task(changes, named):
    with pytest.raises(InvalidTask, match=named):
        add.using_lease(**changes)


@pytest.mark.parametrize("classes", [(ValueError,), [ValueError], (), (int,)])
def test_a_copys_non_retryable_is_refused_naming_the_way_that_works(classes):
    """The worker reads non_retryable from the task as declared (the registry's), never
    from a job: using_lease(non_retryable=...) was accepted, and its jobs retried as if it
    had not been given (a tryout's CardDeclined, three attempts, dead_reason=attempts).
    Refused (invariant 6: a caller's option is applied or refused, never dropped), naming
    the option and NonRetryable, which works on every Django."""
    with pytest.raises(InvalidTask, match=r"cannot change non_retryable.*NonRetryable"):
        add.using_lease(non_retryable=classes)
    with pytest.raises(TypeError, match="unknown options"):
        add.using_lease(non_retryables=classes)


def test_a_cancelled_job_is_failed_without_an_invented_error():
    """An operator's cancel ends the job: FAILED, is_finished, no error recorded for it."""
    result = add.enqueue(1, 2)
    Job.objects.filter(pk=int(result.id)).cancel()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.is_finished
    assert result.errors == [] and result.finished_at is not None


def test_a_parked_job_reads_ready_until_a_person_releases_or_cancels_it():
    """A parked job (pending, available_at NULL) is waiting, not finished: READY (3: kept)."""
    result = add.using_lease(on_lease_lost="park").enqueue(1, 2)
    [job] = Job.objects.claim("w")
    Job.objects.filter(pk=job.pk).expire_now()
    assert Job.objects.claim("w2") == []
    job.refresh_from_db()
    assert (job.state, job.available_at) == (JobState.PENDING, None)
    result.refresh()
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert [e.exception_class_path for e in result.errors] == ["django_leases.exceptions.LeaseLost"]


def test_aenqueue_and_aget_result_match_their_sync_twins():
    from asgiref.sync import async_to_sync

    result = async_to_sync(add.aenqueue)(4, 5)
    again = async_to_sync(add.aget_result)(result.id)
    assert (again.id, again.status, again.args) == (result.id, TaskResultStatus.READY, [4, 5])
    async_to_sync(again.arefresh)()
    assert again.status == TaskResultStatus.READY


def test_enqueue_many_writes_every_job_in_bulk_or_none():
    """Invariant 3: one bad call refuses the whole batch, naming the call and argument."""
    results = add.enqueue_many([((i, i), {}) for i in range(250)])
    assert len(results) == 250 and all(r.status == TaskResultStatus.READY for r in results)
    jobs = Job.objects.filter(pk__in=[int(r.id) for r in results])
    assert jobs.count() == 250 and {j.args[0] for j in jobs} == set(range(250))
    job = jobs.first()
    assert job.deadline - job.enqueued_at == timedelta(days=14)  # database clock, as enqueue()
    with pytest.raises(InvalidTask, match=r"calls\[1\]\.args\[0\]"):
        add.enqueue_many([((1, 2), {}), ((object(), 2), {})])
    assert Job.objects.count() == 250
    assert len(Job.objects.claim("w", limit=300)) == 250


@pytest.mark.django_db(transaction=True)
def test_a_task_enqueued_receiver_that_raises_is_logged_and_the_call_returns(caplog):
    """Outside a transaction a task_enqueued receiver that raised made enqueue() and
    enqueue_many() raise after the rows were committed, the batch's later jobs unsignalled
    and their ids unknown to the caller (invariant 3: a call that raises wrote nothing).
    It is logged with its traceback; every job is signalled and returned. Inside the
    caller's transaction it is raised once every receiver ran, as Django's backends do,
    and the caller's rollback takes the jobs with it."""
    seen = []

    def broken(sender, task_result, **kwargs):
        raise RuntimeError("receiver broke")

    def counting(sender, task_result, **kwargs):
        seen.append(task_result.id)

    task_enqueued.connect(broken)
    task_enqueued.connect(counting)
    try:
        with caplog.at_level(logging.ERROR, logger="django_leases.enqueue"):
            one = add.enqueue(1, 2)
            many = send_receipt.enqueue_many([((i,), {}) for i in range(3)])
        ids = [one.id, *(r.id for r in many)]
        assert seen == ids and Job.objects.filter(pk__in=ids).count() == 4
        logged = [r for r in caplog.records if getattr(r, "event", "") == "receiver_raised"]
        assert [r.job_id for r in logged] == ids
        assert all(r.exc_info[1].args == ("receiver broke",) for r in logged)
        seen.clear()
        with pytest.raises(RuntimeError, match="receiver broke"), transaction.atomic():
            send_receipt.enqueue_many([((i,), {}) for i in range(3)])
        assert len(seen) == 3 and Job.objects.count() == 4
    finally:
        task_enqueued.disconnect(broken)
        task_enqueued.disconnect(counting)


def test_enqueue_many_results_read_like_get_result_and_each_is_signalled():
    """The results of a bulk enqueue are the stored rows, in the order of the calls, and
    task_enqueued is sent once for each."""
    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append(task_result.id)

    task_enqueued.connect(receiver)
    try:
        results = send_receipt.enqueue_many([((i,), {}) for i in range(5)])
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [r.id for r in results]
    for i, result in enumerate(results):
        again = send_receipt.get_result(result.id)
        assert (result.args, result.status, result.task.queue_name, result.task.priority) == (
            [i],
            TaskResultStatus.READY,
            "emails",
            10,
        )
        assert (again.args, again.enqueued_at, again.status) == (
            result.args,
            result.enqueued_at,
            result.status,
        )


def test_a_task_enqueued_again_after_the_settings_change_gets_the_new_options(settings):
    """The backend checks a task's options once, but a change of TASKS makes a new backend
    that checks them again."""
    add.enqueue(1, 1)
    settings.TASKS = {
        "default": {
            **settings.TASKS["default"],
            "OPTIONS": {"LEASE_SECONDS": 77, "MAX_AGE_DAYS": 2},
        }
    }
    job = Job.objects.get(pk=int(add.enqueue(1, 1).id))
    assert (job.lease_seconds, job.deadline - job.enqueued_at) == (77, timedelta(days=2))


def test_tasks_made_per_call_are_each_checked():
    """A task copied per call (its own run_after) is checked on each enqueue: a naive
    run_after is refused even after an aware one of the same task went through."""
    when = timezone.now() + timedelta(minutes=5)
    ok = add.using(run_after=when).enqueue(1, 2)
    assert Job.objects.get(pk=int(ok.id)).available_at == when
    with pytest.raises(InvalidTask):
        add.using(run_after=when.replace(tzinfo=None)).enqueue(1, 2)
    assert Job.objects.count() == 1


def test_enqueue_many_without_insert_returning_still_answers_real_ids():
    """MySQL has no INSERT ... RETURNING, so bulk_create sets no ids there: enqueue_many then
    inserts one row at a time in one transaction and reads the database's times back, and
    every TaskResult names its own job (3). Run here with the feature turned off, on the
    databases whose enqueue goes through the ORM."""
    from django.db import connection

    from django_leases.models import Job
    from tests.testapp.tasks import add

    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL enqueues with its own constant INSERT, not the ORM")
    from unittest import mock

    # Django's own feature flags (a property on MySQL's features class): MySQL's answers.
    features = type(connection.features)
    with (
        mock.patch.object(features, "can_return_rows_from_bulk_insert", False),
        mock.patch.object(features, "can_return_columns_from_insert", False),
    ):
        results = add.enqueue_many([((1, 2), {}), ((3, 4), {}), ((5, 6), {})])
        one = add.enqueue(7, 8)
    assert one.enqueued_at == Job.objects.get(pk=int(one.id)).enqueued_at
    ids = [int(r.id) for r in results]
    assert len(set(ids)) == 3
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=ids)}
    assert [jobs[i].args for i in ids] == [[1, 2], [3, 4], [5, 6]]
    assert [r.enqueued_at for r in results] == [jobs[i].enqueued_at for i in ids]


def test_using_lease_gives_django_tasks_jobs_a_deadline_a_max_age_and_merging():
    """A job enqueued through Django Tasks can carry its own deadline or max age (counted on
    the database clock, invariant 1) and merge into the job holding its unique key."""
    from datetime import timedelta

    from django.tasks.exceptions import InvalidTask
    from django.utils import timezone

    when = timezone.now() + timedelta(hours=2)
    job = Job.objects.get(pk=int(add.using_lease(deadline=when).enqueue(1, 1).id))
    assert job.deadline == when
    job = Job.objects.get(pk=int(add.using_lease(max_age=60).enqueue(1, 1).id))
    assert job.deadline - job.enqueued_at == timedelta(seconds=60)
    first = add.using_lease(unique_key="nightly", on_duplicate="merge").enqueue(2, 2)
    again = add.using_lease(unique_key="nightly", on_duplicate="merge").enqueue(3, 3)
    assert again.id == first.id and Job.objects.filter(unique_key="nightly").count() == 1
    for bad, named in (
        ({"on_duplicate": "ignore"}, "on_duplicate"),
        ({"max_age": -1}, "max_age"),
        ({"deadline": when.replace(tzinfo=None)}, "deadline"),
    ):
        with pytest.raises(InvalidTask, match=named):
            add.using_lease(**bad)


def test_an_enqueue_merged_into_the_job_holding_its_key_answers_that_job_as_it_stands():
    """(6) With on_duplicate="merge" nothing is enqueued when another job holds the key:
    the result is that job as it stands (running, claimed by its worker, with its own
    arguments; of the task that enqueued it), and no task_enqueued is sent. Before, the
    result said READY with the caller's task, and task_enqueued was sent again."""
    from tests.testapp.tasks import echo

    sent = []

    def enqueued(sender, task_result, **kwargs):
        sent.append(task_result.id)

    first = add.using_lease(unique_key="nightly", on_duplicate="merge").enqueue(2, 2)
    [claimed] = Job.objects.claim("merge-w", ["default"])
    assert str(claimed.pk) == first.id
    task_enqueued.connect(enqueued)
    try:
        again = add.using_lease(unique_key="nightly", on_duplicate="merge").enqueue(3, 3)
        other = echo.using_lease(unique_key="nightly", on_duplicate="merge").enqueue("x")
    finally:
        task_enqueued.disconnect(enqueued)
    assert sent == []
    for result in (again, other):
        assert result.id == first.id and result.status == TaskResultStatus.RUNNING
        assert result.args == [2, 2] and result.worker_ids == ["merge-w"]
        assert result.task.module_path == add.module_path and result.started_at is not None
    assert Job.objects.filter(unique_key="nightly").count() == 1


def test_a_requeued_jobs_result_counts_every_attempt_in_the_order_they_happened():
    """Django's TaskResult: worker_ids is the worker of each attempt in order, attempts is
    their count, errors[-1] the latest error. An operator's requeue starts the job's own
    count again (attempts 0, the next failure numbered 1 again): before, the waiting job
    read with no errors, the run after it left its worker out of worker_ids, and the
    errors came ordered by attempt number, the latest not last."""
    result = add.using_lease(max_attempts=2).enqueue(1, 2)

    def attempt(worker, message=None):
        [claim] = Job.objects.claim(worker, ["default"])
        if message is not None:
            assert Job.objects.fail(
                claim, exception_class_path="builtins.ValueError", message=message
            )
            Job.objects.filter(pk=claim.pk).retry_now()

    attempt("w1", "first")
    attempt("w2", "second")
    assert Job.objects.get(pk=int(result.id)).state == JobState.DEAD
    assert Job.objects.filter(pk=int(result.id)).requeue() == 1
    waiting = add.get_result(result.id)
    assert waiting.status == TaskResultStatus.READY
    assert waiting.worker_ids == ["w1", "w2"] and len(waiting.errors) == 2
    attempt("w3")
    running = add.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.worker_ids == ["w1", "w2", "w3"] and running.attempts == 3
    [claim] = Job.objects.filter(pk=int(result.id))
    assert Job.objects.fail(claim, exception_class_path="builtins.KeyError", message="third")
    failed = add.get_result(result.id)
    assert failed.worker_ids == ["w1", "w2", "w3"] and len(failed.errors) == 3
    assert failed.errors[-1].exception_class_path == "builtins.KeyError"
    assert [e.exception_class_path for e in failed.errors[:2]] == ["builtins.ValueError"] * 2
    # The failures' own order, which the admin's history and bulk reads use too.
    [loaded] = Job.objects.with_failures([int(result.id)])
    in_order = ["first", "second", "third"]
    assert [f.message for f in loaded.failures.all()] == in_order
    assert [f.message for f in JobFailure.objects.filter(job=loaded)] == in_order


def test_a_claim_given_back_unfinished_is_no_attempt_of_the_result():
    """A release (a worker's stop) does not count the attempt, and names no worker:
    claimed_by is cleared with it. Before, a job that failed once, then was claimed and
    released, read with the releasing worker among worker_ids (attempts 2)."""
    result = add.enqueue(1, 2)
    [claim] = Job.objects.claim("w1", ["default"])
    assert Job.objects.fail(claim, exception_class_path="builtins.ValueError", message="x")
    Job.objects.filter(pk=claim.pk).retry_now()
    [claim] = Job.objects.claim("w2", ["default"])
    assert add.get_result(result.id).worker_ids == ["w1", "w2"]
    assert Job.objects.release(claim)
    back = add.get_result(result.id)
    assert back.status == TaskResultStatus.READY
    assert back.worker_ids == ["w1"] and back.attempts == 1
    assert Job.objects.get(pk=claim.pk).claimed_by == ""


# -- issue 15.1: the task read back is the task enqueued ---------------------------------


ROUND_TRIP = ("run_after", "priority", "queue_name", "backend", "takes_context")


def _task_fields(task):
    return {name: getattr(task, name) for name in ROUND_TRIP}


@pytest.mark.django_db(databases=["default", "queue"])
def test_get_result_gives_back_the_task_as_enqueue_was_given_it():
    """run_after, priority, queue_name, backend and takes_context of the task read back
    (get_result, aget_result, refresh) equal those enqueue() was given."""
    from asgiref.sync import async_to_sync

    from tests.testapp.tasks import bulk_add, with_context

    later = timezone.now() + timedelta(hours=3)
    results = [
        send_receipt.using(run_after=later, priority=-7).enqueue(1),
        add.using(queue_name="reports").enqueue(1, 2),
        with_context.using(run_after=later).enqueue("k"),
        bulk_add.using(run_after=later, priority=100).enqueue(1, 2),
        *send_receipt.using(run_after=later).enqueue_many([((2,), {}), ((3,), {})]),
    ]
    for result in results:
        backend = task_backends[result.backend]
        again = backend.get_result(result.id)
        assert _task_fields(again.task) == _task_fields(result.task), result.task
        assert _task_fields(async_to_sync(backend.aget_result)(result.id).task) == _task_fields(
            result.task
        )
        assert again.task.func is result.task.func
    assert _task_fields(results[0].task)["run_after"] == later


def test_run_after_survives_a_retry_that_moves_the_due_time():
    """available_at moves with each retry; the task's run_after stays the caller's."""
    earlier = timezone.now() - timedelta(minutes=5)
    result = send_receipt.using(run_after=earlier).enqueue(4)
    [claim] = Job.objects.claim("w-retry", ["emails"])
    assert Job.objects.fail(claim, message="once", retry_in=600)
    job = Job.objects.get(pk=int(result.id))
    assert job.available_at > earlier + timedelta(minutes=9)
    again = send_receipt.get_result(result.id)
    assert (again.status, again.task.run_after) == (TaskResultStatus.READY, earlier)


def test_tasks_count_as_found_where_workers_import_them():
    """An app's tasks module, a module discovery imports in a tasks package, or a
    TASK_MODULES entry; not a sibling module that only starts with the same name, nor a
    module of a tasks package that discovery leaves out (its tests, a folder with no
    __init__.py) or a name under a plain module."""
    from types import SimpleNamespace

    from django.test import override_settings

    def declared_in(module):
        return SimpleNamespace(func=SimpleNamespace(__module__=module))

    registry.discover()
    assert registry.is_discovered(declared_in("tests.testapp.tasks"))
    assert registry.is_discovered(declared_in("tests.reportapp.tasks.summaries"))
    assert not registry.is_discovered(declared_in("tests.reportapp.tasks.tests"))
    assert not registry.is_discovered(declared_in("tests.reportapp.tasks.drafts.old"))
    assert not registry.is_discovered(declared_in("tests.testapp.tasks.emails"))
    assert not registry.is_discovered(declared_in("tests.testapp.tasks_old"))
    assert not registry.is_discovered(declared_in("tests.testapp.jobs"))
    with override_settings(
        TASKS={
            "default": {
                "BACKEND": "django_leases.backends.LeaseBackend",
                "OPTIONS": {"TASK_MODULES": ["tests.testapp.jobs"]},
            }
        }
    ):
        assert registry.is_discovered(declared_in("tests.testapp.jobs"))
        registry.discover()
        assert not registry.is_discovered(declared_in("tests.testapp.jobs.nightly"))


@pytest.mark.parametrize("retried", [False, True])
def test_a_claim_reads_as_its_taskresult_without_a_query_of_its_own(
    retried, django_assert_num_queries
):
    """Invariant 1 (one clock): the TaskResult a worker hands its handler is built from
    the claimed row itself, with the database's times, no query per job; a job claimed
    before costs one read of its failures for the whole batch. It matches get_result()."""
    result = add.enqueue(2, 3)
    backend = task_backends["default"]
    if retried:
        [first] = Job.objects.claim_rows("w-1")
        Job.objects.fail(first, message="boom", retry_in=0)
    [row] = Job.objects.claim_rows("w-2")
    with django_assert_num_queries(1 if retried else 0):
        built = backend.results_of_claims([row])[row.pk]
    read = backend.get_result(result.id)
    assert (built.status, built.args, built.worker_ids) == (
        TaskResultStatus.RUNNING,
        [2, 3],
        ["w-1", "w-2"] if retried else ["w-2"],
    )
    assert (built.started_at, built.last_attempted_at, built.enqueued_at) == (
        read.started_at,
        read.last_attempted_at,
        read.enqueued_at,
    )
    assert [e.traceback for e in built.errors] == [e.traceback for e in read.errors]
    assert len(built.errors) == (1 if retried else 0)
