"""The shop's background work, declared for the lease backend.

Each handler shows one thing a lease asks of its code: send_receipt guards a side effect
with fenced()/once(), nightly_backfill and sales_report checkpoint a cursor so a takeover
resumes instead of starting over, sync_to_partner fails until its retry ladder dead-letters it.
"""

from __future__ import annotations

from django.db.models import F
from django.db.models.functions import Now
from django.tasks import task

from django_leases.api import current_job
from django_leases.fencing import fenced, once

from .models import Order


@task(queue_name="emails")
def send_receipt(order_id: int, seconds: float = 0.2) -> str:
    """Pretend to send mail; the order records the fence of the claim that did it."""
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


# docs/quickstart.md shows this function word for word (tests/test_demo.py checks it).
@task
def nightly_backfill(batch_size: int = 100, pause: float = 0.0) -> dict:
    """Fill in the tax of orders that lack it, a batch at a time. The cursor (the last order
    id done) commits with its batch, so a job claimed again after a crash starts after the
    last committed batch instead of from the first order."""
    job = current_job()
    resumed_after = done_up_to = job.cursor or 0  # None until a first checkpoint
    while ids := list(
        Order.objects.filter(pk__gt=done_up_to, tax_cents__isnull=True)
        .order_by("pk")
        .values_list("pk", flat=True)[:batch_size]
    ):
        job.sleep(pause)  # stands for slow work; wakes early with LeaseLost if the claim goes
        with fenced():  # the batch and its cursor commit together, only while the claim holds
            Order.objects.filter(pk__in=ids).update(tax_cents=F("total_cents") * 20 / 100)
            job.checkpoint(ids[-1])
        done_up_to = ids[-1]
    return {"resumed_after": resumed_after, "done_up_to": done_up_to}


@task(queue_name="reports")
def sales_report(batch_size: int = 1, pause: float = 0.5) -> dict:
    """Sum every order's total, a batch at a time: the cursor carries the running sum with
    the last order id, so an attempt after a crash goes on from there. The tour leaves two
    of these claimed by a killed worker, one expired and one stalled, for the admin."""
    job = current_job()
    cursor = job.cursor or {"after_id": 0, "orders": 0, "cents": 0}
    while batch := list(
        Order.objects.filter(pk__gt=cursor["after_id"])
        .order_by("pk")
        .values_list("pk", "total_cents")[:batch_size]
    ):
        job.sleep(pause)
        cursor = {
            "after_id": batch[-1][0],
            "orders": cursor["orders"] + len(batch),
            "cents": cursor["cents"] + sum(cents for _, cents in batch),
        }
        job.checkpoint(cursor)
    return cursor


@task(queue_name="partners")
def sync_to_partner(order_id: int) -> None:
    """A partner API that keeps timing out: retried on the partners queue's ladder, then
    dead-lettered for a person to look at (OPTIONS["QUEUE_OPTIONS"]["partners"])."""
    raise ConnectionError(f"partner API timed out syncing order {order_id}")


@task(queue_name="periodic")
def tally_orders() -> dict:
    """Count the orders and how many have tax: run by itself every 2 s (the "shop.tally"
    schedule in settings.py), never twice for one tick however many workers run."""
    return {
        "orders": Order.objects.count(),
        "with_tax": Order.objects.filter(tax_cents__isnull=False).count(),
    }
