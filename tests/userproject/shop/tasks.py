from django.tasks import task

from django_leases.api import current_job


@task(queue_name="emails")
def send_receipt(order_id: int) -> str:
    return f"receipt for order {order_id} sent"


@task()
def sync_order(order_id: int) -> int:
    """Fails its first attempt, so that the job keeps an error history."""
    if current_job().attempt == 1:
        raise ConnectionError(f"partner API unreachable for order {order_id}")
    return order_id
