"""Call a task's function for one claim, in whichever thread or process runs it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from typing import Any

from ..api import JobHandle
from ..exceptions import LeaseLost, NonRetryable
from .claims import Outcome


def run_task(task: Any, args: list[Any], kwargs: dict[str, Any], handle: JobHandle,
             context: Any = None) -> Outcome:
    """Run ``task`` with ``handle`` as current_job(); never raise.

    A handler that stops because its claim was lost (LeaseLost, a cancelled coroutine, or
    any exception raised after the loss) comes back as a "lost" outcome: nothing of it is
    recorded against the job, since the job may already belong to another worker.
    """
    token = handle._activate()
    try:
        if context is not None:
            args = [context, *args]
        if inspect.iscoroutinefunction(task.func):
            result = asyncio.run(_run_async(task.func, args, kwargs, handle))
        else:
            result = task.func(*args, **kwargs)
    except (LeaseLost, asyncio.CancelledError):
        return Outcome("lost")
    except Exception as e:
        if handle.lost:
            return Outcome("lost")
        return Outcome(
            "error",
            exception_class_path=f"{type(e).__module__}.{type(e).__qualname__}",
            message=str(e),
            traceback=traceback.format_exc(),
            retryable=not isinstance(e, (NonRetryable, *getattr(task, "non_retryable", ()))),
        )
    finally:
        handle._deactivate(token)
    if handle.acked:
        # Committed with the handler's own writes; a loss noticed afterwards changes nothing.
        return Outcome("ok", result=handle.acked_result, acked=True)
    if handle.lost:
        return Outcome("lost")
    return Outcome("ok", result=result)


async def _run_async(func: Any, args: list[Any], kwargs: dict[str, Any],
                     handle: JobHandle) -> Any:
    """Await the handler in a task that is cancelled as soon as the claim is lost."""
    loop = asyncio.get_running_loop()
    inner = asyncio.ensure_future(func(*args, **kwargs))

    def cancel() -> None:
        # RuntimeError: the loop already closed, the handler finished first.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(inner.cancel)

    handle._on_lost(cancel)
    return await inner
