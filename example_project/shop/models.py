"""The shop's own data: orders, whose receipts and tax backfill run as jobs."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Order(models.Model):
    email = models.EmailField()
    total_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(db_default=Now())
    # Written by the nightly backfill, a batch at a time under a checkpointed cursor.
    tax_cents = models.PositiveIntegerField(null=True, blank=True)
    # Written by send_receipt inside fenced(): a handler whose claim was taken over
    # commits nothing, so the fence stored here is the claim that sent the mail.
    receipt_sent_at = models.DateTimeField(null=True, blank=True)
    receipt_fence = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.email})"
