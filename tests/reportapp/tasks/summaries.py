"""A task in a module of an app's tasks package that the package itself never imports."""

from django.tasks import task


@task
def tally(*numbers: int) -> int:
    return sum(numbers)
