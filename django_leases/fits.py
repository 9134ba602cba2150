"""Whether a call's arguments fit a task's function, answered once per shape.

Enqueue refuses arguments a handler could never take, and the worker refuses such a row
before it runs. ``inspect.Signature.bind`` decides that from the shape of the call alone
(how many positional arguments, which keyword names in which order), never from the
values, so the answer for a shape is kept: a bulk enqueue of 10,000 calls of one shape
binds once, and a worker binds once per task and shape, not once per job.
"""

from __future__ import annotations

import inspect
from typing import Any

# Per function: its signature, or None when it has none to read (a builtin or C function:
# the call decides).
_signatures: dict[Any, inspect.Signature | None] = {}
# Per (function, takes_context, positional count, keyword names): None when such a call
# fits, else the TypeError's message.
_shapes: dict[tuple[Any, ...], str | None] = {}
# A bound on what is kept: shapes are few per task, so this is only reached by callers that
# vary their keyword names from call to call.
MAX_KEPT = 4096


def signature_of(func: Any) -> inspect.Signature | None:
    """inspect.signature(func), read once per function (it costs more than a bind)."""
    try:
        return _signatures[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable: read it every time
        return _read(func)
    if len(_signatures) >= MAX_KEPT:
        _signatures.clear()
    _signatures[func] = signature = _read(func)
    return signature


def misfit(func: Any, takes_context: bool, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    """None when ``func`` takes ``args`` and ``kwargs`` (after a context argument when
    ``takes_context``), or it has no signature to tell; else why not, as bind() says it."""
    try:
        shape = (func, takes_context, len(args), tuple(kwargs))
        return _shapes[shape]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return _bind(func, takes_context, args, kwargs)
    if len(_shapes) >= MAX_KEPT:
        _shapes.clear()
    _shapes[shape] = answer = _bind(func, takes_context, args, kwargs)
    return answer


def _bind(func: Any, takes_context: bool, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    signature = signature_of(func)
    if signature is None:
        return None
    try:
        signature.bind(*([None] if takes_context else []), *args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _read(func: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None
