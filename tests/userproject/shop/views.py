from django.db import transaction
from django.http import JsonResponse
from django.views.decorators.http import require_POST

from .tasks import send_receipt, sync_order


@require_POST
@transaction.atomic
def send_receipt_view(request, order_id):
    result = send_receipt.enqueue(order_id)
    return JsonResponse({"job": result.id})


@require_POST
@transaction.atomic
def sync_order_view(request, order_id):
    # Retried at once: the worker's --burst run sees both attempts.
    result = sync_order.using_lease(retry=[0]).enqueue(order_id)
    return JsonResponse({"job": result.id})
