"""The shop's background work, declared for the lease backend."""

from __future__ import annotations

import time

from django.tasks import task


@task(queue_name="emails")
def send_receipt(order_id: int) -> str:
    """Pretend to send mail: a side effect that must not happen twice while a lease holds."""
    time.sleep(0.2)
    return f"receipt for order {order_id} sent"


@task(queue_name="images")
def resize_image(name: str, width: int) -> dict:
    time.sleep(0.5)
    return {"name": name, "width": width}
