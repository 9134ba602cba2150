"""What a claimed row must say before its handler is called.

Rows enqueued through the backend always pass (enqueue() refuses a task declared where
workers do not look). These checks catch rows written straight into
the table, or by an older deploy whose task took other arguments: such a row could never
succeed, so it ends dead at once with a message naming the field, instead of spending every
attempt on the same error or breaking the worker loop.
"""

from __future__ import annotations

import inspect
from typing import Any

UNKNOWN_TASK = "django_leases.exceptions.UnknownTask"
INVALID_ARGUMENT = "django_leases.exceptions.InvalidJobArgument"
INVALID_OPTION = "django_leases.exceptions.InvalidLeaseOption"


def unrunnable(job: Any, task: Any, alias: str) -> tuple[str, str] | None:
    """(exception class path, message) when ``job`` cannot be run as ``task``; else None."""
    if task is None:
        return UNKNOWN_TASK, (
            f"{job.task_path!r} is not a task declared for backend {alias!r}; its dotted path is "
            "never imported on a row's say-so. If it is a @task, declare it in an installed "
            f"app's tasks module or list its module in TASKS[{alias!r}]['OPTIONS']['TASK_MODULES'], "
            "then restart the workers and requeue the job."
        )
    if not isinstance(job.args, list):
        return INVALID_ARGUMENT, f"args: must be a JSON array, the row holds {_shown(job.args)}"
    if not isinstance(job.kwargs, dict):
        return (
            INVALID_ARGUMENT,
            f"kwargs: must be a JSON object, the row holds {_shown(job.kwargs)}",
        )
    if job.retry:
        from ..retry import Retry

        try:
            Retry.from_json(job.retry)
        except Exception as e:  # noqa: BLE001 -- InvalidLeaseOption, or TypeError from its parts
            return INVALID_OPTION, (
                f"retry: cannot be read as a retry ladder, the row holds {_shown(job.retry)}: {e}"
            )
    try:
        signature = inspect.signature(task.func)
    except (TypeError, ValueError):  # a builtin or C function: let the call decide
        return None
    context = [None] if task.takes_context else []
    try:
        signature.bind(*context, *job.args, **job.kwargs)
    except TypeError as e:
        return INVALID_ARGUMENT, f"args/kwargs: do not fit {job.task_path}{signature}: {e}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
