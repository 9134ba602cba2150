"""Tasks the tests enqueue through django.tasks."""

from __future__ import annotations

from django.tasks import task


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_receipt(order_id: int) -> str:
    return f"receipt {order_id}"


def not_a_task() -> None:
    """A module-level function that was never declared with @task."""
