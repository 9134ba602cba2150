from __future__ import annotations

from common import sleep_body, stamp_body
from django.tasks import task


@task()
def noop() -> None:
    pass


@task()
def stamp(sent: float) -> None:
    stamp_body(sent)


@task()
def sleep_stamp(seconds: float, tag: str) -> None:
    sleep_body(seconds, tag)
