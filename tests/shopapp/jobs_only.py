"""A task no discovered module imports (a view might): workers never know it."""

from __future__ import annotations

from django.tasks import task


@task
def forgotten(order_id: int) -> str:
    return f"forgotten {order_id}"
