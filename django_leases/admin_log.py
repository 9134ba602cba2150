"""The admin log entries of the actions: one per object an action changed, not one per
object selected, so *Recent actions* and an object's history say what really happened."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import router, transaction
from django.db.models import Model
from django.http import HttpRequest


@contextlib.contextmanager
def atomic_with_log(db: str) -> Iterator[None]:
    """A transaction on ``db`` in which an action changes rows and logs them: should the
    admin log live on another database, a transaction there around it, so that an entry is
    never missing for a change committed (the log's commit comes last, a window of one
    commit, not of the whole action)."""
    from django.contrib.admin.models import LogEntry

    log_db = router.db_for_write(LogEntry)
    with (
        transaction.atomic(using=log_db) if log_db != db else contextlib.nullcontext(),
        transaction.atomic(using=db),
    ):
        yield


def log_changed(request: HttpRequest, changed: Sequence[Model], message: str) -> None:
    """A change entry with ``message`` for each object of ``changed``."""
    from django.contrib.admin.models import CHANGE

    _log(request, changed, CHANGE, message)


def log_deleted(request: HttpRequest, deleted: Sequence[Model], message: str) -> None:
    """A deletion entry with ``message`` for each object of ``deleted``."""
    from django.contrib.admin.models import DELETION

    _log(request, deleted, DELETION, message)


def _log(request: HttpRequest, objects: Sequence[Model], flag: int, message: str) -> None:
    """One entry of ``flag`` per object, in one insert (Django's log_actions)."""
    from django.contrib.admin.models import LogEntry

    if not objects:
        return
    # single_object is known at run time only; django-stubs types it by literal.
    entries: Any = LogEntry.objects
    entries.log_actions(
        user_id=request.user.pk,
        queryset=objects,
        action_flag=flag,
        change_message=message,
        single_object=len(objects) == 1,
    )
