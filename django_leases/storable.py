"""Make what a handler hands back storable on every supported database.

A handler is untrusted input: its exception may carry lone surrogates (which have no UTF-8
form, so no driver can send them), a NUL (which PostgreSQL's text refuses), megabytes of
message, a ``__str__`` or ``__repr__`` that raises, a class whose names raise; its return
value may be anything at all. What the worker records of it goes through here, so that
recording a failure can itself never fail on the handler's account.

The limits, in characters, fit every database's column (``exception_class_path`` is a
``varchar(255)``; the others are ``text``/``longtext``) and keep a failure record well
inside MySQL's and MariaDB's default ``max_allowed_packet`` (16 MiB on MariaDB); a result
takes at most ``jsonsafe.SENT_LIMIT`` as sent, as a call's arguments do.
"""

from __future__ import annotations

import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

from .exceptions import InvalidJobArgument
from .jsonsafe import SENT_LIMIT, TooLargeDocument, ensure_json, size_as_sent, too_large

CLASS_PATH_LIMIT = 255
MESSAGE_LIMIT = 10_000
TRACEBACK_LIMIT = 50_000

# The names type itself keeps for a class, read past any metaclass that overrides them.
_qualname_of = type.__dict__["__qualname__"].__get__
_module_of = type.__dict__["__module__"].__get__
_name_of = type.__dict__["__name__"].__get__
_dict_of = type.__dict__["__dict__"].__get__
_mro_of = type.__dict__["__mro__"].__get__


def storable_text(value: Any, limit: int, *, keep_tail: bool = False) -> str:
    """``value`` as text every database stores: lone surrogates escaped as ``\\ud800``,
    NUL as ``\\x00``, at most ``limit`` characters (the head, or with ``keep_tail`` the head
    and the tail, around a note of how much was cut)."""
    text = _plain(value)
    if len(text) <= limit:
        escaped = _escape(text)
        if len(escaped) <= limit:
            return escaped
    return _cut(text, limit, keep_tail=keep_tail, escape=_escape)


def cut_middle(text: str, limit: int) -> str:
    """``text`` as it is, or its head and tail around a note of how much was cut, in at
    most ``limit`` characters: a log line's traceback (nothing escaped; the log formats do
    that as each needs)."""
    return text if len(text) <= limit else _cut(text, limit, keep_tail=True, escape=None)


def _cut(text: str, limit: int, *, keep_tail: bool, escape: Callable[[str], str] | None) -> str:
    """The head of ``text`` (and with ``keep_tail`` its tail) around a note of how much
    was cut, in at most ``limit`` characters; each part escaped by ``escape`` and cut
    again to its room, as escaping lengthens it."""
    fit = escape or (lambda part: part)
    note = f"\n[... {len(text):,} characters in all, cut to {limit:,} ...]\n"
    room = max(limit - len(note), 0)
    if not keep_tail:
        return (fit(text[:room])[:room] + note)[:limit]
    head, tail = room - room // 2, room // 2
    return (fit(text[:head])[:head] + note + (fit(text[-tail:])[-tail:] if tail else ""))[:limit]


def storable_name(value: Any, limit: int = CLASS_PATH_LIMIT) -> str:
    """``value`` escaped as storable_text() does and cut at ``limit``, unmarked: a name
    over the column's length is no import path anyway."""
    return _escape(_plain(value)[:limit])[:limit]


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its class name if it has none), for a log
    line or a message that names the error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def ascii_text(value: Any, limit: int) -> str:
    """``value`` as printable ASCII (anything else backslash-escaped), cut to ``limit``:
    what a column of any character set takes."""
    return _plain(value).encode("ascii", "backslashreplace").decode("ascii")[:limit]


def class_path(cls: type) -> str:
    """``module.qualname`` of ``cls`` (``builtins.SystemExit``, ``app.tasks.Outer.Error``),
    storable, from the names type keeps (a metaclass cannot make reading them raise)."""
    try:
        qualname = _qualname_of(cls)
    except Exception:  # noqa: BLE001 -- a class whose names cannot be read still has a path
        qualname = None
    if not isinstance(qualname, str):
        try:
            qualname = _name_of(cls)
        except Exception:  # noqa: BLE001
            qualname = "<unnamed>"
    try:
        module = _module_of(cls)
    except Exception:  # noqa: BLE001
        module = None
    if not isinstance(module, str):
        module = "<unknown>"
    return storable_name(
        f"{_plain(module)[:CLASS_PATH_LIMIT]}.{_plain(qualname)[:CLASS_PATH_LIMIT]}"
    )


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(class path, message, traceback) of ``exc``, storable, whatever ``exc`` does.

    Call it on the thread that runs the handler (a slot thread or the child process): a
    hostile ``__str__`` may raise anything, even a BaseException, and is caught here.
    """
    path = class_path(type(exc))
    message = _message(exc)
    return (
        path,
        storable_text(message, MESSAGE_LIMIT),
        storable_text(_traceback(exc, path, message), TRACEBACK_LIMIT, keep_tail=True),
    )


def readable_class_path(path: str, fallback: str = "builtins.Exception") -> str:
    """A path TaskError.exception_class imports (it splits module from class at the last
    dot) for the exception class recorded as ``path``: ``path`` itself, else that of the
    nearest base class that imports so (a class nested in another), else ``fallback`` (a
    class defined inside a function, a path cut at the column's length).

    Nothing is imported: a path is a row's say-so, and importing the module it names runs
    that module's code (which may exit, print, or do worse). Only modules already in
    ``sys.modules`` are read, through their ``__dict__`` (no module ``__getattr__`` runs).
    A path that goes on past the modules loaded here (``shop.errors.PaymentDeclined`` in a
    process that never imported ``shop.errors``) is given as recorded, as Django's own
    backends give it: ``exception_class`` imports it when asked, which reading does not.
    """
    found = _readable(path)
    if found is not None:
        return found
    return path if _beyond_loaded_modules(path) else fallback


def _beyond_loaded_modules(path: str) -> bool:
    """Whether ``path`` (a dotted path of identifiers) names, past its deepest module
    loaded in this process, a name that module does not hold, and its own module (all but
    the last name) is not loaded: a class of a module not imported here. A class missing
    from a loaded module (since removed) is not: its path could only fail to import."""
    parts = path.split(".")
    if len(path) >= CLASS_PATH_LIMIT or len(parts) < 2:
        return False  # cut to the column: what it names is unknown
    if not all(part.isidentifier() for part in parts) or path.rpartition(".")[0] in sys.modules:
        return False
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            return isinstance(module, types.ModuleType) and parts[cut] not in vars(module)
    return True


def _loaded(module_name: str, names: list[str]) -> Any:
    """The object at ``names`` inside the already-loaded module ``module_name``, read from
    the ``__dict__``s alone; None where any step is missing."""
    found: Any = sys.modules.get(module_name)
    for name in names:
        if found is None:
            return None
        try:
            found = _namespace(found).get(name)
        except Exception:  # noqa: BLE001 -- a hostile mapping in a class's namespace
            return None
    return found


def _namespace(value: Any) -> Any:
    if isinstance(value, types.ModuleType):
        return value.__dict__
    if isinstance(value, type):
        return _dict_of(value)
    return {}


def _readable(path: str) -> str | None:
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        return None  # f.<locals>.Error, escaped characters: no import reaches it
    cls = None
    for cut in range(len(parts) - 1, 0, -1):
        cls = _loaded(".".join(parts[:cut]), parts[cut:])
        if cls is not None:
            break
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return None
    for base in _mro_of(cls):
        module, _, name = class_path(base).rpartition(".")
        if module and _loaded(module, [name]) is base:
            return f"{module}.{name}"
    return None


def storable_result(value: Any) -> Any:
    """``value`` as the job's JSON ``result`` column will hold it (plain lists, dicts, str,
    int, float, bool, None), or raise TypeError saying why it cannot be, naming where in
    the value (``result[0]['when']``) as enqueue's argument errors do.

    What Django's own backends store (``django.utils.json.normalize_json``: UTF-8 bytes as
    str, any mapping as a dict, any sequence as a list) is stored so too, but for a dict
    key that is not a ``str``: refused, since JSON would give it back as another key."""
    if value is None or type(value) in (bool, str, int) and _is_plain_scalar(value):
        return value
    bound = [0]
    try:
        # A fresh copy of plain types: no subclass of str or int (whose pickling a handler
        # may have overridden) goes on to the worker.
        checked = ensure_json(value, "result", bound, as_django_stores=True)
    except TooLargeDocument as e:
        raise TypeError(f"the task returned a value too large to store: {e}") from None
    except InvalidJobArgument as e:
        raise TypeError(f"the task returned a value that cannot be stored as JSON: {e}") from None
    except BaseException as e:  # noqa: BLE001 -- whatever the value's own methods raise
        # (user code: even KeyboardInterrupt is its failure)
        raise TypeError(
            f"the task returned a value that cannot be stored as JSON: result: {_message(e)}"
        ) from None
    if (length := size_as_sent(bound[0], checked)) > SENT_LIMIT:
        raise TypeError(
            f"the task returned a value too large to store: result: {too_large(length)}"
        )
    return checked


def _is_plain_scalar(value: Any) -> bool:
    """A str every database stores, or an int of a size every JSON column takes."""
    if type(value) is str:
        return len(value) <= 1000 and "\x00" not in value and value.isascii()
    return type(value) is bool or -(2**53) <= value <= 2**53


def _plain(value: Any) -> str:
    """An exact str, without calling any method a str subclass overrides."""
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    return _safe_str(value)


def _escape(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _message(exc: BaseException) -> str:
    """str(exc); else repr(exc); else the class name and what went wrong."""
    for render in (str, repr, BaseException.__repr__):
        try:
            text = render(exc)
        except BaseException:  # noqa: BLE001, S112 -- a hostile __str__ may raise anything
            continue
        if isinstance(text, str):
            return _plain(text)
    try:
        name = _plain(_name_of(type(exc)))
    except Exception:  # noqa: BLE001
        name = "exception"
    return f"<{name}: str() and repr() raised>"


def _safe_str(value: Any) -> str:
    try:
        text = str(value)
    except BaseException:  # noqa: BLE001 -- as in _message
        return f"<{_name_of(type(value))} whose str() raised>"
    return _plain(text) if isinstance(text, str) else "<unprintable>"


def _traceback(exc: BaseException, path: str, message: str) -> str:
    """The formatted traceback, chained causes and contexts included (the formatter stops
    at a cycle). If formatting fails (a class whose names raise), the stack alone, ending
    with the class path and message as read here."""
    try:
        return "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001 -- as in _message
        pass
    try:
        stack = "".join(traceback.format_tb(BaseException.__dict__["__traceback__"].__get__(exc)))
    except BaseException:  # noqa: BLE001
        stack = ""
    return f"Traceback (most recent call last):\n{stack}{path}: {message}\n"
