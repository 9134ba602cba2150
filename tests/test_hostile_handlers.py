"""Hostile handlers: whatever user code raises or returns fails its job, never the worker.

Invariant 6 (user code is untrusted input) and 3 (nothing lost, nothing half-written),
through real run_lease_worker processes in both isolations, sync and async handlers: the
worker exits 0 from --burst, every poison job ends dead with one failure recording its
exception's module.qualname and a message and traceback every database stores, every good
job of the same batch succeeds, task_finished is sent once, with FAILED. The property test
at the end generates such batches with hypothesis.
"""

from __future__ import annotations

import itertools
import signal
import threading

import pytest
from django.db import connection
from django.tasks import TaskResultStatus, task_backends
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_leases.models import Job, JobFailure
from django_leases.states import TERMINAL_STATES, DeadReason, FailureKind, JobState
from django_leases.storable import (
    MESSAGE_LIMIT,
    TRACEBACK_LIMIT,
    class_path,
    describe_exception,
    readable_class_path,
    storable_text,
)
from tests.testapp import tasks as t
from tests.testapp.models import Effect
from tests.worker_helpers import ROOT, wait_for

# The worker tests: real processes need committed rows.
workers_db = pytest.mark.django_db(transaction=True)

ISOLATIONS = ["thread", "process"]
# A lease long enough that a loaded machine never lets one run out mid-test.
STEADY = ["--lease", "10", "--heartbeat", "1", "--poll", "0.2"]
_keys = itertools.count()


def _key(prefix: str) -> str:
    return f"{prefix}-{next(_keys)}"


def _escaped(text: str) -> str:
    """What the worker stores of ``text``: NUL and lone surrogates as backslash escapes."""
    return "".join(
        "\\x00" if c == "\x00" else f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c
        for c in text
    )


def _storable(text: str) -> bool:
    text.encode("utf-8")
    return "\x00" not in text


def _burst(workers, name: str, isolation: str, *extra: str) -> int:
    """Run one --burst worker with two slots over what is enqueued; its exit status."""
    worker = workers.start(
        name,
        *STEADY,
        "--burst",
        "--concurrency",
        "2",
        "--isolation",
        isolation,
        *extra,
        ready=False,
    )
    return worker.wait_exit(180)


def _result(result_id):
    """get_result() through the backend, whichever task the job runs."""
    return task_backends["default"].get_result(result_id)


def _finished_signals(job_id: int) -> list[tuple[str, str]]:
    """task_finished as the hostile_* receiver recorded it: (phase, last error class)."""
    return list(Effect.objects.filter(job_id=job_id).values_list("phase", "worker_id"))


def _assert_failed_once(
    result, path: str, message: str | None = None, reason: str = DeadReason.ATTEMPTS
):
    """The job ended dead after one attempt (for ``reason``), nothing half-written, with
    one failure of ``path`` whose text any database stores; task_finished was sent once,
    FAILED."""
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, reason, 1)
    assert job.result is None and job.claim_token is None and job.finished_at is not None
    failure = job.failures.get()
    assert (failure.kind, failure.exception_class_path) == (FailureKind.EXCEPTION, path)
    assert _storable(failure.message) and len(failure.message) <= MESSAGE_LIMIT
    assert _storable(failure.traceback) and 0 < len(failure.traceback) <= TRACEBACK_LIMIT
    if message is not None:
        assert failure.message == message
    assert _finished_signals(job.pk) == [("finished:FAILED", _readable(path))]
    return failure


def _readable(path: str) -> str:
    """The class path Django's API shows: the recorded one where import_string() reaches
    it, else its nearest base that it reaches, else Exception."""
    if path == "tests.testapp.tasks.Outer.InnerError":
        return "builtins.ValueError"
    if "<locals>" in path or "\\" in path:
        return "builtins.Exception"
    return path


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_whatever_a_handler_raises_fails_its_job_not_the_worker(workers, isolation):
    """Every hostile exception (a lone surrogate or NUL in its message, BaseException
    subclasses, a __str__/__repr__ that raises or returns no str, names that raise or no
    import reaches, unpicklable args, a cause/context cycle, a message far over the limit),
    sync and async: recorded with its module.qualname, storable text, the traceback; the
    good jobs beside them succeed; the worker exits 0 (6, 3)."""
    text = "bad \ud800 msg\x00end"
    codepoints = [ord(c) for c in text]
    poison = {}
    for kind in t.HOSTILE_EXCEPTIONS:
        poison[kind] = t.hostile_raise.using_lease(max_attempts=1).enqueue(
            _key(kind), kind, codepoints
        )
    for kind in ("RuntimeError", "SystemExit", "KeyboardInterrupt", "HandlerExit", "Nameless"):
        poison[f"async {kind}"] = t.hostile_araise.using_lease(max_attempts=1).enqueue(
            _key(kind), kind, codepoints
        )
    huge = t.hostile_raise.using_lease(max_attempts=1).enqueue(
        _key("huge"), "RuntimeError", codepoints, repeat=20_000
    )
    good = [t.add.enqueue(i, 1) for i in range(3)]

    assert _burst(workers, f"raise-{isolation}", isolation) == 0

    for name, result in poison.items():
        kind = name.removeprefix("async ")
        exc = t.hostile_exception(kind, text)
        # Unpicklable args print with their addresses, which differ in a child process.
        expected = None if kind == "unpicklable" else describe_exception(exc)[1]
        failure = _assert_failed_once(result, t.HOSTILE_EXCEPTION_PATHS[kind], expected)
        assert (
            "hostile_araise" if name.startswith("async") else "hostile_raise"
        ) in failure.traceback
        error = _result(result.id).errors[0]
        assert error.traceback == failure.traceback
        assert error.exception_class_path == _readable(failure.exception_class_path)
        assert issubclass(type(exc), error.exception_class)
    # The plain cases, by an oracle of their own: the text with its escapes.
    assert Job.objects.get(pk=poison["SystemExit"].id).failures.get().message == _escaped(text)
    assert _result(poison["SystemExit"].id).errors[0].exception_class is SystemExit
    assert _result(poison["LocalError"].id).errors[0].exception_class is Exception
    failure = _assert_failed_once(huge, "builtins.RuntimeError")
    assert len(failure.message) == MESSAGE_LIMIT and "characters in all" in failure.message
    assert failure.message.startswith(_escaped(text * 5))
    for i, result in enumerate(good):
        assert Job.objects.get(pk=result.id).result == i + 1


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_what_a_handler_raises_after_its_own_ack_leaves_the_job_succeeded(workers, isolation):
    """A handler that acknowledged its job in fenced(ack=True) and then raised (a hostile
    exception, a BaseException): its success is committed and stands, with no failure
    and one attempt; task_finished is sent once, SUCCESSFUL, as get_result() shows it
    (it was sent FAILED); the exception is logged as raised_after_ack naming its class;
    the worker exits 0 (6, 3)."""
    codepoints = [ord(c) for c in "after \ud800 ack"]
    raised = {
        kind: t.hostile_raise_after_ack.using_lease(max_attempts=1).enqueue(
            _key(kind), kind, codepoints
        )
        for kind in t.HOSTILE_EXCEPTIONS
    }
    good = t.add.enqueue(2, 3)
    worker = workers.start(
        f"after-ack-{isolation}",
        *STEADY,
        "--burst",
        "--concurrency",
        "2",
        "--isolation",
        isolation,
        ready=False,
    )
    assert worker.wait_exit(180) == 0
    for kind, result in raised.items():
        job = Job.objects.get(pk=result.id)
        key = job.args[0]
        assert (job.state, job.result, job.attempts) == (JobState.SUCCEEDED, {"acked": key}, 1)
        assert not job.failures.exists(), kind
        assert Effect.objects.filter(key=key, phase="acked").count() == 1
        done = _result(result.id)
        assert (done.status, done.return_value, done.errors) == (
            TaskResultStatus.SUCCESSFUL,
            {"acked": key},
            [],
        )
        signals = [s for s in _finished_signals(job.pk) if s[0].startswith("finished:")]
        assert signals == [("finished:SUCCESSFUL", "")], kind
        [logged] = worker.events("raised_after_ack", job_id=job.pk)
        assert logged["error"] == t.HOSTILE_EXCEPTION_PATHS[kind], logged
    assert Job.objects.get(pk=good.id).result == 5


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_return_value_that_cannot_be_stored_fails_as_type_error(workers, isolation):
    """Objects, sets, bytes that are not UTF-8, a range of 10**10 (read no further than a
    document holds), datetimes, 3,000-deep nesting, a 5,000-digit int, NaN, infinities,
    non-str keys, lone surrogates, NUL, 9 MiB of JSON, a dict whose items() raises (even
    KeyboardInterrupt): builtins.TypeError naming where in the value, task_finished FAILED,
    in both isolations; a str subclass whose pickling raises is stored as the plain string
    it is (6)."""
    # Where in the value, and what: the words are jsonsafe's, as for enqueue's arguments.
    where = {
        "object": ("result: ", "builtins.object"),
        "set": ("result: ", "builtins.set"),
        "bytes": ("result: ", "not UTF-8"),
        "datetime": ("result: ", "datetime.datetime"),
        "deep": ("result",),
        "bigint": ("result: ",),
        "nan": ("result: ", "nan"),
        "inf": ("result[1]: ", "-inf"),
        "int_key": ("result['ok'][1]",),
        "surrogate": ("result['text']: ",),
        "nul": ("result[0]: ", "NUL"),
        "huge": ("too large to store: result",),
        "nameless": ("result",),
        "dict_items_raise": ("result",),
        "dict_items_interrupt": ("result",),
        "huge_range": ("result: ", "holds more than 4,194,304 items"),
    }
    poison = {
        kind: t.hostile_return.using_lease(max_attempts=1).enqueue(_key(kind), kind)
        for kind in where
    }
    for kind in ("object", "deep", "bigint", "nan"):
        poison[f"async {kind}"] = t.hostile_areturn.using_lease(max_attempts=1).enqueue(
            _key(kind), kind
        )
    plain = t.hostile_return.enqueue(_key("plain"), "str_subclass_reduce")
    # What Django's own backends store (normalize_json) is stored so too.
    normalized = {
        kind: t.hostile_return.enqueue(_key(kind), kind)
        for kind in ("utf8_bytes", "range", "mapping")
    }
    good = t.add.enqueue(2, 3)

    assert _burst(workers, f"return-{isolation}", isolation) == 0

    for name, result in poison.items():
        failure = _assert_failed_once(result, "builtins.TypeError", reason=DeadReason.NON_RETRYABLE)
        assert failure.message.startswith("the task returned a value "), failure.message
        for words in where[name.removeprefix("async ")]:
            assert words in failure.message, (name, failure.message)
        assert _result(result.id).errors[0].exception_class is TypeError
    done = _result(plain.id)
    assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, ["fine as JSON"])
    assert _finished_signals(int(plain.id)) == [("finished:SUCCESSFUL", "")]
    assert {kind: _result(r.id).return_value for kind, r in normalized.items()} == {
        "utf8_bytes": "café",
        "range": [0, 1, 2],
        "mapping": {"a": [1, "x"]},
    }
    assert Job.objects.get(pk=good.id).result == 5


@workers_db
def test_an_unstorable_result_is_not_retried(workers):
    """The handler's work is done: running it again would repeat its effects only to
    return the same kind of value. With attempts left, the job is dead at once, its
    TypeError recorded, the handler run once (6, 3)."""
    result = t.hostile_return.using_lease(max_attempts=3).enqueue(_key("retry"), "set")
    assert _burst(workers, "retry", "thread") == 0
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.attempts, job.dead_reason) == (
        JobState.DEAD,
        1,
        DeadReason.NON_RETRYABLE,
    )
    assert job.failures.get().exception_class_path == "builtins.TypeError"


# -- the database refusing an owner's write --------------------------------------------


def _triggers(sql_by_vendor: dict[str, list[str]], drops: dict[str, list[str]]):
    """Create the triggers (after dropping any a crashed run left), drop them at the end.
    No parameters are passed, so no driver reads the % signs as placeholders."""
    with connection.cursor() as cursor:
        for statement in [*drops[connection.vendor], *sql_by_vendor[connection.vendor]]:
            cursor.execute(statement)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            for statement in drops[connection.vendor]:
                cursor.execute(statement)


@pytest.fixture
def refusing_database():
    """Triggers that make the database refuse, as a constraint would: a job UPDATE whose
    result holds "refuse-ack" or whose cursor holds "refuse-cursor", a failure INSERT
    whose traceback holds "refuse-failure" or whose message holds "refuse-all"."""
    from django_leases.models import JobFailure

    job, failure = Job._meta.db_table, JobFailure._meta.db_table
    q = connection.ops.quote_name
    on_job = f"NEW.result LIKE '%refuse-ack%' OR NEW.{q('cursor')} LIKE '%refuse-cursor%'"
    on_failure = "NEW.traceback LIKE '%refuse-failure%' OR NEW.message LIKE '%refuse-all%'"
    create = {
        "postgresql": [
            """CREATE OR REPLACE FUNCTION hostile_refuse_job() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN
              IF NEW.result::text LIKE '%refuse-ack%' OR NEW.cursor::text LIKE '%refuse-cursor%' THEN
                RAISE EXCEPTION 'refused by the test trigger' USING ERRCODE = '22000';
              END IF;
              RETURN NEW;
            END $$""",
            f"""CREATE OR REPLACE FUNCTION hostile_refuse_failure() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN
              IF {on_failure} THEN
                RAISE EXCEPTION 'refused by the test trigger' USING ERRCODE = '22000';
              END IF;
              RETURN NEW;
            END $$""",
            f"CREATE TRIGGER hostile_refuse_job BEFORE UPDATE ON {q(job)} "
            "FOR EACH ROW EXECUTE FUNCTION hostile_refuse_job()",
            f"CREATE TRIGGER hostile_refuse_failure BEFORE INSERT ON {q(failure)} "
            "FOR EACH ROW EXECUTE FUNCTION hostile_refuse_failure()",
        ],
        "mysql": [
            f"""CREATE TRIGGER hostile_refuse_job BEFORE UPDATE ON {q(job)} FOR EACH ROW
            BEGIN IF {on_job} THEN
              SIGNAL SQLSTATE '22000' SET MESSAGE_TEXT = 'refused by the test trigger';
            END IF; END""",
            f"""CREATE TRIGGER hostile_refuse_failure BEFORE INSERT ON {q(failure)} FOR EACH ROW
            BEGIN IF {on_failure} THEN
              SIGNAL SQLSTATE '22000' SET MESSAGE_TEXT = 'refused by the test trigger';
            END IF; END""",
        ],
        "sqlite": [
            f"""CREATE TRIGGER hostile_refuse_job BEFORE UPDATE ON {q(job)} WHEN {on_job}
            BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END""",
            f"""CREATE TRIGGER hostile_refuse_failure BEFORE INSERT ON {q(failure)}
            WHEN {on_failure} BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END""",
        ],
    }
    drop_both = [
        "DROP TRIGGER IF EXISTS hostile_refuse_job",
        "DROP TRIGGER IF EXISTS hostile_refuse_failure",
    ]
    drops = {
        "postgresql": [
            f"DROP TRIGGER IF EXISTS hostile_refuse_job ON {q(job)}",
            f"DROP TRIGGER IF EXISTS hostile_refuse_failure ON {q(failure)}",
            "DROP FUNCTION IF EXISTS hostile_refuse_job()",
            "DROP FUNCTION IF EXISTS hostile_refuse_failure()",
        ],
        "mysql": drop_both,
        "sqlite": drop_both,
    }
    yield from _triggers(create, drops)


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_write_the_database_refuses_ends_the_attempt_not_the_worker(
    workers, isolation, refusing_database
):
    """An ack whose result the database refuses fails the attempt with the database's
    error; a failure record it refuses is replaced by a minimal one; a checkpoint it
    refuses raises in the handler, which fails; none of it is taken for an outage and
    retried forever, and the good jobs beside them succeed (3, 6)."""
    ack = t.note.using_lease(max_attempts=1).enqueue(_key("ack"), "refuse-ack")
    failing = t.hostile_raise.using_lease(max_attempts=1).enqueue(
        _key("fail"), "RuntimeError", [ord(c) for c in "refuse-failure"]
    )
    cursor = t.hostile_checkpoint.using_lease(max_attempts=1).enqueue(
        _key("cursor"), {"note": "refuse-cursor"}
    )
    good = [t.add.enqueue(i, 10) for i in range(3)]

    assert _burst(workers, f"refused-{isolation}", isolation) == 0

    job = Job.objects.get(pk=ack.id)
    assert (job.state, job.attempts, job.result) == (JobState.DEAD, 1, None)
    failure = job.failures.get()
    assert failure.exception_class_path.startswith("django.db.utils."), failure.exception_class_path
    assert failure.message.startswith("the database refused the result: ")
    assert "refused by the test trigger" in failure.message

    job = Job.objects.get(pk=failing.id)
    assert (job.state, job.attempts) == (JobState.DEAD, 1)
    failure = job.failures.get()
    assert failure.exception_class_path == "builtins.RuntimeError"
    assert failure.traceback == ""
    assert failure.message.startswith("the database refused the failure record (django.db.utils.")
    assert failure.message.endswith("the message began: refuse-failure")

    job = Job.objects.get(pk=cursor.id)
    assert (job.state, job.attempts, job.cursor) == (JobState.DEAD, 1, None)
    assert job.failures.get().exception_class_path.startswith("django.db.utils.")
    for i, result in enumerate(good):
        assert Job.objects.get(pk=result.id).result == i + 10


@pytest.fixture
def disk_full_while_flagged():
    """A PostgreSQL trigger that fails a job's ack with SQLSTATE 53100 (disk_full) while
    the hostile_disk_full table holds a row: a server short of a resource for a while.
    Each refusal takes a number of the sequence hostile_disk_full_tries (never rolled
    back), so a test counts the worker's tries, which its log tells in few lines."""
    if connection.vendor != "postgresql":
        pytest.skip("a trigger raising a SQLSTATE of our choosing needs PostgreSQL")
    q = connection.ops.quote_name
    job = q(Job._meta.db_table)
    create = {
        "postgresql": [
            "CREATE TABLE hostile_disk_full (id integer)",
            "INSERT INTO hostile_disk_full VALUES (1)",
            "CREATE SEQUENCE hostile_disk_full_tries",
            """CREATE OR REPLACE FUNCTION hostile_disk_full() RETURNS trigger
        LANGUAGE plpgsql AS $$ BEGIN
          IF NEW.state = 'succeeded' AND EXISTS (SELECT 1 FROM hostile_disk_full) THEN
            PERFORM nextval('hostile_disk_full_tries');
            RAISE EXCEPTION 'disk full, says the test trigger' USING ERRCODE = '53100';
          END IF;
          RETURN NEW;
        END $$""",
            f"CREATE TRIGGER hostile_disk_full BEFORE UPDATE ON {job} "
            "FOR EACH ROW EXECUTE FUNCTION hostile_disk_full()",
        ]
    }
    drops = {
        "postgresql": [
            f"DROP TRIGGER IF EXISTS hostile_disk_full ON {job}",
            "DROP FUNCTION IF EXISTS hostile_disk_full()",
            "DROP TABLE IF EXISTS hostile_disk_full",
            "DROP SEQUENCE IF EXISTS hostile_disk_full_tries",
        ]
    }
    yield from _triggers(create, drops)


def _disk_full_refusals() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM hostile_disk_full_tries"
        )
        return cursor.fetchone()[0]


@workers_db
def test_a_server_short_of_a_resource_is_waited_out_not_held_against_the_ack(
    workers, disk_full_while_flagged
):
    """An ack failing with SQLSTATE 53100 (disk full) over a connection that still answers
    is an outage, however often it repeats: the worker sends it again until the server
    has room, and the job that succeeded ends succeeded, not as a failed attempt (3)."""
    from django_leases.worker.settling import WRITE_STRIKES

    result = t.add.using_lease(max_attempts=1).enqueue(4, 4)
    worker = workers.start("disk-full", *STEADY, "--burst", ready=False)
    wait_for(
        lambda: _disk_full_refusals() > WRITE_STRIKES,
        90,
        "the ack to fail more often than the strikes allow",
    )
    # Told in fewer lines than tries: when it starts, then once a minute (repeats).
    lines = [r for r in worker.events("db_trouble") if "disk full, says the test" in r["error"]]
    assert 1 <= len(lines) < _disk_full_refusals(), worker.log()[-3000:]
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM hostile_disk_full")
    assert worker.wait_exit(120) == 0
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.result, job.failures.count()) == (JobState.SUCCEEDED, 8, 0)


@workers_db
def test_a_failure_the_database_refuses_even_minimal_leaves_the_job_to_its_lease(
    workers, refusing_database
):
    """When the database refuses even the minimal failure record, the worker lets the
    claim go and carries on; the job stays visibly claimed until its lease runs out, then
    the next claim records the attempt as expired and dead-letters it (3)."""
    result = t.hostile_raise.using_lease(max_attempts=1).enqueue(
        _key("all"), "RuntimeError", [ord(c) for c in "refuse-all"]
    )
    good = t.add.enqueue(1, 1)
    worker = workers.start("refused-all", *STEADY, "--burst", ready=False)
    assert worker.wait_exit(120) == 0
    assert worker.events("failure_dropped", job_id=result.id), worker.log()
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.failures.count()) == (JobState.CLAIMED, 0)
    assert Job.objects.get(pk=good.id).state == JobState.SUCCEEDED

    Job.objects.filter(pk=result.id).expire_now()
    assert _burst(workers, "refused-all-2", "thread") == 0
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.dead_reason) == (JobState.DEAD, DeadReason.ATTEMPTS)
    assert job.failures.get().kind == FailureKind.LEASE_EXPIRED


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_stop_signal_still_stops_the_worker(workers, isolation):
    """SystemExit and KeyboardInterrupt raised by handlers fail their jobs; SIGINT sent to
    the worker still stops it, releasing the job it runs (6)."""
    poison = [
        t.hostile_raise.using_lease(max_attempts=1).enqueue(_key(kind), kind, [120])
        for kind in ("SystemExit", "KeyboardInterrupt")
    ]
    worker = workers.start(
        f"stop-{isolation}", *STEADY, "--concurrency", "3", "--grace", "1", "--isolation", isolation
    )
    wait_for(
        lambda: Job.objects.filter(pk__in=[p.id for p in poison], state=JobState.DEAD).count() == 2,
        60,
        "the poison jobs to fail",
    )
    held = t.hold.enqueue(60)
    wait_for(lambda: Job.objects.get(pk=held.id).state == JobState.CLAIMED, 30, "the hold job")
    worker.signal(signal.SIGINT)
    assert worker.wait_exit(60) == 0
    job = Job.objects.get(pk=held.id)
    assert (job.state, job.attempts) == (JobState.PENDING, 0)


@workers_db
def test_sigint_to_every_process_releases_a_handler_that_reenabled_sigint(workers):
    """SIGINT sent to every process of the service at once (a cgroup-wide kill: a handler
    child leads its own process group, so a terminal's Ctrl-C does not reach it). A
    process-isolated handler that put Python's SIGINT handler back raises
    KeyboardInterrupt; the worker is stopping, so that is its stop, not the job's failure:
    the job is released, the attempt not counted, as when a child dies of the signal (3)."""
    result = t.interruptible.enqueue(_key("ctrl-c"), 60)
    worker = workers.start(
        "ctrl-c", *STEADY, "--isolation", "process", "--grace", "20", own_group=True
    )
    wait_for(
        lambda: Effect.objects.filter(job_id=result.id, phase="start").exists(),
        60,
        "the handler to start",
    )
    worker.signal_group(signal.SIGINT)
    assert worker.wait_exit(60) == 0
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.attempts, job.failures.count()) == (JobState.PENDING, 0, 0), (
        worker.log()[-3000:]
    )


# -- the property: hostile batches, generated ----------------------------------------

_codepoint = st.one_of(
    st.sampled_from([0, 0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0x1F600, 0x7F, 0xFFFF]),
    st.integers(0, 0x10FFFF),
)
_raise = st.tuples(
    st.just("raise"),
    st.sampled_from(t.HOSTILE_EXCEPTIONS),
    st.lists(_codepoint, max_size=12),
    st.one_of(st.just(1), st.integers(1_000, 30_000)),
    st.booleans(),
)
_return = st.tuples(
    st.just("return"),
    st.sampled_from([k for k in t.HOSTILE_RESULTS if k != "huge"]),
    st.integers(1_000, 6_000),
    st.booleans(),
)
_good = st.tuples(st.just("good"), st.integers(-(10**6), 10**6))
_batch = st.lists(st.one_of(_raise, _return, _good), min_size=4, max_size=8).map(
    lambda specs: [*specs, ("good", 7)]
)


def _enqueue(spec):
    if spec[0] == "raise":
        _, kind, codepoints, repeat, is_async = spec
        task = t.hostile_araise if is_async else t.hostile_raise
        return task.using_lease(max_attempts=1).enqueue(_key("p"), kind, codepoints, repeat)
    if spec[0] == "return":
        _, kind, size, is_async = spec
        task = t.hostile_areturn if is_async else t.hostile_return
        return task.using_lease(max_attempts=1).enqueue(_key("p"), kind, size)
    return t.add.using_lease(max_attempts=1).enqueue(spec[1], 1)


def _check(spec, result) -> None:
    if spec[0] == "good":
        assert Job.objects.get(pk=result.id).result == spec[1] + 1
        return
    if spec[0] == "return":
        if spec[1] == "str_subclass_reduce":
            assert Job.objects.get(pk=result.id).result == ["fine as JSON"]
            assert _finished_signals(int(result.id)) == [("finished:SUCCESSFUL", "")]
            return
        failure = _assert_failed_once(result, "builtins.TypeError", reason=DeadReason.NON_RETRYABLE)
        assert failure.message.startswith("the task returned a value that cannot be stored")
        return
    _, kind, codepoints, repeat, is_async = spec
    text = "".join(map(chr, codepoints)) * repeat
    expected = (
        None if kind == "unpicklable" else describe_exception(t.hostile_exception(kind, text))[1]
    )
    failure = _assert_failed_once(result, t.HOSTILE_EXCEPTION_PATHS[kind], expected)
    assert ("hostile_araise" if is_async else "hostile_raise") in failure.traceback


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_property_hostile_batches_never_hurt_the_worker(workers, isolation):
    """Generated batches of hostile exceptions (any class of the list, BaseException
    subclasses included, any code points, lone surrogates and NUL, messages up to 30 times
    the limit), hostile return values (nesting 1,000-6,000 deep, ints of thousands of
    digits, NaN, non-JSON objects) and good jobs, each batch run by one --burst worker:
    it exits 0, every poison job is dead with its one failure recorded as storable text,
    every good job succeeded, nothing half-written (6, 3)."""
    runs = itertools.count()

    @settings(
        max_examples=6,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_batch)
    def run(batch):
        results = [_enqueue(spec) for spec in batch]
        assert _burst(workers, f"prop-{isolation}-{next(runs)}", isolation) == 0
        for spec, result in zip(batch, results, strict=True):
            _check(spec, result)

    run()


# -- storable.py on its own: no worker, no database ------------------------------------

_text_strategy = st.lists(_codepoint, max_size=60).map(lambda cps: "".join(map(chr, cps)))


@settings(max_examples=200, deadline=None)
@given(_text_strategy, st.integers(1, 80), st.sampled_from([1, 3, 400]), st.booleans())
def test_property_storable_text_is_storable_and_keeps_what_fits(text, limit, repeat, keep_tail):
    """Any code points, any length: the text every database stores (no NUL, valid UTF-8),
    never over the limit, exactly the escaped text when that fits, else its head (and
    tail) around a note (6)."""
    text *= repeat
    limit = limit * 10
    stored = storable_text(text, limit, keep_tail=keep_tail)
    assert _storable(stored) and len(stored) <= limit
    if len(_escaped(text)) <= limit:
        assert stored == _escaped(text)
    else:
        assert "characters in all" in stored or len(stored) == limit


def test_class_paths_of_hostile_classes_are_read_past_their_metaclass():
    """module.qualname read from type's own slots: a metaclass whose names raise, names
    holding NUL or surrogates, a nested class, a builtin (6)."""
    assert class_path(SystemExit) == "builtins.SystemExit"
    assert class_path(t.Outer.InnerError) == "tests.testapp.tasks.Outer.InnerError"
    assert class_path(t.Nameless) == "tests.testapp.tasks.Nameless"
    assert class_path(t.BadNames) == t.HOSTILE_EXCEPTION_PATHS["BadNames"]
    assert _storable(class_path(t.BadNames))


def test_readable_class_paths_fall_back_to_the_nearest_importable_class():
    """What TaskError.exception_class imports: the class itself, else its nearest base
    that import_string() reaches, else Exception (6, issue 15)."""
    assert readable_class_path("builtins.KeyboardInterrupt") == "builtins.KeyboardInterrupt"
    assert (
        readable_class_path("tests.testapp.tasks.HandlerExit") == "tests.testapp.tasks.HandlerExit"
    )
    assert readable_class_path("tests.testapp.tasks.Outer.InnerError") == "builtins.ValueError"
    assert readable_class_path(t.HOSTILE_EXCEPTION_PATHS["LocalError"]) == "builtins.Exception"
    assert readable_class_path("os.path") == "builtins.Exception"  # not an exception class
    assert readable_class_path("os.NoSuchError") == "builtins.Exception"  # since removed
    # Past the modules loaded here: as recorded (Django's backends give it so), nothing
    # imported; exception_class imports it when asked.
    assert readable_class_path("no_such_module.Error") == "no_such_module.Error"
    assert readable_class_path("tests.testapp.unloaded.Error") == "tests.testapp.unloaded.Error"
    assert readable_class_path("a" * 250 + ".Error") == "builtins.Exception"  # cut to 255


def test_describing_a_hostile_exception_never_raises():
    """A cause/context cycle, a __str__ that raises, names that raise, a megabyte message:
    the description is storable and within the limits (6)."""
    for kind in t.HOSTILE_EXCEPTIONS:
        try:
            raise t.hostile_exception(kind, "m\x00\ud800" * 100_000)
        except BaseException as e:  # noqa: BLE001
            path, message, trace = describe_exception(e)
        assert path == t.HOSTILE_EXCEPTION_PATHS[kind]
        assert _storable(message) and len(message) <= MESSAGE_LIMIT
        assert _storable(trace) and len(trace) <= TRACEBACK_LIMIT
        assert "test_describing_a_hostile_exception_never_raises" in trace


def _wrapped(cause: Exception) -> Exception:
    """Django's OperationalError over a driver's ``cause``, as Django raises it."""
    from django.db import OperationalError

    error = OperationalError(*cause.args)
    error.__cause__ = cause
    return error


def test_contention_is_an_outage_not_a_refusal():
    """Lock and statement timeouts, deadlocks and serialization failures, a server short
    of disk, memory or connections, lost connections, as each driver raises them under
    Django's OperationalError, are retried like an outage; never counted against the
    write, which would fail a job that succeeded (3). A check constraint (MariaDB's 4025
    is an OperationalError in the driver, IntegrityError in Django), a trigger's SIGNAL
    and a value the column cannot hold are refusals; other codes are unknown (strikes)."""
    import sqlite3

    from django.db import IntegrityError, OperationalError

    from django_leases.worker.dberrors import (
        contention,
        error_kind,
        refused_by_database,
    )

    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5
    missing = sqlite3.OperationalError("no such table: x")
    missing.sqlite_errorcode = 1
    assert contention(_wrapped(busy)) and not contention(_wrapped(missing))
    assert contention(OperationalError(1205, "Lock wait timeout exceeded"))
    assert contention(OperationalError(1213, "Deadlock found"))
    assert not contention(OperationalError(1644, "refused by the test trigger"))
    assert not contention(OperationalError(1366, "Incorrect string value"))
    try:
        import psycopg.errors
    except ImportError:
        pass
    else:
        for cls in (
            psycopg.errors.LockNotAvailable,
            psycopg.errors.SerializationFailure,
            psycopg.errors.DeadlockDetected,
            psycopg.errors.QueryCanceled,
        ):
            assert contention(_wrapped(cls("x"))), cls
        assert not contention(_wrapped(psycopg.errors.StatementTooComplex("x")))
        for cls in (
            psycopg.errors.DiskFull,
            psycopg.errors.OutOfMemory,
            psycopg.errors.TooManyConnections,
            psycopg.errors.AdminShutdown,
            psycopg.errors.IoError,
            psycopg.errors.ConnectionFailure,
        ):
            assert error_kind(_wrapped(cls("x"))) == "outage", cls
        for cls in (psycopg.errors.DataException, psycopg.errors.CheckViolation):
            assert error_kind(_wrapped(cls("x"))) == "refusal", cls
        assert error_kind(_wrapped(psycopg.errors.StatementTooComplex("x"))) is None
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13
    ioerr = sqlite3.OperationalError("disk I/O error")
    ioerr.sqlite_errorcode = 10 | (3 << 8)  # SQLITE_IOERR_WRITE
    assert error_kind(_wrapped(full)) == error_kind(_wrapped(ioerr)) == "outage"
    assert error_kind(_wrapped(missing)) is None
    for code in (1040, 1205, 1213, 2002, 2003, 2006, 2013):
        assert error_kind(OperationalError(code, "x")) == "outage", code
    for code in (1264, 1292, 1366, 1406, 1644):
        assert error_kind(OperationalError(code, "x")) == "refusal", code
    assert error_kind(OperationalError(1105, "unknown")) is None
    assert refused_by_database(IntegrityError("check")) and not refused_by_database(_wrapped(busy))


def test_only_a_lost_connection_makes_the_slots_check_theirs():
    """(3) After a failover the slots check their kept connections before the next handler
    (dberrors.outage_met): a lost or killed connection counts; a deadlock, a lock or
    statement timeout, SQLite busy or a refused statement does not, or every slot would
    pay a round trip after each of a contended fleet's deadlocks."""
    import sqlite3

    from django.db import InterfaceError, OperationalError

    from django_leases.worker.dberrors import connection_lost

    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5
    assert connection_lost(InterfaceError("connection already closed"))
    assert not connection_lost(_wrapped(busy))
    for code, lost in (
        (2006, True),
        (2013, True),
        (1927, True),
        (1053, True),
        (1213, False),
        (1205, False),
        (1040, False),
    ):
        assert connection_lost(OperationalError(code, "x")) is lost, code

    class Psycopg2Error(Exception):  # psycopg2 names the code pgcode
        def __init__(self, pgcode):
            super().__init__("x")
            self.pgcode = pgcode

    assert connection_lost(_wrapped(Psycopg2Error("57P01")))
    assert connection_lost(_wrapped(Psycopg2Error(None)))  # "server closed the connection"
    assert not connection_lost(_wrapped(Psycopg2Error("40P01")))
    try:
        import psycopg
        import psycopg.errors
    except ImportError:
        return
    assert connection_lost(_wrapped(psycopg.OperationalError("the connection is closed")))
    assert connection_lost(_wrapped(psycopg.errors.AdminShutdown("terminating connection")))
    assert connection_lost(_wrapped(psycopg.errors.IdleSessionTimeout("x")))
    for cls in (
        psycopg.errors.DeadlockDetected,
        psycopg.errors.SerializationFailure,
        psycopg.errors.QueryCanceled,
        psycopg.errors.LockNotAvailable,
        psycopg.errors.TooManyConnections,
    ):
        assert not connection_lost(_wrapped(cls("x"))), cls


# -- what a failure row names is never imported ----------------------------------------


@workers_db
def test_a_failure_row_naming_a_module_never_imports_it(workers, tmp_path, monkeypatch):
    """A failure row's exception_class_path is a row's say-so: reading the result (here
    and in the worker, which reads earlier failures for task_started) resolves it only
    through modules already loaded, never imports the module it names, so a module that
    exits at import neither stops the worker nor the reader, and ``this`` prints nothing
    (6, 3)."""
    import sys

    from django_leases.models import JobFailure

    trap = tmp_path / "trap-imported"
    monkeypatch.setenv("LEASES_TRAP", str(trap))
    result = t.add.using_lease(max_attempts=3).enqueue(2, 3)
    Job.objects.filter(pk=result.id).update(attempts=2, fence=2)
    for attempt, path in ((1, "tests.testapp.trap_exit.Boom"), (2, "this.Zen")):
        JobFailure.objects.create(
            job_id=result.id,
            attempt=attempt,
            fence=attempt,
            kind=FailureKind.EXCEPTION,
            exception_class_path=path,
        )

    errors = _result(result.id).errors
    # As recorded, as Django's backends give them: neither module is loaded here, and
    # reading imports neither (exception_class would, when asked).
    assert [e.exception_class_path for e in errors] == ["tests.testapp.trap_exit.Boom", "this.Zen"]
    assert "tests.testapp.trap_exit" not in sys.modules and not trap.exists()
    assert "this" not in sys.modules

    worker = workers.start("row-paths", *STEADY, "--burst", "--isolation", "thread", ready=False)
    assert worker.wait_exit(120) == 0
    assert Job.objects.get(pk=result.id).state == JobState.SUCCEEDED
    assert not trap.exists()
    assert "Beautiful is better than ugly" not in worker.log()


# -- a handler that leaves its connection inside a transaction --------------------------


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_handler_that_leaves_a_transaction_open_fails_and_does_not_jam_the_slot(
    workers, isolation
):
    """A handler that returns with autocommit turned off, inside an atomic block it never
    exited, or after a BEGIN of its own: what it left uncommitted is rolled back (its slot's
    connection is closed before the next job runs on it, or its process ends), so its job
    did not do its work and fails naming TransactionLeftOpen, not succeeds with its writes
    gone. The next job's checkpoint commits, neither the main loop's ack nor the heartbeat
    waits on its locks, every job ends in its right state and --burst exits 0 (6, 3)."""
    hows = ["autocommit", "atomic"] + (["begin"] if connection.vendor != "mysql" else [])
    left, good = {}, []
    for how in hows:
        left[how] = t.leave_transaction.using_lease(max_attempts=1).enqueue(_key(how), how)
        good.append(
            t.hostile_checkpoint.using_lease(max_attempts=1).enqueue(_key("after"), {"after": how})
        )
    # Autocommit left off after a commit holds nothing: it succeeds, its write stands
    # (MariaDB answers @@in_transaction; MySQL cannot tell it from work left uncommitted:
    # it fails there).
    committed = t.leave_transaction.using_lease(max_attempts=1).enqueue(_key("c"), "committed")
    added = t.add.enqueue(4, 5)
    worker = workers.start(
        f"left-open-{isolation}",
        *STEADY,
        "--burst",
        "--concurrency",
        "1",
        "--isolation",
        isolation,
        ready=False,
    )
    assert worker.wait_exit(120) == 0
    for how, result in left.items():
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.result) == (JobState.DEAD, None), how
        result.refresh()
        [error] = result.errors
        assert error.exception_class_path == "django_leases.exceptions.TransactionLeftOpen", how
        assert "returned inside a transaction on database 'default'" in error.traceback, how
        # What it left uncommitted was rolled back with the connection.
        assert not Effect.objects.filter(key=job.args[0]).exists(), how
    for result in good:
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.cursor) == (JobState.SUCCEEDED, job.args[1])
    assert Job.objects.get(pk=added.id).result == 9
    job = Job.objects.get(pk=committed.id)
    on_mysql = connection.vendor == "mysql" and not connection.mysql_is_mariadb
    assert job.state == (JobState.DEAD if on_mysql else JobState.SUCCEEDED)
    assert Effect.objects.filter(key=job.args[0]).exists()


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_transaction_left_open_after_the_ack_is_logged(workers, isolation):
    """A handler that acknowledged its job in fenced(ack=True), then returned inside an
    atomic block: the job stays succeeded (its ack committed), what it wrote after the ack
    is rolled back with its connection, and the worker says so (left_open_after_ack
    naming the database) instead of dropping it without a word (6, 3)."""
    result = t.leave_transaction_after_ack.using_lease(max_attempts=1).enqueue(_key("ack"))
    worker = workers.start(
        f"open-after-ack-{isolation}",
        *STEADY,
        "--burst",
        "--isolation",
        isolation,
        ready=False,
    )
    assert worker.wait_exit(120) == 0
    job = Job.objects.get(pk=result.id)
    key = job.args[0]
    assert (job.state, job.result, job.attempts) == (JobState.SUCCEEDED, {"acked": key}, 1)
    assert Effect.objects.filter(key=key, phase="acked").count() == 1
    assert not Effect.objects.filter(key=key, phase="left").exists()
    [logged] = worker.events("left_open_after_ack", job_id=job.pk)
    assert logged["databases"] == ["default"], logged


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_child_a_handler_forked_ends_where_it_leaves_the_handler(workers, isolation):
    """A handler that forks, its child returning, raising or calling sys.exit() out of it:
    the child ends there with the status Python's exit would give (which its parent reads:
    sys.exit() is 0, not 1), and the job is what the parent did.
    In process isolation the child's return was reported as the job's result (its parent
    then raised); on a slot thread the child hung on the worker's locks, the parent's
    waitpid never returned and the job stayed claimed, renewed forever (6, 3)."""
    results = {
        (name, child): getattr(t, name).using_lease(max_attempts=1).enqueue(_key(child), child)
        for name in ("fork_then", "fork_then_async")
        for child in ("return", "raise", "exit", "exit3")
    }
    added = t.add.enqueue(1, 1)
    # One handler at a time: a fork while other threads run can leave the child waiting
    # on a lock one of them held (Python's DeprecationWarning; seen once in CI with eight
    # handlers forking at once). The worker's own threads are enough to show the child
    # ends where it leaves the handler.
    worker = workers.start(
        f"forks-{isolation}",
        *STEADY,
        "--burst",
        "--concurrency",
        "1",
        "--isolation",
        isolation,
        ready=False,
    )
    assert worker.wait_exit(120) == 0, worker.log()[-3000:]
    for (name, child), result in results.items():
        job = Job.objects.get(pk=result.id)
        status = {"return": 0, "raise": 1, "exit": 0, "exit3": 3}[child]
        assert (job.state, job.result) == (JobState.SUCCEEDED, status), (name, child)
        effects = Effect.objects.filter(key=job.args[0]).values_list("phase", flat=True)
        assert list(effects) == [f"child:{status}"], (name, child)
    assert Job.objects.get(pk=added.id).result == 2


@workers_db
def test_a_thread_a_handler_left_running_does_not_keep_the_worker_alive(workers):
    """A handler that starts a thread that is no daemon and never ends: Python waits for
    it at exit, so the stopped worker ("Worker stopped") lived on forever and --burst never
    ended. The thread gets the grace, then the process ends with its status, naming the
    thread (threads_left); the job succeeded (6)."""
    result = t.start_a_thread.enqueue(_key("thread"))
    worker = workers.start("thread-left", *STEADY, "--burst", "--grace", "1", ready=False)
    assert worker.wait_exit(60) == 0, worker.log()[-3000:]
    job = Job.objects.get(pk=result.id)
    assert job.state == JobState.SUCCEEDED
    [logged] = worker.events("threads_left")
    assert logged["threads"] == [f"left-{job.args[0]}"], logged


@workers_db
@pytest.mark.parametrize(
    ("isolation", "stream"),
    [("thread", "stderr"), ("thread", "__stderr__"), ("process", "stderr")],
)
def test_a_handler_that_closes_stderr_and_returns_succeeds_and_so_do_the_others(
    workers, isolation, stream
):
    """A handler that closed sys.stderr, held its claim, then returned; another job was
    claimed, run and acked meanwhile. Lines logged while sys.stderr was closed could not be
    written, and logging's report of that, written to sys.stderr too, raised ValueError out
    of the log call: in a child process the job was recorded as HandlerDied (exit status 1),
    its result lost and the job run again; in thread isolation the job beside it failed,
    or the main loop's own line about the other job raised and the worker ended, both jobs
    left claimed. Closing sys.__stderr__ (the stream the project's logging handler holds)
    turned each later line into a "Logging error" report. A handler closing it fails no
    job, ends no worker and loses no line (6)."""
    key = _key("stderr")
    closed = t.close_stderr.enqueue(key, 2.0, stream)
    worker = workers.start(
        f"stderr-{isolation}", *STEADY, "--concurrency", "2", "--isolation", isolation
    )
    wait_for(
        lambda: Effect.objects.filter(key=key, phase="closed").exists(),
        30,
        lambda: f"the handler to close sys.stderr: {worker.log()[-3000:]}",
    )
    beside = t.hold.enqueue(0)  # claimed, run and acked while sys.stderr is closed
    for result in (beside, closed):
        wait_for(
            lambda r=result: (
                Job.objects.get(pk=r.id).state in (JobState.SUCCEEDED, JobState.DEAD)
                or JobFailure.objects.filter(job_id=r.id).exists()
                or worker.proc.poll() is not None
            ),
            60,
            lambda: f"the jobs to end: {worker.log()[-3000:]}",
        )
    assert Job.objects.get(pk=closed.id).state == JobState.SUCCEEDED, worker.log()[-3000:]
    assert Job.objects.get(pk=closed.id).result == key
    assert Job.objects.get(pk=beside.id).state == JobState.SUCCEEDED
    assert not JobFailure.objects.filter(job_id__in=[closed.id, beside.id]).exists()
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(60) == 0
    assert "Logging error" not in worker.log(), worker.log()[-3000:]
    assert worker.events("stopped"), worker.log()[-3000:]


@workers_db
def test_a_log_filter_that_raises_added_by_a_handler_ends_no_worker_and_loses_no_line(workers):
    """A thread-isolated handler that added a filter that raises to the worker's logger
    made the main loop's next line raise: the worker died (exit 1), the job beside it and
    its own left claimed until their leases ran out, then counted as expired attempts. The
    worker's lines cannot raise: one logging cannot take is written as it is to stderr,
    with why, and every job ends as it would have (6)."""
    key = _key("filter")
    filtered = t.add_raising_log_filter.enqueue(key, 1.0)
    worker = workers.start("log-filter", *STEADY, "--concurrency", "2")
    wait_for(
        lambda: Effect.objects.filter(key=key, phase="filtered").exists(),
        30,
        lambda: f"the handler to add its filter: {worker.log()[-3000:]}",
    )
    beside = t.hold.enqueue(0)  # claimed, run and acked while the filter is in place
    for result in (beside, filtered):
        wait_for(
            lambda r=result: (
                Job.objects.get(pk=r.id).state == JobState.SUCCEEDED
                or worker.proc.poll() is not None
            ),
            60,
            lambda: f"the jobs to end: {worker.log()[-3000:]}",
        )
    assert Job.objects.get(pk=filtered.id).state == JobState.SUCCEEDED, worker.log()[-3000:]
    assert Job.objects.get(pk=beside.id).state == JobState.SUCCEEDED, worker.log()[-3000:]
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(60) == 0, worker.log()[-3000:]
    log = worker.log()
    assert "[not logged: ValueError: a log filter that raises]" in log, log[-3000:]
    # The worker's own last line, written as it is, with why.
    assert "INFO Worker stopped worker=log-filter [not logged: ValueError" in log, log[-3000:]


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_what_an_async_handler_leaves_running_does_not_keep_its_job_claimed(workers, isolation):
    """An async handler that returned (or raised) leaving in its event loop a task that
    swallows its cancellation, or a run_in_executor() call it never awaited: asyncio.run's
    teardown waited for them, and the job stayed claimed, renewed, for as long (a --burst
    worker never exited; stopped, the job was released to run again). The teardown is
    cut 2 s after the coroutine is done (async_teardown_cut): the outcome stands (3, 6)."""
    key = _key(f"left-{isolation}")
    left = {
        "task": t.leave_behind.enqueue(key, "task", 600),
        "executor": t.leave_behind.enqueue(key, "executor", 600),
    }
    raised = t.leave_behind.using_lease(max_attempts=1).enqueue(key, "task", 600, then="raise")
    # Leaves its task through the loop: the teardown's cancellation is not its outcome.
    exited = t.leave_behind.using_lease(max_attempts=1).enqueue(key, "task", 600, then="exit")
    worker = workers.start(
        f"left-{isolation}",
        *STEADY,
        "--burst",
        "--concurrency",
        "2",
        "--isolation",
        isolation,
        "--grace",
        "2",
        ready=False,
    )
    # The executor's thread outlives the run: the process ends without it after the grace.
    assert worker.wait_exit(120) == 0, worker.log()[-3000:]
    for kind, result in left.items():
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.result, job.attempts) == (JobState.SUCCEEDED, kind, 1), kind
    for result, error in ((raised, "builtins.ValueError"), (exited, "builtins.SystemExit")):
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.attempts) == (JobState.DEAD, 1), error
        assert job.failures.get().exception_class_path == error, worker.log()[-3000:]
    assert Job.objects.get(pk=raised.id).failures.get().message == (
        "raised after leaving a task behind"
    )
    cut = {line["job_id"] for line in worker.events("async_teardown_cut")}
    assert cut == {int(r.id) for r in (*left.values(), raised, exited)}, worker.log()[-3000:]
    if isolation == "thread":
        [left_running] = worker.events("threads_left")
        assert any(name.startswith("asyncio") for name in left_running["threads"]), left_running


@workers_db
def test_the_main_loop_raising_releases_the_jobs_at_once_and_exits_1(workers, tmp_path):
    """A thread-isolated handler that lowered the recursion limit while it ran made the
    main loop's next statement raise RecursionError: the worker died, its jobs left claimed
    until their leases ran out, then counted as expired attempts, the handler's own and the
    one beside it. Whatever the main loop raises, the limit is put back, the failure
    logged (loop_failed), and the stop that follows releases the jobs at once, attempts
    not counted; exit status 1, for a fresh worker (3, 6)."""
    key = _key("recursion")
    lowered = tmp_path / "lowered"
    low = t.lower_recursion_limit.enqueue(key, 35, 30, str(lowered))
    beside = t.hold.enqueue(30)
    # A slot left free: the loop goes on polling, under the limit.
    worker = workers.start("loop-fails", *STEADY, "--concurrency", "4", "--grace", "20")
    wait_for(lowered.exists, 30, lambda: f"the limit lowered: {worker.log()[-3000:]}")
    later = t.hold.enqueue(30)  # claimed under the lowered limit and released, or never
    assert worker.wait_exit(60) == 1, worker.log()[-3000:]
    log = worker.log()
    failed = worker.events("loop_failed")
    assert [f["error"] for f in failed] == ["builtins.RecursionError"], log[-3000:]
    for result in (low, beside, later):
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.attempts, job.claim_token) == (JobState.PENDING, 0, None), log[
            -3000:
        ]
    assert not JobFailure.objects.filter(job_id__in=[low.id, beside.id, later.id]).exists()
    assert worker.events("stopped"), log[-3000:]


@workers_db
def test_what_a_handler_changes_in_the_shared_interpreter_is_put_back_after_its_job(workers):
    """In thread isolation handlers share the worker's interpreter: one that lowered the
    recursion limit, lengthened the switch interval, disabled logging, set an event loop
    policy and closed the standard streams, and returned, left them so for the worker's
    threads and the jobs after it (a limit of 30 ended the worker with RecursionError, a
    switch interval of 30 s starved the heartbeat, a closed stderr ended it with "lost
    sys.stderr", a policy that makes no loops failed every later async job). They
    are put back after the job, logged (interpreter_restored): sys.stdout, replaced by a
    stream of its own then closed, is reopened; sys.stderr, closed, never was (its close()
    only flushes). The next job sees the worker's own, and the worker's lines go on (6)."""
    meddled = t.meddle_with_the_interpreter.enqueue()
    worker = workers.start("meddled", *STEADY, "--concurrency", "1")
    wait_for(lambda: worker.events("interpreter_restored"), 30, lambda: worker.log()[-3000:])
    after = t.interpreter_settings.enqueue()
    wait_for(lambda: Job.objects.get(pk=after.id).state == JobState.SUCCEEDED, 30, "the job after")
    async_after = t.async_add.enqueue(2, 3)
    wait_for(
        lambda: Job.objects.get(pk=async_after.id).state in TERMINAL_STATES,
        30,
        "the async job after",
    )
    assert Job.objects.get(pk=async_after.id).state == JobState.SUCCEEDED, worker.log()[-3000:]
    assert Job.objects.get(pk=after.id).result == {
        "recursion_limit": 1000,
        "switch_interval": 0.005,
        "logging_disabled": 0,
        "streams_closed": [False, False],
        "loggers_disabled": [False, False],
        "cwd": str(ROOT),
    }
    [restored] = worker.events("interpreter_restored")
    assert restored["job_id"] == int(meddled.id)
    assert restored["restored"] == [
        "recursion limit",
        "switch interval",
        "logging.disable",
        "logger django_leases.worker",
        "logger django.tasks",
        "working directory",
        "asyncio event loop policy",
        "sys.stdout",
    ]
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0, worker.log()[-3000:]
    assert worker.events("stopped"), worker.log()[-3000:]


def test_a_projects_own_standard_stream_is_left_to_it(monkeypatch):
    """A project that set sys.stdout to an object of its own (a tee with only write and
    flush): the guard read ``closed`` of it, raised AttributeError after every job, and
    that replaced the job's outcome with a worker error. A stream without ``closed`` is
    not a file the guard can reopen: left as it is, and a lower limit still put back."""
    import sys

    from django_leases.worker.interpreter import InterpreterGuard

    class Tee:
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    guard = InterpreterGuard()
    monkeypatch.setattr(sys, "stdout", Tee())
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(limit - 1)
        assert guard.restore() == ["recursion limit"]
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(sys.stdout, Tee)


def test_the_standard_streams_handlers_share_cannot_be_closed(monkeypatch):
    """In thread isolation sys.stderr is the worker's too: closed by a handler, logging's
    report of any line that failed raised out of the log call, the main loop's included.
    The process's own stream is swapped for one whose close() (its buffer's, its file's)
    only flushes, and the logging handlers that wrote to it write to that one; a stream
    the project or a test runner put there is left to it. Put back at the end, unless a
    handler closed the original meanwhile (6)."""
    import io
    import logging
    import sys

    from django_leases.worker.interpreter import keep_streams_open

    for closes_the_original in (False, True):
        # The process's own stderr, as the worker's has it: an object of this test's on
        # descriptor 2, which it may close.
        own = open(2, "w", closefd=False)  # noqa: SIM115 -- closed below
        monkeypatch.setattr(sys, "stderr", own)
        monkeypatch.setattr(sys, "__stderr__", own)
        theirs = io.StringIO()  # a replacement of the project's, or a test runner's
        monkeypatch.setattr(sys, "stdout", theirs)
        handler = logging.StreamHandler(own)
        failed: list[logging.LogRecord] = []
        monkeypatch.setattr(handler, "handleError", failed.append)
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "a line", None, None)
        put_back = keep_streams_open()
        try:
            kept = sys.stderr
            assert kept is not own and kept.fileno() == 2 and kept.name == "<stderr>"
            assert handler.stream is kept
            kept.close()
            kept.buffer.close()
            kept.buffer.raw.close()
            assert not kept.closed
            assert kept.write("") == 0
            if closes_the_original:
                own.close()
            handler.emit(record)
            assert not failed  # written, to kept
            assert sys.stdout is theirs
        finally:
            put_back()
        if closes_the_original:
            assert sys.stderr is kept and handler.stream is kept
        else:
            assert sys.stderr is own and handler.stream is own and not own.closed
        handler.close()
        own.close()


@workers_db
def test_run_lease_worker_called_in_a_projects_process_leaves_it_running():
    """A project's own code (a script, a test, a command of its own) that runs the worker
    with call_command() goes on after it returns, its own threads too: the end of a
    stopped worker's process (threads_left) is run_lease_worker's own process's alone (an
    earlier version ended any caller's process a grace later, with status 0) (6)."""
    import os
    import subprocess
    import sys

    from tests.worker_helpers import ROOT

    job = t.add.enqueue(2, 2)
    script = (
        "import threading, time, django\n"
        "django.setup()\n"
        "from django.core.management import call_command\n"
        "threading.Thread(target=time.sleep, args=(3,), name='callers-own').start()\n"
        "call_command('run_lease_worker', '--burst', '--grace', '0', '-v', '0')\n"
        "time.sleep(2.5)\n"
        "print('the caller went on')\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.worker_settings",
        "LEASES_WORKER_DB_NAME": connection.settings_dict["NAME"],
        "PYTHONPATH": str(ROOT),
    }
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stdout) == (0, "the caller went on\n"), run.stderr[-3000:]
    assert "threads_left" not in run.stderr and "Threads still run" not in run.stderr
    assert Job.objects.get(pk=job.id).result == 4


@workers_db
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_receiver_that_raises_system_exit_fails_no_job(workers, isolation):
    """A project's task_started or task_finished receiver that raises SystemExit (a
    BaseException, which Django's send_robust lets through): it is logged as
    receiver_raised and the job keeps its outcome. It failed the job (task_finished:
    after the handler's work was done, which then ran again at each retry) (6)."""
    results = {
        when: t.receiver_exits.using_lease(max_attempts=3).enqueue(_key(when), when)
        for when in ("started", "finished")
    }
    worker = workers.start(
        f"receiver-exits-{isolation}", *STEADY, "--burst", "--isolation", isolation, ready=False
    )
    assert worker.wait_exit(120) == 0
    for when, result in results.items():
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.attempts) == (JobState.SUCCEEDED, 1), when
        assert not job.failures.exists(), when
        assert Effect.objects.filter(key=job.args[0], phase="ran").count() == 1, when
        assert worker.events("receiver_raised", job_id=job.pk), when


@workers_db
def test_a_connection_that_broke_under_a_handler_is_no_transaction_left_open():
    """(6) A handler whose connection the server cut (it caught the OperationalError and
    returned) left no work behind: Django keeps the broken connection, libpq says its
    transaction status is UNKNOWN, and that is no open transaction to fail the job for
    (the tidy-up still closes it)."""
    if connection.vendor != "postgresql":
        pytest.skip("pg_terminate_backend cuts one session; the others have no such call")
    from django.db import OperationalError

    from django_leases.worker.running import _left_open

    started, cut, seen = threading.Event(), threading.Event(), []

    def handler():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                seen.append(cursor.fetchone()[0])
            started.set()
            cut.wait(30)
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
            except OperationalError:
                seen.append("cut")
            seen.append(connection.connection is not None)
            seen.append(_left_open())
        finally:
            connection.close()

    thread = threading.Thread(target=handler)
    thread.start()
    assert started.wait(30)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [seen[0]])
    cut.set()
    thread.join(30)
    assert seen[1:] == ["cut", True, []]


@workers_db
def test_a_mariadb_connection_that_broke_cannot_say_it_is_in_a_transaction():
    """(6) With autocommit off, MariaDB is asked @@in_transaction after a job; on a
    connection the server cut, that query raised, aborting the tidy-up before it closed the
    broken connection (every later job on the slot failed). It cannot tell (None): no
    work to fail the job for, and the tidy-up closes it."""
    if connection.vendor != "mysql" or not connection.mysql_is_mariadb:
        pytest.skip("@@in_transaction is MariaDB's")
    from django.db import connections

    from django_leases.worker.running import _in_transaction, left_in_transaction

    started, cut, seen = threading.Event(), threading.Event(), []

    def handler():
        conn = connections["default"]
        try:
            conn.set_autocommit(False)
            with conn.cursor() as cursor:
                cursor.execute("SELECT CONNECTION_ID()")
                seen.append(cursor.fetchone()[0])
            started.set()
            cut.wait(30)
            seen.append(_in_transaction(conn))
            seen.append(left_in_transaction(conn))
        finally:
            conn.close()

    thread = threading.Thread(target=handler)
    thread.start()
    assert started.wait(30)
    with connection.cursor() as cursor:
        cursor.execute(f"KILL {int(seen[0])}")
    cut.set()
    thread.join(30)
    assert seen[1:] == [None, True]


# -- a row holding a retry ladder nothing can read --------------------------------------


@workers_db
def test_a_row_whose_retry_ladder_cannot_be_read_ends_dead_naming_it(workers):
    """A retry ladder written straight into the table that Retry cannot read: the job ends
    dead as unrunnable with a failure naming ``retry``, its handler never run; the good
    jobs of the same batch succeed and the worker exits 0 (6, 3)."""
    poison = t.hostile_raise.using_lease(max_attempts=3).enqueue(
        _key("retry"), "RuntimeError", [ord("x")]
    )
    Job.objects.filter(pk=poison.id).update(retry={"delays": ["x"]})
    good = [t.add.enqueue(i, 20) for i in range(2)]
    worker = workers.start("bad-retry", *STEADY, "--burst", "--concurrency", "3", ready=False)
    assert worker.wait_exit(120) == 0
    job = Job.objects.get(pk=poison.id)
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, DeadReason.UNRUNNABLE, 1)
    failure = job.failures.get()
    assert failure.exception_class_path == "django_leases.exceptions.InvalidLeaseOption"
    assert failure.message.startswith("retry: "), failure.message
    assert _finished_signals(job.pk) == []  # never run
    for i, result in enumerate(good):
        assert Job.objects.get(pk=result.id).result == i + 20


@pytest.mark.django_db
def test_recording_a_failure_falls_back_to_the_default_ladder_for_a_bad_row():
    """fail() on a claim whose row holds a retry ladder nothing can read (written after
    the worker vetted it) records the attempt and schedules the next by the default
    ladder, rather than raising and leaving the claim unrecorded (3)."""
    job = Job.objects.enqueue("tests.testapp.tasks.add", [1, 2], max_attempts=3)
    Job.objects.filter(pk=job.pk).update(retry={"delays": ["x"]})
    (claim,) = Job.objects.claim("bad-ladder", ["default"], limit=1, lease=30)
    assert Job.objects.fail(claim, exception_class_path="builtins.RuntimeError", message="m")
    job.refresh_from_db()
    assert (job.state, job.attempts, job.failures.count()) == (JobState.PENDING, 1, 1)


# -- what a handler's text does to the worker's log --------------------------------------


@workers_db
@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_log_file_stays_text_whatever_a_handler_raises(workers, tmp_path, log_format):
    """A handler's exception whose message holds a lone surrogate and a NUL reaches the
    log in Django's FAILED line with its traceback: through a FileHandler in the worker's
    JSON format every line is written and parses; in its text format the file holds no
    NUL and is UTF-8, the two written as backslash escapes (6)."""
    text = "bad \ud800 msg\x00end"
    result = t.hostile_raise.using_lease(max_attempts=1).enqueue(
        _key("log"), "RuntimeError", [ord(c) for c in text]
    )
    log_file = tmp_path / f"worker.{log_format}.log"
    worker = workers.start(
        f"log-{log_format}",
        *STEADY,
        "--burst",
        ready=False,
        env_extra={
            "LEASES_WORKER_LOG_FILE": str(log_file),
            "LEASES_WORKER_LOG_FILE_FORMAT": log_format,
        },
    )
    assert worker.wait_exit(120) == 0
    assert Job.objects.get(pk=result.id).state == JobState.DEAD
    assert "Logging error" not in worker.log()
    data = log_file.read_bytes()
    assert b"\x00" not in data
    written = data.decode("utf-8")
    if log_format == "json":
        import json

        lines = [json.loads(line) for line in written.splitlines() if line.strip()]
        failed = [
            line for line in lines if (line["logger"], line["level"]) == ("django.tasks", "ERROR")
        ]
        assert len(failed) == 1 and text in failed[0]["exc_info"], failed
    else:
        assert "bad \\ud800 msg\\x00end" in written
