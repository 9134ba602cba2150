"""Tasks the tests enqueue through django.tasks."""

from __future__ import annotations

import types
from typing import Any

import django
from django.tasks import task


@task
def add(a: int, b: int) -> int:
    return a + b


@task(backend="immediate")
def immediate_add(a: int, b: int) -> int:
    """Declared for Django's ImmediateBackend, which no worker serves: sent to a lease
    backend with using(backend=...), no lease backend declares it."""
    return a + b


@task(queue_name="emails", priority=10)
def send_receipt(order_id: int) -> str:
    return f"receipt {order_id}"


def not_a_task() -> None:
    """A module-level function that was never declared with @task."""


# -- tasks for the worker tests (tests/test_worker_*.py) --------------------------------


def _effect(key: str, phase: str) -> None:
    import os

    from django_leases.api import current_job

    from .models import Effect

    job = current_job()
    Effect.objects.create(
        key=key,
        job_id=job.job_id,
        fence=job.fence,
        worker_id=job.worker_id,
        pid=os.getpid(),
        phase=phase,
    )


@task
def record(key: str, first_seconds: float = 0.0, later_seconds: float = 0.0) -> dict:
    """Write a start effect, sleep (stopping at once if the claim is lost), write a done
    effect. The first claim sleeps ``first_seconds``, later claims ``later_seconds``."""
    from django_leases.api import current_job

    job = current_job()
    _effect(key, "start")
    job.sleep(first_seconds if job.fence == 1 else later_seconds)
    _effect(key, "done")
    return {"fence": job.fence, "worker": job.worker_id}


@task
def spawns(key: str, seconds: float, crash: bool = False) -> None:
    """Start a process of its own (a subprocess.run() of a tool, say) and wait, deaf to
    cancellation, or (``crash``) end its own process at once; the effect names the started
    process's pid."""
    import os
    import subprocess
    import time

    from django_leases.api import current_job

    from .models import Effect

    job = current_job()
    sleeper = subprocess.Popen(["sleep", str(seconds)])
    Effect.objects.create(
        key=key,
        job_id=job.job_id,
        fence=job.fence,
        worker_id=job.worker_id,
        pid=sleeper.pid,
        phase="start",
    )
    if crash:
        os._exit(3)
    time.sleep(seconds)


@task
def returns_when_told(key: str) -> dict:
    """Work until told the claim is going (a stop, a lost claim), then return a result as
    a handler that finishes its batch does, instead of raising LeaseLost."""
    import time

    from django_leases.api import current_job

    job = current_job()
    _effect(key, "start")
    while not job.lost:
        time.sleep(0.02)
    _effect(key, "done")
    return {"told": True}


@task
def stubborn(key: str, seconds: float) -> dict:
    """Ignore cancellation entirely, as a handler stuck in a C call would."""
    import time

    from django_leases.api import current_job

    _effect(key, "start")
    time.sleep(seconds)
    _effect(key, "done")
    return {"fence": current_job().fence}


@task
async def astubborn(key: str, seconds: float) -> dict:
    """An async handler deaf to cancellation: it blocks its own event loop, so the
    cancellation a lost claim sends is never delivered until it returns."""
    import time

    from asgiref.sync import sync_to_async

    from django_leases.api import current_job

    await sync_to_async(_effect)(key, "start")
    time.sleep(seconds)
    await sync_to_async(_effect)(key, "done")
    return {"fence": current_job().fence}


# What leave_behind() leaves running: the event loop holds its tasks weakly.
_LEFT_BEHIND: list[object] = []


@task
async def leave_behind(key: str, kind: str, seconds: float, then: str = "return") -> str:
    """Leave behind in its event loop what runs on ``seconds`` after it: a task that
    swallows its cancellation (``kind="task"``) or a run_in_executor() call it never
    awaits (``"executor"``); then return ``kind``, or raise ValueError (``then="raise"``)
    or SystemExit(3) (``then="exit"``, which leaves its task through the event loop)."""
    import asyncio
    import time

    from asgiref.sync import sync_to_async

    deadline = time.monotonic() + seconds

    async def deaf() -> None:
        while time.monotonic() < deadline:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue

    loop = asyncio.get_running_loop()
    if kind == "task":
        _LEFT_BEHIND.append(loop.create_task(deaf()))
    else:
        _LEFT_BEHIND.append(loop.run_in_executor(None, time.sleep, seconds))
    await asyncio.sleep(0)
    await sync_to_async(_effect)(key, "left")
    if then == "raise":
        raise ValueError(f"raised after leaving a {kind} behind")
    if then == "exit":
        raise SystemExit(3)
    return kind


@task
def ack_then_linger(key: str, seconds: float, heed: bool = True) -> None:
    """Acknowledge the job in its own fenced transaction, then go on (say, cleaning up) for
    ``seconds``, stopping at once should it be told its claim is lost (unless not ``heed``:
    then it is stopped only by its process's end)."""
    import time

    from django_leases.api import current_job
    from django_leases.fencing import fenced

    with fenced(ack=True, result={"acked": True}):
        _effect(key, "acked")
    if heed:
        current_job().sleep(seconds)
    else:
        time.sleep(seconds)
    _effect(key, "done")


@task
def hold(seconds: float, key: str = "") -> None:
    """Keep the claim for a while without touching the database (after a start effect,
    given a ``key``: the handler is connected and running)."""
    from django_leases.api import current_job

    if key:
        _effect(key, "start")
    current_job().sleep(seconds)


@task
def noop() -> None:
    return None


@task
async def async_record(key: str, seconds: float) -> dict:
    """An async handler: cancelled (CancelledError) when its claim is lost."""
    import asyncio

    from asgiref.sync import sync_to_async

    await sync_to_async(_effect)(key, "start")
    await asyncio.sleep(seconds)
    await sync_to_async(_effect)(key, "done")
    return {"done": True}


@task
def boom() -> None:
    raise ValueError("boom")


def build_report(name: str) -> str:
    """Decorated inside tests with per-task lease options (Django 6.1+ passes them through)."""
    return name


@task
def count_up(steps: int, pause: float) -> int:
    """Checkpoint a counter every ``pause`` seconds, resuming from the stored cursor."""
    import time

    from django_leases.api import current_job

    job = current_job()
    start = job.cursor or 0
    for i in range(start + 1, steps + 1):
        time.sleep(pause)
        job.checkpoint(i)
    return steps


class CardDeclined(Exception):
    """Retrying cannot help: the task lists it as non-retryable (Django 6.1+)."""


def declined() -> None:
    raise CardDeclined("card declined")


if django.VERSION >= (6, 1):
    charge_card = task(non_retryable=(CardDeclined,))(declined)


def _sleeps_on(key: str, seconds: float) -> None:
    """A handler that hangs, deaf to being told to stop (tests/test_worker_timeouts.py)."""
    import time

    _effect(key, "start")
    time.sleep(seconds)
    _effect(key, "done")


def _sleeps_on_for_good(key: str, seconds: float) -> None:
    """The same, for a task that lists HandlerTimeout as non-retryable."""
    _sleeps_on(key, seconds)


if django.VERSION >= (6, 1):
    from django_leases.exceptions import HandlerTimeout

    # Its own timeout, shorter than the backend's TIMEOUT_SECONDS in that test.
    hangs_briefly = task(timeout=1.5)(_sleeps_on)
    hangs_once = task(timeout=1.5, non_retryable=(HandlerTimeout,))(_sleeps_on_for_good)


@task
def refuse() -> None:
    from django_leases.exceptions import NonRetryable

    raise NonRetryable("the order was already refunded")


@task
def crash_worker() -> None:
    """Kill the whole worker process, as a segfaulting extension or an OOM kill would."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@task
def backfill(total: int, batch: int, pause: float) -> int:
    """Process items [cursor, total) in batches; each batch's rows and its checkpoint commit
    together in one fenced transaction, so a killed run resumes exactly where it stopped."""
    import time

    from django_leases.api import current_job
    from django_leases.fencing import fenced

    from .models import ItemLog

    job = current_job()
    start = (job.cursor or {}).get("next", 0)
    for lo in range(start, total, batch):
        hi = min(lo + batch, total)
        with fenced():
            ItemLog.objects.bulk_create([ItemLog(item=i, fence=job.fence) for i in range(lo, hi)])
            job.checkpoint({"next": hi})
        time.sleep(pause)
    return total


@task
def checkpoint_then_refuse(key: str) -> None:
    """Write an effect and checkpoint inside one fenced() block, then give up in it: the
    block rolls back, and the checkpoint with it, since it is part of the same transaction."""
    from django_leases.api import current_job
    from django_leases.exceptions import NonRetryable
    from django_leases.fencing import fenced

    with fenced():
        _effect(key, "fenced")
        current_job().checkpoint({"next": 1})
        raise NonRetryable("changed my mind")


@task
def mortal(key: str, seconds: float) -> None:
    """Restore SIGTERM's default action, as handler code with signal handling of its own
    may, then sleep: in process isolation a SIGTERM sent to the whole process group kills
    this child (it must run in a child's main thread)."""
    import signal

    from django_leases.api import current_job

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _effect(key, "start")
    current_job().sleep(seconds)
    _effect(key, "done")


@task
def late_fenced_write(key: str, seconds: float) -> None:
    """Ignore cancellation for ``seconds``, then write an effect inside fenced(): a handler
    whose claim was taken over meanwhile must commit nothing."""
    import time

    from django_leases.fencing import fenced

    time.sleep(seconds)
    with fenced():
        _effect(key, "fenced")


# -- tasks for the django.tasks API tests (tests/test_tasks_api.py) ---------------------


@task
def note(key: str, label: str) -> str:
    """Write an effect labelled ``label``: effects in id order are the order jobs ran in."""
    _effect(key, label)
    return label


@task
async def async_add(a: int, b: int) -> dict:
    """An async handler, run on the worker's own event loop for the job."""
    from django_leases.api import current_job

    job = current_job()
    return {"sum": a + b, "fence": job.fence, "worker": job.worker_id}


@task
async def async_orm_thread(key: str) -> str:
    """An async handler's ORM call (Django's async ORM, sync_to_async underneath): counts
    the effects of ``key`` and answers the name of the thread the count ran on."""
    import threading

    from asgiref.sync import sync_to_async

    from .models import Effect

    def count() -> str:
        Effect.objects.filter(key=key).count()
        return threading.current_thread().name

    await Effect.objects.filter(key=key).acount()
    return await sync_to_async(count)()


def _with_client(func: Any) -> Any:
    """A project's decorator that passes its function's first argument itself."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func("client", *args, **kwargs)

    return wrapper


@task
@_with_client
def injected(client: str, user_id: int) -> str:
    """Called as injected.enqueue(5): its decorator gives ``client``."""
    return f"{client}:{user_id}"


@task
async def async_nap(seconds: float) -> int:
    """Sleep past several heartbeat periods without blocking the worker; return the fence."""
    import asyncio

    from django_leases.api import current_job

    await asyncio.sleep(seconds)
    return current_job().fence


@task(takes_context=True)
def with_context(context, key: str) -> dict:
    """Report what the context shows: Django's TaskContext and the lease view."""
    import os

    from django.tasks import TaskContext

    from django_leases.api import current_job
    from django_leases.task import LeaseTaskContext

    job = context.job
    return {
        "key": key,
        "is_task_context": isinstance(context, TaskContext),
        "is_lease_context": isinstance(context, LeaseTaskContext),
        "attempt": context.attempt,
        "id": context.task_result.id,
        "status": str(context.task_result.status),
        "worker_ids": context.task_result.worker_ids,
        "same_handle": job is current_job(),
        "fence": job.fence,
        "lost": job.lost,
        "lease_left": job.lease_remaining > 0,
        "pid": os.getpid(),
    }


@task
def signalled(key: str, fail: bool = False) -> str:
    """Its task_started/task_finished are recorded as effects by _record_signal."""
    if fail:
        raise ValueError(f"{key} failed on purpose")
    return key


@task(backend="queue", queue_name="bulk")
def bulk_add(a: int, b: int) -> int:
    """A task of the "queue" backend, whose jobs live on the "queue" database."""
    return a + b


def _record_signal(sender, task_result, signal, **kwargs) -> None:
    """Record Django's task signals for ``signalled`` jobs as effects, in whichever process
    sends them (worker, or its child in process isolation)."""
    import os
    import sys

    from django_leases.api import current_job
    from django_leases.backends import LeaseBackend

    from .models import Effect

    if task_result.task.name != "signalled":
        return
    name = "started" if signal is task_started else "finished"
    phase = f"{name}:{task_result.status}"
    if sys.exc_info()[0] is not None:
        phase = f"{name}:{task_result.status}+exc"
    if sender is not LeaseBackend:
        phase = "wrong-sender"
    job = current_job()
    Effect.objects.create(
        key=task_result.args[0],
        job_id=int(task_result.id),
        fence=job.fence if job else -1,
        worker_id=job.worker_id if job else "",
        pid=os.getpid(),
        phase=phase,
    )


from django.tasks.signals import task_finished, task_started  # noqa: E402

task_started.connect(_record_signal, dispatch_uid="tests.testapp.record_task_started")
task_finished.connect(_record_signal, dispatch_uid="tests.testapp.record_task_finished")


# -- the chaos suite's workload (tests/chaos/) ------------------------------------------


@task
def chaos_job(key: str, kind: str = "quick", seconds: float = 0.1) -> dict:
    """Record the execution (unfenced, DB clock), work for ``seconds``, then apply the
    effect and acknowledge in one fenced transaction.

    kind "quick"/"long": cooperative (current_job().sleep stops at once on loss);
    "hog": blocks its thread with time.sleep, ignoring cancellation (thread isolation);
    "deaf": the same in process isolation, where the worker must kill it.
    """
    import logging
    import os
    import threading
    import time

    from django.db.models import F
    from django.db.models.functions import Now

    from django_leases.api import current_job
    from django_leases.exceptions import LeaseLost
    from django_leases.fencing import fenced, fenced_update

    from .models import ChaosLedger, ChaosRun, ChaosSlot

    log = logging.getLogger("tests.chaos.handler")
    job = current_job()
    stage = "record"
    try:
        # Inside the try: if the database is unreachable already, the handler ends here and
        # the checker must see that line, or it times the worker's later discard instead.
        run = ChaosRun.objects.create(
            job_id=job.job_id,
            key=key,
            kind=kind,
            fence=job.fence,
            worker_id=job.worker_id,
            pid=os.getpid(),
            local_start=time.time(),
        )
        stage = "work"
        if kind in ("hog", "deaf"):
            # Blocks without looking at the claim. Not time.sleep: under libfaketime (the
            # skewed workers) clock_nanosleep fails with EINVAL.
            threading.Event().wait(seconds)
        else:
            job.sleep(seconds)
        result = {"fence": job.fence, "worker": job.worker_id}
        stage = "fenced"
        with fenced(ack=True, result=result):
            ChaosLedger.objects.create(
                job_id=job.job_id, key=key, fence=job.fence, worker_id=job.worker_id
            )
            fenced_update(
                ChaosSlot.objects.filter(key=key),
                job.fence,
                applied=F("applied") + 1,
                worker_id=job.worker_id,
            )
            ChaosRun.objects.filter(pk=run.pk).update(db_end=Now())
    except LeaseLost:
        log.warning(
            "Chaos handler stopped job=%s fence=%s worker=%s stage=%s",
            job.job_id,
            job.fence,
            job.worker_id,
            stage,
            extra=_chaos_fields(job, f"chaos_stopped_{stage}"),
        )
        raise
    except Exception as e:
        # E.g. the database went away mid-transaction: the handler ends here, while its
        # outcome may wait in the worker (retried through database trouble) and be
        # discarded later. The checker times the handler's stop from this line.
        log.warning(
            "Chaos handler raised job=%s fence=%s worker=%s stage=%s error=%s",
            job.job_id,
            job.fence,
            job.worker_id,
            stage,
            type(e).__name__,
            extra=_chaos_fields(job, f"chaos_raised_{stage}"),
        )
        raise
    return result


def _chaos_fields(job: Any, event: str) -> dict[str, Any]:
    """The fields the chaos checker reads (tests/chaos/checks.py); the stage is in the
    event's name (chaos_stopped_fenced)."""
    return {"event": event, "job_id": job.job_id, "fence": job.fence, "worker": job.worker_id}


# -- a handler that keeps its thread busy in pure Python (tests/test_worker_fencing.py) ----


@task
def spin(key: str, seconds: float) -> dict:
    """Busy-loop in pure Python bytecode for ``seconds``: no sleep, no I/O, no look at the
    claim, so the thread never gives up the GIL on its own (the interpreter's switch
    interval is all the heartbeat thread gets). Writes a start and a done effect."""
    import time

    from django_leases.api import current_job

    _effect(key, "start")
    until = time.monotonic() + seconds
    loops = 0
    while time.monotonic() < until:
        loops += 1
    _effect(key, "done")
    return {"fence": current_job().fence, "loops": loops}


# -- handlers whose own code raises what a lost claim would (tests/test_worker_fencing.py) --


@task
def raise_lease_lost() -> None:
    """Raise LeaseLost on a claim that is still held (a misuse, or a library of its own
    reusing the name): an error like any other, not a loss."""
    from django_leases.exceptions import LeaseLost

    raise LeaseLost("raised by the handler, not by the worker")


@task
async def raise_cancelled() -> None:
    """Raise CancelledError on a claim still held (an inner timeout gone wrong)."""
    import asyncio

    raise asyncio.CancelledError("cancelled by the handler's own code")


# -- tasks for the hostile-enqueue tests (tests/test_enqueue_hostile.py) -----------------


@task
def echo(*args, **kwargs) -> dict:
    """Take any arguments and give them back."""
    return {"args": list(args), "kwargs": kwargs}


# -- hostile handlers: what user code may raise or return (tests/test_hostile_handlers.py) --


class HandlerExit(BaseException):
    """A BaseException of the project's own, as a framework's "abort" signal may be."""


class Outer:
    class InnerError(ValueError):
        """Nested: its qualname is Outer.InnerError, which no import_string() reaches."""


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of StrRaises raised")


class ReprRaises(Exception):
    def __str__(self) -> str:
        raise ValueError("no str either")

    def __repr__(self) -> str:
        raise ValueError("__repr__ of ReprRaises raised")


class StrNotStr(Exception):
    def __str__(self):  # noqa: PLE0307 -- hostile on purpose
        return 42


class _NamelessMeta(type):
    """Every look-up of the class's names raises."""

    def __getattribute__(cls, name: str):
        if name in ("__module__", "__qualname__", "__name__"):
            raise RuntimeError(f"no {name} for you")
        return super().__getattribute__(name)


class Nameless(Exception, metaclass=_NamelessMeta):
    pass


# Names no database column or import can take as they are.
BadNames = type(
    "BadNames",
    (Exception,),
    {"__module__": "tests.\x00nowhere\udfff", "__qualname__": "Bad\ud800Names"},
)


def _local_error() -> type[Exception]:
    class LocalError(ValueError):
        pass

    return LocalError


HOSTILE_EXCEPTIONS = (
    "RuntimeError",
    "ValueError",
    "SystemExit",
    "KeyboardInterrupt",
    "GeneratorExit",
    "HandlerExit",
    "Outer.InnerError",
    "LocalError",
    "StrRaises",
    "ReprRaises",
    "StrNotStr",
    "Nameless",
    "BadNames",
    "unpicklable",
    "cycle",
)
# What the worker records for each: the class's module.qualname, as it is (storable).
HOSTILE_EXCEPTION_PATHS = {
    "RuntimeError": "builtins.RuntimeError",
    "ValueError": "builtins.ValueError",
    "SystemExit": "builtins.SystemExit",
    "KeyboardInterrupt": "builtins.KeyboardInterrupt",
    "GeneratorExit": "builtins.GeneratorExit",
    "HandlerExit": "tests.testapp.tasks.HandlerExit",
    "Outer.InnerError": "tests.testapp.tasks.Outer.InnerError",
    "LocalError": "tests.testapp.tasks._local_error.<locals>.LocalError",
    "StrRaises": "tests.testapp.tasks.StrRaises",
    "ReprRaises": "tests.testapp.tasks.ReprRaises",
    "StrNotStr": "tests.testapp.tasks.StrNotStr",
    "Nameless": "tests.testapp.tasks.Nameless",
    "BadNames": "tests.\\x00nowhere\\udfff.Bad\\ud800Names",
    "unpicklable": "builtins.RuntimeError",
    "cycle": "builtins.RuntimeError",
}


def hostile_exception(kind: str, message: str) -> BaseException:
    """An exception of ``kind`` (one of HOSTILE_EXCEPTIONS) carrying ``message``."""
    import threading

    classes = {
        "RuntimeError": RuntimeError,
        "ValueError": ValueError,
        "SystemExit": SystemExit,
        "KeyboardInterrupt": KeyboardInterrupt,
        "GeneratorExit": GeneratorExit,
        "HandlerExit": HandlerExit,
        "Outer.InnerError": Outer.InnerError,
        "LocalError": _local_error(),
        "StrRaises": StrRaises,
        "ReprRaises": ReprRaises,
        "StrNotStr": StrNotStr,
        "Nameless": Nameless,
        "BadNames": BadNames,
    }
    if kind == "unpicklable":
        # A lock and a lambda among the args: pickle refuses both.
        return RuntimeError(message, threading.Lock(), lambda: None)
    if kind == "cycle":
        first, second = RuntimeError(message), ValueError("its cause")
        first.__cause__, second.__context__ = second, first
        return first
    return classes[kind](message)


def _text(codepoints: list[int], repeat: int) -> str:
    """A message built from code points (JSON arguments cannot carry lone surrogates or a
    NUL through every database, code points can), ``repeat`` times over."""
    return "".join(map(chr, codepoints)) * repeat


@task
def hostile_raise(key: str, kind: str, codepoints: list[int], repeat: int = 1) -> None:
    raise hostile_exception(kind, _text(codepoints, repeat))


@task
async def hostile_araise(key: str, kind: str, codepoints: list[int], repeat: int = 1) -> None:
    raise hostile_exception(kind, _text(codepoints, repeat))


@task
def hostile_raise_after_ack(key: str, kind: str, codepoints: list[int]) -> None:
    """Acknowledge the job in its own fenced transaction, then raise as hostile_raise does."""
    from django_leases.fencing import fenced

    with fenced(ack=True, result={"acked": key}):
        _effect(key, "acked")
    raise hostile_exception(kind, _text(codepoints, 1))


@task
def leave_transaction_after_ack(key: str) -> str:
    """Acknowledge the job in fenced(ack=True), then write inside an atomic block never
    exited and return."""
    from django.db import transaction

    from django_leases.fencing import fenced

    with fenced(ack=True, result={"acked": key}):
        _effect(key, "acked")
    transaction.atomic().__enter__()
    _effect(key, "left")
    return key


HOSTILE_RESULTS = (
    "object",
    "set",
    "bytes",
    "datetime",
    "deep",
    "bigint",
    "nan",
    "inf",
    "int_key",
    "surrogate",
    "nul",
    "str_subclass_reduce",
    "huge",
    "nameless",
    "dict_items_raise",
    "dict_items_interrupt",
    "huge_range",
)


class _Unreducible(str):
    def __reduce__(self):
        raise TypeError("cannot pickle me")


class _ItemsRaise(dict):
    def items(self):
        raise RuntimeError("items() of a hostile dict raised")


class _ItemsInterrupt(dict):
    def items(self):
        raise KeyboardInterrupt("items() of a hostile dict")


def hostile_value(kind: str, size: int = 3000) -> object:
    """A return value no JSON column stores as it is (except str_subclass_reduce, which
    JSON stores but pickle refuses)."""
    import datetime

    if kind == "deep":
        value: object = []
        for _ in range(size):
            value = [value]
        return value
    return {
        "object": lambda: object(),
        "set": lambda: {1, 2},
        "bytes": lambda: b"\x00\xff",
        "datetime": lambda: datetime.datetime(2026, 1, 1),
        "bigint": lambda: 10 ** max(size, 5000),
        "nan": lambda: float("nan"),
        "inf": lambda: [1, float("-inf")],
        "int_key": lambda: {"ok": {1: "one"}},
        "surrogate": lambda: {"text": "bad \ud800"},
        "nul": lambda: ["bad\x00"],
        "str_subclass_reduce": lambda: [_Unreducible("fine as JSON")],
        "huge": lambda: "x" * (9 * 2**20),
        "nameless": lambda: [Nameless("x")],
        "dict_items_raise": lambda: _ItemsRaise(a=1),
        "dict_items_interrupt": lambda: _ItemsInterrupt(a=1),
        # 48 bytes that a list would make 80 GB of: read no further than a document holds.
        "huge_range": lambda: range(10**10),
        # Not hostile: what django.utils.json.normalize_json (Django's own backends) stores.
        "utf8_bytes": lambda: "café".encode(),
        "range": lambda: range(3),
        "mapping": lambda: types.MappingProxyType({"a": (1, b"x")}),
    }[kind]()


@task
def hostile_return(key: str, kind: str, size: int = 3000) -> object:
    return hostile_value(kind, size)


@task
async def hostile_areturn(key: str, kind: str, size: int = 3000) -> object:
    return hostile_value(kind, size)


def _record_hostile_signal(sender, task_result, **kwargs) -> None:
    """Record task_finished of the hostile_* tasks as an effect: phase "finished:STATUS",
    and, for a failure, the last error's class path in worker_id. Then log it with the
    exception, as Django's own receiver does, through a handler that prints it: logging
    raises when it cannot format the exception, and the worker must survive that too."""
    import logging
    import os
    import sys

    from .models import Effect

    if not task_result.task.name.startswith("hostile_"):
        return
    errors = task_result.errors
    Effect.objects.create(
        key=task_result.args[0],
        job_id=int(task_result.id),
        fence=0,
        pid=os.getpid(),
        phase=f"finished:{task_result.status}",
        worker_id=errors[-1].exception_class_path[:200] if errors else "",
    )
    logging.getLogger("django_leases.tests").log(
        logging.ERROR if errors else logging.DEBUG,
        "hostile job %s finished",
        task_result.id,
        exc_info=sys.exc_info()[0] is not None,
    )


task_finished.connect(_record_hostile_signal, dispatch_uid="tests.testapp.record_hostile_finished")


@task
def fork_then(key: str, child: str) -> int:
    """Fork; the child returns (``return``) or raises (``raise``) out of the handler, the
    parent waits for it, records its exit status and returns it."""
    import os
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:
        _child_leaves(child)
        return -1
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    _effect(key, f"child:{status}")
    return status


def _child_leaves(how: str) -> None:
    """How a forked child leaves the handler: ``return``, ``raise``, ``exit`` (sys.exit()),
    or ``exit3`` (sys.exit(3))."""
    import sys

    if how == "raise":
        raise RuntimeError("raised in the forked child")
    if how.startswith("exit"):
        sys.exit(int(how[4:]) if how[4:] else None)


@task
async def fork_then_async(key: str, child: str) -> int:
    """fork_then, from an async handler."""
    import os

    from asgiref.sync import sync_to_async

    pid = os.fork()
    if pid == 0:
        _child_leaves(child)
        return -1
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    await sync_to_async(_effect)(key, f"child:{status}")
    return status


@task
def start_a_thread(key: str) -> str:
    """Start a thread that is no daemon and never ends, and return."""
    import threading
    import time

    def forever() -> None:
        while True:
            time.sleep(0.2)

    threading.Thread(target=forever, name=f"left-{key}", daemon=False).start()
    _effect(key, "ran")
    return key


@task
def receiver_exits(key: str, when: str) -> str:
    """Record the run; a receiver of ``when`` ("started" or "finished") raises SystemExit."""
    _effect(key, "ran")
    return key


def _exit_in_receiver(sender, task_result, signal, **kwargs) -> None:
    """A project's receiver that raises a BaseException (SystemExit) for receiver_exits."""
    if task_result.task.name != "receiver_exits":
        return
    name = "started" if signal is task_started else "finished"
    if task_result.args[1] == name:
        raise SystemExit(6)


task_started.connect(_exit_in_receiver, dispatch_uid="tests.testapp.exit_in_started")
task_finished.connect(_exit_in_receiver, dispatch_uid="tests.testapp.exit_in_finished")


@task
def hostile_checkpoint(key: str, cursor: object) -> str:
    """Checkpoint ``cursor``; a refusal by the database raises in the handler."""
    from django_leases.api import current_job

    current_job().checkpoint(cursor)
    return key


@task
def interruptible(key: str, seconds: float) -> None:
    """Put Python's own SIGINT handler back, as a handler with signal handling of its own
    may, then sleep: in process isolation Ctrl-C sent to the whole process group raises
    KeyboardInterrupt here (it must run in a child's main thread)."""
    import signal

    from django_leases.api import current_job

    signal.signal(signal.SIGINT, signal.default_int_handler)
    _effect(key, "start")
    current_job().sleep(seconds)
    _effect(key, "done")


@task
def leave_transaction(key: str, how: str) -> str:
    """Return with this thread's connection left inside a transaction: ``autocommit``
    turned off, an ``atomic`` block entered and never exited, or a ``begin`` of its own;
    or (``committed``) with autocommit left off after committing what it wrote."""
    from django.db import connection, transaction

    if how in ("autocommit", "committed"):
        transaction.set_autocommit(False)
    elif how == "atomic":
        transaction.atomic().__enter__()
    else:
        with connection.cursor() as cursor:
            cursor.execute("BEGIN")
    _effect(key, "left")
    if how == "committed":
        transaction.commit()  # autocommit stays off, but nothing is left uncommitted
    return key


@task
def meddle_with_the_interpreter() -> str:
    """Change what every thread of the process shares: a lower recursion limit, a longer
    switch interval, logging disabled (and the worker's loggers, by a logging set-up of
    its own), the working directory, an event loop policy whose loops are refused, a
    standard stream replaced by one closed, the other closed."""
    import asyncio
    import logging
    import logging.config
    import os
    import sys
    import tempfile

    sys.setrecursionlimit(400)
    sys.setswitchinterval(0.5)
    logging.disable(logging.WARNING)
    # A project's logging set up again from a handler: every existing logger disabled.
    logging.config.dictConfig({"version": 1})
    os.chdir(tempfile.mkdtemp())  # a relative SQLite NAME would now name another file

    class NoLoops(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            raise RuntimeError("this policy makes no loops")

    asyncio.set_event_loop_policy(NoLoops())  # every later async handler would fail
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- closed at once, as a handler might
    sys.stdout.close()
    sys.stderr.close()
    return "meddled"


@task
def close_stderr(key: str, seconds: float = 0.0, stream: str = "stderr") -> str:
    """Close the standard error stream (the worker's log stream in thread isolation), as
    ``sys.stderr`` or ``sys.__stderr__``, hold the claim ``seconds``, and return: the lines
    logged afterwards cannot be written."""
    import sys

    from django_leases.api import current_job

    getattr(sys, stream).close()
    _effect(key, "closed")
    current_job().sleep(seconds)
    return key


@task
def stop_own_worker(key: str, checkpoint: list[int] | None = None) -> None:
    """Save ``checkpoint`` as the cursor (if given), send SIGTERM to the worker running
    this job (its own process in thread isolation, the parent of its child in process
    isolation), then wait to be stopped: a job that ends every worker that runs it, as
    one whose memory gets its pod evicted does."""
    import multiprocessing
    import os
    import signal

    from django_leases.api import current_job

    if checkpoint is not None:
        current_job().checkpoint(checkpoint)
    _effect(key, "start")
    in_child = multiprocessing.parent_process() is not None
    os.kill(os.getppid() if in_child else os.getpid(), signal.SIGTERM)
    current_job().sleep(30)


@task
def returns_leaving_a_thread(key: str, seconds: float) -> str:
    """Return at once, leaving a thread that is no daemon running ``seconds``: a child
    process cannot exit before it ends."""
    import threading
    import time

    threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()
    _effect(key, "returned")
    return key


@task
def interpreter_settings() -> dict:
    """What the interpreter's shared settings are as this handler runs."""
    import logging
    import os
    import sys

    return {
        "recursion_limit": sys.getrecursionlimit(),
        "switch_interval": sys.getswitchinterval(),
        "logging_disabled": logging.root.manager.disable,
        "streams_closed": [sys.stdout.closed, sys.stderr.closed],
        "loggers_disabled": [
            logging.getLogger(name).disabled for name in ("django_leases.worker", "django.tasks")
        ],
        "cwd": os.getcwd(),
    }


@task
def add_raising_log_filter(key: str, seconds: float = 0.0) -> str:
    """Add a filter that raises to the worker's logger (shared in thread isolation), hold
    the claim ``seconds``, and return: every line the worker logs afterwards meets it."""
    import logging

    from django_leases.api import current_job

    def refuse(record: logging.LogRecord) -> bool:
        raise ValueError("a log filter that raises")

    logging.getLogger("django_leases.worker").addFilter(refuse)
    _effect(key, "filtered")
    current_job().sleep(seconds)
    return key


@task
def lower_recursion_limit(key: str, limit: int, seconds: float, lowered: str) -> str:
    """Lower the recursion limit (shared with the worker in thread isolation) to ``limit``,
    say so by creating the file ``lowered`` (no Python frame: a write to the database
    would not fit under the limit), and hold the claim ``seconds``: the main loop runs
    under that limit meanwhile."""
    import os
    import sys

    from django_leases.api import current_job

    _effect(key, "start")
    sys.setrecursionlimit(limit)
    os.close(os.open(lowered, os.O_CREAT | os.O_WRONLY))
    current_job().sleep(seconds)
    return key


@task
def hold_fenced(key: str, seconds: float) -> str:
    """Checkpoint inside one fenced() block and keep the block open ``seconds``: the job's
    row stays locked until it commits (batch work written in one long block)."""
    import time

    from django_leases.api import current_job
    from django_leases.fencing import fenced

    with fenced():
        current_job().checkpoint({"locked": True})
        _effect(key, "locked")
        time.sleep(seconds)
    return key
