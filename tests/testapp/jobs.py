"""Tasks declared outside an app's tasks module (issue 15.3): workers and readers know them
only when TASK_MODULES lists this module."""

from __future__ import annotations

from django.tasks import task


@task
def shipped(order_id: int) -> str:
    return f"shipped {order_id}"
