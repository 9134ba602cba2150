"""The shop's background work, declared for the lease backend.

Each handler shows one thing a lease asks of its code: send_receipt guards a side effect
with fenced()/once(), nightly_backfill checkpoints a cursor so a takeover resumes instead of
starting over, sync_to_partner fails until its retry ladder dead-letters it.
"""

from __future__ import annotations

from contextlib import nullcontext

from django.db.models.functions import Now
from django.tasks import task

from django_leases.api import current_job
from django_leases.fencing import fenced, once


@task(queue_name="emails")
def send_receipt(order_id: int, seconds: float = 0.2) -> str:
    """Pretend to send mail; the order records the fence of the claim that did it."""
    from .models import Order

    job = current_job()
    if job is None:  # run in-process (ImmediateBackend, a shell): nothing to fence
        Order.objects.filter(pk=order_id).update(receipt_sent_at=Now())
        return f"receipt for order {order_id} sent"
    job.sleep(seconds)  # the mail server; wakes early with LeaseLost if the claim goes
    with fenced():
        # The mark commits only while this claim still holds the job, and at most once
        # per job whatever the number of attempts.
        if once("receipt-mail"):
            Order.objects.filter(pk=order_id).update(receipt_sent_at=Now(), receipt_fence=job.fence)
    return f"receipt for order {order_id} sent"


@task(queue_name="images")
def resize_image(name: str, width: int, seconds: float = 0.5) -> dict:
    job = current_job()
    if job is not None:
        job.sleep(seconds)
    return {"name": name, "width": width}


@task(queue_name="nightly")
def nightly_backfill(batch_size: int = 5, pause: float = 0.3) -> dict:
    """Fill in tax where it is missing, a batch of orders at a time. The cursor (the last order id done)
    commits in the same transaction as its batch, so a worker that takes the job over after
    a crash starts after the last committed batch, not from the first order."""
    from .models import Order

    job = current_job()
    cursor = (job.cursor or {}).get("after_id", 0) if job else 0
    resumed_after, batches = cursor, 0
    while True:
        ids = list(Order.objects.filter(pk__gt=cursor, tax_cents__isnull=True).order_by("pk")
                   .values_list("pk", flat=True)[:batch_size])
        if not ids:
            return {"resumed_after_id": resumed_after, "batches": batches, "last_id": cursor}
        if job is not None:
            job.sleep(pause)  # the slow part of a real backfill
        # fenced(): the batch and its cursor commit only while this claim holds the job.
        with fenced() if job else nullcontext():
            for order in Order.objects.filter(pk__in=ids):
                order.tax_cents = order.total_cents * 2 // 10
                order.save(update_fields=["tax_cents"])
            if job is not None:
                job.checkpoint({"after_id": ids[-1]})
        cursor, batches = ids[-1], batches + 1


@task(queue_name="partners")
def sync_to_partner(order_id: int) -> None:
    """A partner API that keeps timing out: retried on the partners queue's ladder, then
    dead-lettered for a person to look at (OPTIONS["QUEUE_OPTIONS"]["partners"])."""
    raise ConnectionError(f"partner API timed out syncing order {order_id}")
