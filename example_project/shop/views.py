"""Enqueue on commit, then poll the result: the two halves of docs/django-tasks.md.

place_order enqueues the receipt job in transaction.on_commit(), which is right whatever
database holds the jobs (see the docs for when an enqueue inside the transaction is
atomic instead). The status page polls result_json, which reads the job back through
the public django.tasks API from any process.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
from django.views.decorators.http import require_GET, require_http_methods

from .models import Order
from .tasks import send_receipt


# The view opens its own transaction: under ATOMIC_REQUESTS the request's transaction would
# commit only after the view returned, too late for the redirect to name the job.
@transaction.non_atomic_requests
@require_http_methods(["GET", "POST"])
def place_order(request: HttpRequest) -> HttpResponse:
    """GET: the order form. POST: create the order, enqueue its receipt once it commits."""
    if request.method == "GET":
        return render(request, "shop/place_order.html")
    enqueued: dict[str, Any] = {}
    with transaction.atomic():
        order = Order.objects.create(
            email=request.POST.get("email") or "customer@example.com", total_cents=1999
        )
        # Runs after COMMIT, still inside this request; on rollback it never runs.
        transaction.on_commit(lambda: enqueued.update(receipt=send_receipt.enqueue(order.pk)))
    result_id = enqueued["receipt"].id
    # Job ids count up: this session may read back only the jobs it made.
    request.session["receipts"] = [*request.session.get("receipts", [])[-19:], result_id]
    return redirect("receipt_status", result_id=result_id)


@require_GET
def receipt_status(request: HttpRequest, result_id: str) -> HttpResponse:
    """A page that polls result_json until the job is finished."""
    return render(request, "shop/receipt_status.html", {"result_id": result_id})


@require_GET
def result_json(request: HttpRequest, result_id: str) -> JsonResponse:
    """The receipt job as django.tasks reports it (times from the database clock): only
    one this session placed, and a 404 for an id of no job or of another task's."""
    if result_id not in request.session.get("receipts", []):
        raise Http404("no such job")
    try:
        result = send_receipt.get_result(result_id)
    except (TaskResultDoesNotExist, TaskResultMismatch):
        raise Http404("no such job") from None
    return JsonResponse(
        {
            "id": result.id,
            "status": result.status,
            "finished": result.is_finished,
            "return_value": result.return_value
            if result.status == TaskResultStatus.SUCCESSFUL
            else None,
            "errors": [e.exception_class_path for e in result.errors],
            "attempts": result.attempts,
            "worker_ids": result.worker_ids,
            "enqueued_at": result.enqueued_at,
            "started_at": result.started_at,
            "finished_at": result.finished_at,
        }
    )
