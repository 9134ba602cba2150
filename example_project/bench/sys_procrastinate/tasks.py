from __future__ import annotations

from common import sleep_body, stamp_body
from procrastinate.contrib.django import app


@app.task(name="noop")
def noop() -> None:
    pass


@app.task(name="stamp")
def stamp(sent: float) -> None:
    stamp_body(sent)


@app.task(name="sleep_stamp")
def sleep_stamp(seconds: float, tag: str) -> None:
    sleep_body(seconds, tag)
