"""Whether a call's arguments fit a task's function, answered once per shape.

Enqueue refuses arguments a handler could never take, and the worker refuses such a row
before it runs. ``inspect.Signature.bind`` decides that from the shape of the call alone
(how many positional arguments, which keyword names in which order), never from the
values, so the answer for a shape is kept: a bulk enqueue of 10,000 calls of one shape
binds once, and a worker binds once per task and shape, not once per job.

Only shapes whose keywords all name parameters of the function, and that pass at most
MAX_POSITIONAL positional arguments, are kept: a function that takes ``**kwargs``, a call
with a keyword it does not know or a longer one is bound every time, so callers' own names
and counts never fill the tables. Keyword names are kept as a set: when every name is a
parameter, bind() answers the same whatever their order.
"""

from __future__ import annotations

import inspect
from typing import Any

# Per function: its signature, or None when it has none to read (a builtin or C function:
# the call decides).
_signatures: dict[Any, inspect.Signature | None] = {}
# Per function: the names its parameters may be passed by, or None when it takes **kwargs
# or has no signature to read.
_keywords: dict[Any, frozenset[str] | None] = {}
# Per (function, takes_context, positional count, set of keyword names): None when such a
# call fits, else the TypeError's message.
_shapes: dict[tuple[Any, ...], str | None] = {}
# A bound on what is kept, per table, and on the positional arguments of a kept shape.
MAX_KEPT = 4096
MAX_POSITIONAL = 32

_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def signature_of(func: Any) -> inspect.Signature | None:
    """inspect.signature(func), read once per function (it costs more than a bind)."""
    try:
        return _signatures[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable: read it every time
        return _read(func)
    _kept(_signatures)
    _signatures[func] = signature = _read(func)
    return signature


def misfit(func: Any, takes_context: bool, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    """None when ``func`` takes ``args`` and ``kwargs`` (after a context argument when
    ``takes_context``), or it has no signature to tell; else why not, as bind() says it."""
    try:
        names = _keywords[func]
    except KeyError:
        names = _keyword_names(func)
    except TypeError:  # an unhashable callable
        names = None
    if (
        names is None
        or len(args) > MAX_POSITIONAL
        or not isinstance(kwargs, dict)
        or not names.issuperset(kwargs)
    ):
        return _bind(func, takes_context, args, kwargs)
    shape = (func, takes_context, len(args), frozenset(kwargs))
    try:
        return _shapes[shape]
    except KeyError:
        pass
    _kept(_shapes)
    _shapes[shape] = answer = _bind(func, takes_context, args, kwargs)
    return answer


def task_misfit(
    task: Any, args: list[Any], kwargs: dict[str, Any], named: str | None = None
) -> str | None:
    """None when ``task``'s function takes the call, else why not, naming the task
    (``named``, else its name) and its signature: the words enqueue(), a schedule's check
    and the worker's refusal of a row share."""
    why = misfit(task.func, task.takes_context, args, kwargs)
    if why is None:
        return None
    return f"do not fit {named or task.name}{signature_of(task.func)}: {why}"


def _keyword_names(func: Any) -> frozenset[str] | None:
    signature = signature_of(func)
    names = None
    if signature is not None and all(
        p.kind is not inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    ):
        names = frozenset(p.name for p in signature.parameters.values() if p.kind in _BY_KEYWORD)
    _kept(_keywords)
    _keywords[func] = names
    return names


def _kept(table: dict[Any, Any]) -> None:
    if len(table) >= MAX_KEPT:
        table.clear()


def _bind(func: Any, takes_context: bool, args: list[Any], kwargs: Any) -> str | None:
    signature = signature_of(func)
    if signature is None:
        return None
    try:
        signature.bind(*([None] if takes_context else []), *args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _read(func: Any) -> inspect.Signature | None:
    # The signature of what is called: a decorator's wrapper, not the function it wraps
    # (functools.wraps points at it), whose arguments the wrapper may add or take away.
    try:
        return inspect.signature(func, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
