"""The project's own tests, run by `manage.py test shop` (tests/test_package.py): a task a
test declares for itself, run under ImmediateBackend, must not stop the run at the checks
(django_leases.E018 did: SystemCheckError before any test ran)."""

from django.tasks import TaskResultStatus, task
from django.test import SimpleTestCase, override_settings


@task()
def doubled(number: int) -> int:
    return number * 2


@override_settings(
    TASKS={"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
)
class DoubledTests(SimpleTestCase):
    def test_a_task_declared_in_a_test_runs_immediately(self):
        result = doubled.enqueue(21)
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)
