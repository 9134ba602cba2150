"""The worker's log lines: one format for its own and Django's, takeovers named as such,
JSON for log shippers, and a project's LOGGING respected.

Real worker processes (tests/worker_settings.py; LEASES_WORKER_OWN_LOGGING=1 drops the
project's LOGGING so that the command installs its handler). Tests read the structured
fields of the JSON lines, not the wording.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_leases.models import JobFailure
from django_leases.states import FailureKind, JobState
from django_leases.worker import logs
from django_leases.worker.repeats import Trouble
from tests.testapp.tasks import add, boom, crash_worker, record
from tests.worker_helpers import FAST, LEASE, job_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

OWN_LOGGING = {"LEASES_WORKER_OWN_LOGGING": "1"}
STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) (\S+) ")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_djangos_task_lines_and_the_workers_share_one_stamped_format(workers, isolation):
    """Without a LOGGING of the project's, Django's "Task id=... state=..." lines and the
    worker's come out of one handler, each with its time, level and logger, whether the
    handler runs on a thread of the worker or in a child process, which writes Django's
    lines itself."""
    ok, bad = add.enqueue(1, 2), boom.enqueue()
    w = workers.start(
        "fmt-a",
        "--burst",
        "--poll",
        "0.2",
        "--isolation",
        isolation,
        verbosity=1,
        ready=False,
        env_extra=OWN_LOGGING,
        log_format="text",
    )
    assert w.wait_exit(timeout=30) == 0, w.log()
    lines = [line for line in w.log().splitlines() if line.strip() and not line.startswith(" ")]
    loggers = set()
    for line in lines:
        if line.startswith(("Traceback", "ValueError", "RuntimeError")) or not line[0].isdigit():
            continue  # the traceback under Django's ERROR line for the failed task
        m = STAMPED.match(line)
        assert m, line
        loggers.add(m.group(2))
    assert loggers == {"django.tasks", "django_leases.worker"}, loggers
    # At -v 1 a job that runs as it should has Django's two lines, naming its claim; the
    # worker's own claimed and acked lines are -v 2.
    for state in ("RUNNING", "SUCCESSFUL"):
        assert (
            f"django.tasks Task id={ok.id} path=tests.testapp.tasks.add state={state} "
            "fence=1 attempt=1 worker=fmt-a"
        ) in w.log()
    assert f"django.tasks Task id={bad.id}" in w.log()
    assert "Claimed job=" not in w.log() and "Acked job=" not in w.log()
    assert f"Failed job={bad.id} fence=1 worker=fmt-a" in w.log()


@pytest.mark.slow
def test_json_lines_carry_the_events_and_their_fields(workers):
    """--log-format json: one object per line with time, level, logger and message, and
    the structured fields (event, job_id, task, queue, worker, fence), Django's lines
    included."""
    result = add.enqueue(3, 4)
    w = workers.start(
        "json-a",
        "--burst",
        "--poll",
        "0.2",
        "--log-format",
        "json",
        ready=False,
        env_extra=OWN_LOGGING,
    )
    assert w.wait_exit(timeout=30) == 0, w.log()
    records = json_lines(w.log())
    for line in records:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    by_event = {r.get("event"): r for r in records}
    claimed = by_event["claimed"]
    assert claimed["job_id"] == int(result.id) and claimed["fence"] == 1
    assert (claimed["task"], claimed["queue"], claimed["worker"]) == (
        "tests.testapp.tasks.add",
        "default",
        "json-a",
    )
    assert by_event["acked"]["job_id"] == int(result.id)
    assert by_event["started"]["worker"] == "json-a"
    started = by_event["task_running"]
    assert (started["logger"], str(started["job_id"])) == ("django.tasks", result.id)
    assert by_event["task_successful"]["task"] == "tests.testapp.tasks.add"


@pytest.mark.slow
def test_a_retry_is_info_and_a_dead_letter_a_warning_naming_a_killing_signal(workers):
    """Invariant 3, visibly: a failed attempt that will run again is INFO `failed` with the
    attempt and its retry delay; the last one is a WARNING `dead_lettered` with the reason
    (before, both were the same INFO line). A process-isolated handler killed by a signal
    is recorded as killed by it, not as "exited with code -9"."""
    retried = boom.using_lease(max_attempts=2, retry=[0]).enqueue()
    killed = crash_worker.using_lease(max_attempts=1).enqueue()
    w = workers.start("dead-a", "--isolation", "process", "--burst", *FAST, ready=False)
    assert w.wait_exit(timeout=60) == 0, w.log()[-3000:]
    [failed] = w.events("failed", job_id=retried.id)
    assert (failed["level"], failed["attempt"], failed["retry_in"]) == ("INFO", 1, 0), failed
    assert failed["error"] == "builtins.ValueError", failed
    [dead] = w.events("dead_lettered", job_id=retried.id)
    assert (dead["level"], dead["attempt"], dead["reason"]) == ("WARNING", 2, "attempts"), dead
    [dead] = w.events("dead_lettered", job_id=killed.id)
    assert (dead["level"], dead["reason"], dead["error"]) == (
        "WARNING",
        "attempts",
        "django_leases.exceptions.HandlerDied",
    ), dead
    assert not w.events("failed", job_id=killed.id)
    failure = JobFailure.objects.get(job_id=int(killed.id))
    assert failure.message == (
        "handler process was killed by SIGKILL (out of memory, or kill -9) before returning"
    )


@pytest.mark.slow
def test_a_takeover_names_the_previous_owner_and_fence_and_the_lease_it_was_granted(workers):
    """A worker started with --lease 2 is killed; the next claim is logged as a takeover
    of worker a's claim at fence 1, and the lease_expired failure says the 2 s lease ran
    out, not the job's own 30 s (3)."""
    result = record.enqueue("takeover-log", first_seconds=60, later_seconds=0)
    a = workers.start("log-a", *FAST)
    a.wait_event("claimed", job_id=result.id)
    a.signal(signal.SIGKILL)
    a.wait_exit()
    b = workers.start("log-b", *FAST, env_extra=OWN_LOGGING)  # --log-format json
    wait_for(lambda: job_of(result).state == JobState.SUCCEEDED, LEASE + 15, "the takeover")
    takeover = next(r for r in json_lines(b.log()) if r.get("event") == "takeover")
    assert (takeover["job_id"], takeover["fence"], takeover["worker"]) == (
        int(result.id),
        2,
        "log-b",
    )
    assert (takeover["previous_worker"], takeover["previous_fence"]) == ("log-a", 1)
    assert takeover["lease"] == LEASE
    assert takeover["message"].startswith(f"Took over job={result.id} ")
    assert "from worker log-a (fence 1): its lease of 2 s ran out" in takeover["message"]
    [failure] = JobFailure.objects.filter(job_id=int(result.id))
    assert (failure.kind, failure.fence, failure.worker_id) == (
        FailureKind.LEASE_EXPIRED,
        1,
        "log-a",
    )
    assert failure.message == "lease of 2 s ran out before log-a acknowledged"
    b.signal(signal.SIGTERM)
    assert b.wait_exit() == 0


def test_a_takeover_of_a_lease_ended_early_says_so(caplog):
    """(3) A claim whose lease was ended early (expire_now(), testing.expire_lease(), the
    admin) is taken over with a line that says so, as its failure record does (before:
    "its lease of -0.5 s ran out")."""
    from types import SimpleNamespace

    from django_leases.worker.loop import Worker

    def took_over(lease):
        job = SimpleNamespace(
            pk=7,
            task_path="tests.testapp.tasks.add",
            queue_name="default",
            fence=2,
            attempts=2,
            max_attempts=3,
            was_state="claimed",
            was_claimed_by="a",
            was_fence=1,
            was_lease=lease,
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logs.WORKER_LOGGER):
            Worker._log_claim(SimpleNamespace(worker_id="b"), job)
        [record] = caplog.records
        assert (record.event, record.lease) == ("takeover", lease)
        return record.getMessage().partition("(fence 1): ")[2]

    assert took_over(-0.5) == "its lease was ended early"
    assert took_over(0.0) == "its lease was ended early"
    assert took_over(30.0) == "its lease of 30 s ran out"
    assert took_over(None) == "its lease was ended early"  # as its failure record says


def test_the_command_leaves_loggers_the_project_routes_alone():
    """A LOGGING that routes django.tasks (or "django", or the root) keeps its handlers
    and format; one that routes neither gets the worker's handler on both."""
    names = (logs.WORKER_LOGGER, logs.TASKS_LOGGER)
    saved = {
        n: (
            logging.getLogger(n).handlers[:],
            logging.getLogger(n).propagate,
            logging.getLogger(n).level,
        )
        for n in names
    }
    root_handlers = logging.getLogger().handlers[:]
    configured = logs.configured()  # what a process-isolated child would be given
    try:
        logging.getLogger().handlers = []  # pytest's own capture would count as routing
        for n in names:
            logging.getLogger(n).handlers = []
        routed = {
            "version": 1,
            "loggers": {"django": {"handlers": []}, "django_leases": {"handlers": []}},
        }
        with override_settings(LOGGING=routed):
            assert logs.configure(1) == []
        with override_settings(LOGGING={"version": 1, "loggers": {"django_leases": {}}}):
            assert logs.configure(1) == [logs.TASKS_LOGGER]
            assert logging.getLogger(logs.TASKS_LOGGER).propagate is False
            # Once is enough: a second call adds no second handler.
            assert logs.configure(1) == []
            assert len(logging.getLogger(logs.TASKS_LOGGER).handlers) == 1
    finally:
        logs._configured = configured
        logging.getLogger().handlers = root_handlers
        for n, (handlers, propagate, level) in saved.items():
            logging.getLogger(n).handlers = handlers
            logging.getLogger(n).propagate = propagate
            logging.getLogger(n).setLevel(level)


def test_the_json_formatter_writes_one_object_with_the_fields():
    record = logging.LogRecord(
        "django_leases.worker", logging.INFO, __file__, 1, "Acked job=%s", (7,), None
    )
    record.event, record.job_id, record.worker = "acked", 7, "w\u00e9"
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "Acked job=7"
    assert (parsed["event"], parsed["job_id"], parsed["worker"]) == ("acked", 7, "w\u00e9")
    assert parsed["time"].endswith("+00:00") and parsed["level"] == "INFO"


@pytest.mark.parametrize("formatter", [logs.JsonFormatter, logs.TextFormatter])
def test_a_traceback_in_a_log_line_is_cut_as_the_workers_messages_are(formatter):
    """(6) A handler's 2 MB message in Django's task_finished line (its exc_info) made a
    2 MB log line: cut to MESSAGE_LIMIT with its head and tail. The record keeps no cut
    traceback for the project's other handlers."""
    from django_leases.storable import MESSAGE_LIMIT

    try:
        raise ValueError("head " + "m" * 2_000_000 + " tail")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "django.tasks", logging.ERROR, __file__, 1, "Task id=%s", (7,), exc_info
    )
    line = formatter().format(record)
    assert len(line) < MESSAGE_LIMIT + 1000
    assert "Traceback (most recent call last)" in line and "characters in all, cut to" in line
    assert line.rstrip().endswith("m tail") or json.loads(line)["exc_info"].endswith("m tail")
    whole = logging.Formatter().format(record)
    assert len(whole) > 2_000_000 and whole.endswith("m tail")


# -- every event in one list -------------------------------------------------------------

PACKAGE = Path(logs.__file__).resolve().parent.parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def _is_worker_logger(node: ast.expr) -> bool:
    """``logger`` (each worker module's getLogger("django_leases.worker")) or a
    ``logging.getLogger(...)`` called in place."""
    if isinstance(node, ast.Name):
        return node.id == "logger"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "getLogger"
    )


def _fields_of(call: ast.Call) -> set[str]:
    """The names a logging call passes in ``extra=`` (a dict's keys, claim_fields()'s)."""
    extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
    if isinstance(extra, ast.Dict):
        return {k.value for k in extra.keys if isinstance(k, ast.Constant)}
    if isinstance(extra, ast.Call):
        return {"event", "job_id", "task", "queue", "worker", "fence"} | {
            k.arg for k in extra.keywords if k.arg
        }
    return set()


def _event_of(call: ast.Call) -> str | None:
    """The event a logging call passes in ``extra=``: a dict's "event" key or
    claim_fields()'s third argument; None if it passes none."""
    extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
    if isinstance(extra, ast.Dict):
        for key, value in zip(extra.keys, extra.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "event":
                return value.value if isinstance(value, ast.Constant) else None
    if (
        isinstance(extra, ast.Call)
        and isinstance(extra.func, ast.Name)
        and extra.func.id == "claim_fields"
        and len(extra.args) >= 3
        and isinstance(extra.args[2], ast.Constant)
    ):
        return extra.args[2].value
    return None


TROUBLE_PARAMETERS = set(inspect.signature(Trouble).parameters) - {"fields"}


def logging_calls() -> list[tuple[str, int, str | None, set[str]]]:
    """(file, line, event, fields) of every call of the worker's loggers in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and _is_worker_logger(node.func.value)
            ):
                where = str(path.relative_to(PACKAGE))
                if where == "worker/repeats.py" and _event_of(node) is None:
                    continue  # Trouble.warn(): it writes the events Trouble(...) names
                found.append((where, node.lineno, _event_of(node), _fields_of(node)))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Trouble"
            ):
                where, event = str(path.relative_to(PACKAGE)), node.args[0]
                name = event.value if isinstance(event, ast.Constant) else None
                # Its keywords other than its own parameters are fields of its lines.
                named = {k.arg for k in node.keywords if k.arg and k.arg not in TROUBLE_PARAMETERS}
                found.append(
                    (where, node.lineno, name, {"event", "worker", "repeats", "error"} | named)
                )
    return found


def test_every_log_call_names_an_event_of_the_one_documented_list():
    """Tests wait on events, not wording: so every line the worker can write carries an
    event (a constant), each is in logs.EVENTS, each of EVENTS is written somewhere (or is
    one of Django's task lines), and docs/worker.md lists exactly EVENTS."""
    calls = logging_calls()
    assert len(calls) > 40, calls  # the walk found the worker's calls
    unnamed = [(f, line) for f, line, event, _ in calls if event is None]
    assert not unnamed, f"log calls without extra={{'event': ...}}: {unnamed}"
    unlisted = [(f, line, event) for f, line, event, _ in calls if event not in logs.EVENTS]
    assert not unlisted, f"events missing from logs.EVENTS: {unlisted}"
    # A field the JSON format would not write is a fact no reader sees; one named as a
    # LogRecord attribute ("thread", "process", ...) makes logging raise.
    unwritten = [(f, line, fields - set(logs.FIELDS)) for f, line, _, fields in calls]
    assert not [u for u in unwritten if u[2]], f"fields missing from logs.FIELDS: {unwritten}"
    reserved = set(vars(logging.LogRecord("n", 0, "p", 0, "m", None, None))) | {"message"}
    assert not reserved & set(logs.FIELDS), reserved & set(logs.FIELDS)
    written = {event for _, _, event, _ in calls}
    djangos = {name for name in logs.EVENTS if name.startswith("task_")}
    assert set(logs.EVENTS) - written == djangos, "EVENTS lists events nothing writes"
    page = (PACKAGE.parent / "docs" / "worker.md").read_text(encoding="utf-8")
    table = page.split("| Event | Meaning |", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \| (.*) \|$", table, re.MULTILINE)
    assert documented == list(logs.EVENTS.items()), "docs/worker.md's table of events != EVENTS"


@pytest.mark.slow
def test_a_workers_records_each_name_a_listed_event(workers):
    """A worker that claims, renews, acks, fails, is told to stop and releases: each of its
    JSON records and Django's task lines names an event of EVENTS (records() checks it),
    and those of a job's life are there with their fields."""
    ok, bad, held = add.enqueue(2, 2), boom.enqueue(), record.enqueue("events", first_seconds=60)
    w = workers.start("events-a", *FAST, "--concurrency", "3", "--grace", "0")
    w.wait_event("acked", job_id=ok.id)
    w.wait_event("failed", job_id=bad.id)
    w.wait_event("renewed", worker="events-a", timeout=LEASE + 5)
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0
    records = w.records()
    assert records, w.log()
    seen = {r["event"] for r in records}
    assert {"started", "claimed", "acked", "failed", "renewed", "stopping", "released"} <= seen
    assert {"task_running", "task_successful", "task_failed", "stopped"} <= seen
    assert w.events("released", job_id=held.id, fence=1, worker="events-a")


def test_a_task_line_with_no_exception_prints_no_empty_traceback():
    """Django 6.0 (the oldest Django supported) logs every finished task with
    ``exc_info=sys.exc_info()``: with no exception, a "NoneType: None" line under each
    success, and an ``exc_info`` field in every JSON line. The worker's filter drops it."""
    import logging

    from django_leases.worker.logs import TaskSignalFields

    record = logging.LogRecord(
        "django.tasks",
        logging.INFO,
        __file__,
        1,
        "Task id=%s path=%s state=%s",
        ("7", "tests.testapp.tasks.add", "SUCCESSFUL"),
        (None, None, None),
    )
    assert TaskSignalFields().filter(record)
    assert record.exc_info is None
    assert "NoneType" not in logging.Formatter().format(record)


def test_a_repeated_trouble_is_told_when_it_starts_once_a_minute_and_when_it_ends(caplog):
    """A failure that repeats (the database down) is one line, then one per
    REPEAT_SECONDS with how many were held back (``repeats``), and its first success one
    ``trouble_over`` line with the count; a success without trouble says nothing."""
    from django_leases.worker.repeats import REPEAT_SECONDS, Trouble

    assert REPEAT_SECONDS == 60
    trouble = Trouble("renewal_failed", "rep-a")
    with caplog.at_level(logging.INFO, logger=logs.WORKER_LOGGER):
        trouble.over()
        for _ in range(3):
            trouble.warn("Renewal failed worker=%s", "rep-a", error="down")
        assert [(r.event, r.repeats) for r in caplog.records] == [("renewal_failed", 0)]
        trouble.every = 0  # the minute has passed
        trouble.warn("Renewal failed worker=%s", "rep-a", error="still down")
        trouble.over()
        trouble.over()
    first, later, over = caplog.records
    assert (later.repeats, later.error) == (2, "still down")
    assert later.getMessage() == "Renewal failed worker=rep-a (2 more since the last line)"
    assert (over.event, over.trouble, over.failures) == ("trouble_over", "renewal_failed", 4)
    assert over.levelno == logging.INFO and first.levelno == logging.WARNING


def test_a_schedule_whose_decision_keeps_failing_is_told_once_then_when_it_is_decided(caplog):
    """A schedule whose decision raises stays due, so every look (about one per poll)
    tries it again: each failure was a warning, a line a second per schedule for as long
    as it lasts. It is told as a trouble naming the schedule, over once this worker
    decides it; a look that decided others (this one skipped, another worker deciding
    it) leaves it on."""
    from types import SimpleNamespace

    from django_leases.worker.ticker import Ticker

    ticker = Ticker("default", "default", "tick-a", every=1.0)
    stuck, other = SimpleNamespace(name="stuck"), SimpleNamespace(name="other")
    with caplog.at_level(logging.INFO, logger=logs.WORKER_LOGGER):
        for _ in range(3):
            ticker._failed(stuck, ValueError("value out of range"))
            ticker._failed(other, ValueError("lock wait timeout"))
            ticker._decided(SimpleNamespace(name="third"))
        assert [(r.event, r.schedule) for r in caplog.records] == [
            ("schedule_failed", "stuck"),
            ("schedule_failed", "other"),
        ]
        ticker._failed(other, ValueError("lock wait timeout"))
        ticker._decided(stuck)
    over = caplog.records[-1]
    assert len(caplog.records) == 3, caplog.records
    assert (over.event, over.schedule, over.trouble, over.failures) == (
        "trouble_over",
        "stuck",
        "schedule_failed",
        3,
    )


def _line_logger(handler: logging.Handler) -> logging.Logger:
    logger = logging.Logger("django_leases.tests.lines")  # on no manager: nothing else sees it
    logger.addHandler(handler)
    return logger


def _reporting_handler(stream: io.StringIO) -> tuple[logs.LineHandler, list[str]]:
    """A LineHandler on ``stream`` whose handleError() notes the message of each record."""
    handler = logs.LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    reported: list[str] = []
    handler.handleError = lambda record: reported.append(record.getMessage())  # type: ignore[method-assign]
    return handler, reported


def _logged_while_held(handler: logs.LineHandler, *messages: str) -> None:
    """Log ``messages`` from other threads while this one holds the handler's lock, so
    that they wait; then let go: the one write carries them all."""
    logger = _line_logger(handler)
    handler.acquire()
    for message in messages:
        thread = threading.Thread(target=logger.warning, args=(message,))
        thread.start()
        thread.join()
    handler.release()


class _SlowStream(io.StringIO):
    """A stream whose writes take a while, GIL released: other threads pile up behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        time.sleep(0.0005)
        return super().write(text)


def test_lines_logged_from_many_threads_at_once_come_out_whole_once_and_in_order():
    """(6) At -v 1 ten handler threads log two lines per job each: the worker's handler
    formats outside its lock and the thread holding the lock writes every line waiting.
    Every line comes out once and whole, each thread's in its order, none left waiting
    when the last call returns, in fewer writes than lines."""
    stream = _SlowStream()
    handler = logs.LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _line_logger(handler)
    start = threading.Barrier(10)

    def log_lines(n: int) -> None:
        start.wait()
        for i in range(300):
            logger.warning("thread=%s line=%s", n, i)

    threads = [threading.Thread(target=log_lines, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3000
    for n in range(10):
        assert [line for line in lines if line.startswith(f"thread={n} ")] == [
            f"thread={n} line={i}" for i in range(300)
        ]
    assert stream.writes < len(lines)


def test_a_stalled_stream_holds_the_logging_threads_up_rather_than_filling_memory():
    """(6) Lines wait for the writer only up to BACKLOG: behind a stream that stalls (a pipe
    nobody reads), a thread then waits for the lock as the stock handler's did, so what
    waits stays bounded; once the stream moves on, every line is written."""

    class StalledStream(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.moving = threading.Event()

        def write(self, text: str) -> int:
            self.moving.wait(30)
            return super().write(text)

    stream = StalledStream()
    handler = logs.LineHandler(stream)
    handler.BACKLOG = 20
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _line_logger(handler)
    done = []

    def log_lines(n: int) -> None:
        for i in range(50):
            logger.warning("thread=%s line=%s", n, i)
        done.append(n)

    threads = [threading.Thread(target=log_lines, args=(n,), daemon=True) for n in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(handler._pending) <= handler.BACKLOG and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert done == []  # held up, not piling lines up
    assert handler.BACKLOG < len(handler._pending) <= handler.BACKLOG + len(threads)
    stream.moving.set()
    for thread in threads:
        thread.join(30)
    assert sorted(done) == [0, 1, 2, 3]
    assert len(stream.getvalue().splitlines()) == 200


def test_a_line_left_while_another_held_the_lock_is_written_when_it_is_let_go():
    """(6) logging.shutdown() and the interpreter guard take the handler's lock too, then
    flush, close or swap the stream: a line another thread left meanwhile stayed unwritten
    for good (the worker's last lines at exit). flush() writes what waits, and so does
    whoever lets go of the lock."""
    stream = io.StringIO()
    handler = logs.LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _line_logger(handler)

    def log_from_another_thread(message: str) -> None:
        thread = threading.Thread(target=logger.warning, args=(message,))
        thread.start()
        thread.join()

    handler.acquire()
    log_from_another_thread("left during a flush")
    assert stream.getvalue() == ""
    handler.flush()
    assert stream.getvalue() == "left during a flush\n"
    log_from_another_thread("left while held")
    handler.release()
    assert stream.getvalue() == "left during a flush\nleft while held\n"


def test_each_line_a_failed_write_drops_is_reported_with_its_own_record():
    """(6) One write carries several threads' lines: when the stream refuses it (a line it
    cannot encode: a project's own stream, strict where sys.stderr is not), each line is
    tried on its own, and each that cannot be written is reported with its own record (it
    reported the writer's record only, the others' lines dropped unsaid)."""

    class Refusing(io.StringIO):
        def write(self, text: str) -> int:
            if "refused" in text:
                raise UnicodeEncodeError("ascii", text, 0, 1, "ordinal not in range(128)")
            return super().write(text)

    stream = Refusing()
    handler, reported = _reporting_handler(stream)
    _logged_while_held(handler, "kept", "refused one", "kept too", "refused two")
    assert stream.getvalue() == "kept\nkept too\n"
    assert reported == ["refused one", "refused two"]


def test_a_stream_that_fails_after_taking_the_lines_gets_none_of_them_twice():
    """(6) A flush that fails after the write took the lines (a non-blocking stderr's
    BlockingIOError): the lines were written again one by one, unflushed, and nothing was
    reported. Each record is reported once, and no line is written twice."""

    class FailingFlush(io.StringIO):
        def flush(self) -> None:
            raise BlockingIOError("stderr would block")

    stream = FailingFlush()
    handler, reported = _reporting_handler(stream)
    _logged_while_held(handler, "one", "two")
    assert stream.getvalue() == "one\ntwo\n"
    assert reported == ["one", "two"]


@given(st.lists(st.floats(min_value=0, max_value=4_102_444_800), min_size=1, max_size=20))
@hypothesis_settings(max_examples=200, deadline=None)
def test_the_text_formats_time_as_loggings_own_formatter_does(created):
    """The text format keeps the last second it formatted (a burst of lines formats each
    second once): whatever the order the records come in, the time it writes is the one
    logging's Formatter writes, in a zone with summer time too."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    try:
        ours, stock = logs.TextFormatter("%(asctime)s"), logging.Formatter("%(asctime)s")
        for stamp in [*created, 1_711_846_799.5, 1_711_846_800.25, created[0]]:
            record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
            record.created, record.msecs = stamp, (stamp - int(stamp)) * 1000 // 1
            assert ours.format(record) == stock.format(record)
    finally:
        if saved is None:
            os.environ.pop("TZ")
        else:
            os.environ["TZ"] = saved
        time.tzset()


def test_the_workers_log_calls_never_raise_and_lose_no_line(capfd):
    """(6) A filter that raises on the worker's logger (a thread-isolated handler may add
    one) made the worker's log call raise, out of its main loop. The line goes to
    descriptor 2 as it is, with why; a line whose exception cannot be formatted is logged
    without its traceback."""
    from django_leases.safe_logging import WorkerLogger

    name = "django_leases.worker.test_never_raising"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    underlying = logging.getLogger(name)
    underlying.addHandler(handler)
    underlying.setLevel(logging.INFO)

    def refuse(record: logging.LogRecord) -> bool:
        raise RuntimeError("a filter that raises")

    class Unformattable(Exception):
        def __str__(self) -> str:
            raise ValueError("no text")

    def no_traceback(record: logging.LogRecord) -> bool:
        if record.exc_info:
            raise ValueError("cannot format that traceback")
        return True

    logger = WorkerLogger(name)
    try:
        underlying.addFilter(refuse)
        logger.info("Acked job=%s worker=%s", 7, "w1", extra={"event": "acked"})
        underlying.removeFilter(refuse)
        assert "INFO Acked job=7 worker=w1 [not logged: RuntimeError: a filter that raises]" in (
            capfd.readouterr().err
        )
        underlying.addFilter(no_traceback)
        logger.warning("Raised job=%s", 8, exc_info=Unformattable())
        [record] = records
        assert (record.getMessage(), record.exc_info, record.funcName) == (
            "Raised job=8",
            None,
            "test_the_workers_log_calls_never_raise_and_lose_no_line",
        )
    finally:
        underlying.removeHandler(handler)
        underlying.filters.clear()
