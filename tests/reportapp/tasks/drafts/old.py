"""A folder of the tasks package with no __init__.py: discovery does not walk it."""

from django.tasks import task


@task
def draft() -> None:
    return None
