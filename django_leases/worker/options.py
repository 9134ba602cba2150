"""A worker's settings from what its caller asked for (run_lease_worker's options,
testing.run_burst()'s arguments), checked in one place before anything is claimed: a bad
one is an InvalidLeaseOption naming it, and both callers refuse the same values."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from .. import conf
from ..enqueue_options import checked_text
from ..exceptions import InvalidLeaseOption


def worker_kwargs(
    *,
    backend: str | None = None,
    queues: list[str] | None = None,
    all_queues: bool = False,
    lease: float | None = None,
    heartbeat: float | None = None,
    concurrency: int | None = None,
    poll: float | None = None,
    grace: float | None = None,
    max_jobs: int | None = None,
    worker_id: str | None = None,
    isolation: str = "thread",
    burst: bool = False,
    connect_handlers: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of Worker(...); None takes the backend's OPTIONS (the
    default). ``queues`` None serves the backend's QUEUES as Django reads them, every queue
    when they are empty or ``all_queues``."""
    alias = conf.lease_backend(backend)
    try:
        options = conf.get_options(alias)
    except InvalidLeaseOption as e:
        raise InvalidLeaseOption("backend", f"TASKS[{alias!r}]['OPTIONS'] {e}") from e
    if lease is not None:
        lease = conf.validate_lease(lease, "lease")
    if heartbeat is None:
        heartbeat = conf.worker_heartbeat(options, lease)
    heartbeat = conf.validate_heartbeat(
        heartbeat, lease if lease is not None else options.lease_seconds, "heartbeat"
    )
    # The ranges of the OPTIONS these override, checked by the same functions.
    return {
        "alias": alias,
        "database": options.database,
        "queues": _served(alias, queues, all_queues),
        "concurrency": options.concurrency
        if concurrency is None
        else conf.validate_concurrency(concurrency, "concurrency"),
        "isolation": isolation,
        "lease": lease,
        "heartbeat": heartbeat,
        "poll": options.poll_seconds if poll is None else conf.validate_poll(poll, "poll"),
        "burst": burst,
        "max_jobs": _max_jobs(max_jobs),
        "grace": options.grace_seconds if grace is None else conf.validate_grace(grace, "grace"),
        "worker_id": _worker_id(worker_id),
        "notify": options.notify,
        "listen_database": options.listen_database,
        "connect_handlers": connect_handlers,
    }


def _served(alias: str, queues: Any, all_queues: bool) -> list[str] | None:
    """The queues to claim from (None: every queue, a claim with no queue filter)."""
    declared = conf.served_queues(alias)
    if all_queues:
        return None
    if queues is not None and (isinstance(queues, str) or not isinstance(queues, list | tuple)):
        raise InvalidLeaseOption("queues", f"must be a list of queue names, got {queues!r}")
    served: list[str] | None = list(queues or ()) or declared
    if served is None:
        return None
    if "*" in served:
        # The worker's row records serving every queue as "*".
        raise InvalidLeaseOption(
            "queues",
            "'*' is no wildcard here (an unquoted * is expanded by the shell); use --all-queues",
        )
    for queue in served:
        checked_text("queues", queue, 100)  # as enqueue checks a queue_name
    unknown = [q for q in served if declared and q not in declared]
    if unknown:
        # No task of this backend can be enqueued there, so such a worker would idle forever.
        absent = "QUEUES" not in settings.TASKS[alias]
        raise InvalidLeaseOption(
            "queues",
            f"{unknown!r} not in TASKS[{alias!r}]['QUEUES'] ("
            + (f"absent, Django reads it as {declared!r}" if absent else ", ".join(declared or ()))
            + ")",
        )
    return list(dict.fromkeys(served))  # each once, in the order given


def _max_jobs(max_jobs: Any) -> int | None:
    if max_jobs is not None and (
        isinstance(max_jobs, bool) or not isinstance(max_jobs, int) or max_jobs < 1
    ):
        raise InvalidLeaseOption(
            "max_jobs", f"must be a whole number, at least 1, got {max_jobs!r}"
        )
    return max_jobs


def _worker_id(worker_id: Any) -> str | None:
    """None: the host's default (identity.default_worker_id)."""
    if worker_id is not None:
        checked_text("worker_id", worker_id, 200)
        # It names the worker in every log line and the admin: a blank one, or one with a
        # newline or another control character, would name nobody or split lines.
        if worker_id.strip() != worker_id or not worker_id.isprintable():
            raise InvalidLeaseOption(
                "worker_id",
                f"must be printable characters with no space at either end, got {worker_id!r}",
            )
    return worker_id  # type: ignore[no-any-return]
