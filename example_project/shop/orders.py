"""The shop's views: each writes its own rows and enqueues the slow part as a job.

The job row is inserted in the view's transaction (ATOMIC_REQUESTS-style, by hand here):
workers can see it only once the transaction commits, and a view that fails after the
enqueue leaves neither the order nor its job behind. With an outside broker you would need
transaction.on_commit(); with the queue in the same database the commit is the hand-off.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.http import Http404, HttpRequest, JsonResponse
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from .models import Order
from .tasks import nightly_backfill, resize_image, send_receipt, sync_to_partner

app_name = "orders"


def _number(request: HttpRequest, name: str, default: float) -> float:
    try:
        return float(request.POST.get(name, default))
    except ValueError:
        return default


# csrf_exempt: a JSON API for the demo and curl; a real shop would use its forms' tokens.
@csrf_exempt
@require_POST
@transaction.atomic
def checkout(request: HttpRequest) -> JsonResponse:
    """Create an order; its receipt mail and partner sync leave as jobs on commit."""
    order = Order.objects.create(
        email=request.POST.get("email", "customer@example.com"),
        total_cents=int(_number(request, "total_cents", 1999)),
    )
    receipt = send_receipt.enqueue(order.pk)
    jobs = {"receipt": receipt.id}
    if request.POST.get("partner"):
        jobs["partner"] = sync_to_partner.enqueue(order.pk).id
    return JsonResponse({"order": order.pk, "jobs": jobs}, status=201)


@csrf_exempt
@require_POST
@transaction.atomic
def upload_photo(request: HttpRequest) -> JsonResponse:
    result = resize_image.enqueue(
        request.POST.get("name", "photo.jpg"),
        int(_number(request, "width", 640)),
        seconds=_number(request, "seconds", 0.5),
    )
    return JsonResponse({"jobs": {"resize": result.id}}, status=201)


@csrf_exempt
@require_POST
@transaction.atomic
def start_backfill(request: HttpRequest) -> JsonResponse:
    """What cron would call nightly: one job that walks every order under a cursor."""
    result = nightly_backfill.enqueue(
        batch_size=int(_number(request, "batch_size", 5)), pause=_number(request, "pause", 0.3)
    )
    return JsonResponse({"jobs": {"backfill": result.id}}, status=201)


@require_GET
def job_status(request: HttpRequest, job_id: int) -> JsonResponse:
    """The Django Tasks view of a job: status, workers that ran it, return value."""
    try:
        result = send_receipt.get_backend().get_result(str(job_id))
    except TaskResultDoesNotExist:
        raise Http404("no such job") from None
    body: dict[str, Any] = {
        "id": result.id,
        "task": result.task.module_path,
        "status": result.status,
        "worker_ids": result.worker_ids,
        "errors": len(result.errors),
    }
    if result.status == TaskResultStatus.SUCCESSFUL:
        body["return_value"] = result.return_value
    return JsonResponse(body)


urlpatterns = [
    path("checkout/", checkout, name="checkout"),
    path("photos/", upload_photo, name="photos"),
    path("backfill/", start_backfill, name="backfill"),
    path("jobs/<int:job_id>/", job_status, name="job-status"),
]
