"""A task declared outside the app's tasks module, which imports it: every worker knows it."""

from __future__ import annotations

from django.tasks import task


@task
def packed(order_id: int) -> str:
    return f"packed {order_id}"
