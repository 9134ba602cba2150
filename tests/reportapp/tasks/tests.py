"""A tasks package's test module: discovery leaves it out, so a task here is refused."""

from django.tasks import task


@task
def left_out() -> None:
    return None
