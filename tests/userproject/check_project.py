"""Drive this project as its user would and print what happened, as JSON, for
tests/test_package.py: migrate, enqueue from the views, run a worker in burst mode, then
open every admin page as a superuser.

    python check_project.py      (USER_DATABASE=sqlite or postgres, see the settings)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def manage(*args):
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=HERE, capture_output=True, text=True, timeout=300
    )
    return {"exit": done.returncode, "output": (done.stdout + done.stderr)[-4000:]}


def page(client, url, markers, data=None):
    """The status of one admin page, and which of the strings it must show it lacks."""
    response = client.post(url, data) if data is not None else client.get(url)
    html = response.content.decode(errors="replace")
    return {
        "url": url,
        "status": response.status_code,
        "missing": [m for m in markers if m not in html],
    }


def main():
    report = {
        "migrate": manage("migrate", "--no-input"),
        "check": manage("check"),
        "version": manage("run_lease_worker", "--version"),
        # The project's own tests: one declares a task for itself.
        "test": manage("test", "shop"),
    }
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "userproject.settings")
    import django

    django.setup()
    from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
    from django.contrib.auth.models import User
    from django.test import Client
    from shop.tasks import send_receipt

    import django_leases
    from django_leases.models import Job, WorkerProcess
    from django_leases.states import JobState

    report["django_leases"] = {"file": django_leases.__file__, "version": django_leases.__version__}
    client = Client(raise_request_exception=False)
    enqueued = {}
    for name, url in [("receipt", "/orders/7/receipt/"), ("sync", "/orders/8/sync/")]:
        response = client.post(url)
        enqueued[name] = response.json()["job"] if response.status_code == 200 else None
        report[f"enqueue_{name}"] = response.status_code
    report["worker"] = manage(
        "run_lease_worker",
        "--queue",
        "default",
        "--queue",
        "emails",
        "--burst",
        "--worker-id",
        "package-test",
    )

    receipt = send_receipt.get_result(enqueued["receipt"])
    report["receipt"] = {"status": receipt.status.name, "return_value": receipt.return_value}
    sync = Job.objects.get(pk=enqueued["sync"])
    report["sync"] = {
        "state": sync.state,
        "attempts": sync.attempts,
        "failures": [f.message for f in sync.failures.all()],
    }
    # A job left pending, for the list's pending filter and the actions' selection.
    send_receipt.enqueue(9)

    User.objects.create_superuser("admin", "admin@example.com", "a-password")
    client.force_login(User.objects.get(username="admin"))
    jobs_url = "/admin/django_leases/job/"
    list_markers = ['id="leases-summary"', 'id="leases-advisor-link"']
    pages = [page(client, "/admin/", ["django_leases"]), page(client, jobs_url, list_markers)]
    pages += [
        page(client, f"{jobs_url}?state__exact={state}", list_markers) for state in JobState.values
    ]
    pages += [
        page(client, f"{jobs_url}?lease={lease}", list_markers)
        for lease in ("claimed", "expired", "stalled")
    ]
    pages += [
        page(client, f"{jobs_url}?queue=emails", list_markers),
        page(
            client,
            f"{jobs_url}{sync.pk}/change/",
            ['class="leases-failures"', "partner API unreachable for order 8"],
        ),
        page(client, f"{jobs_url}advisor/", ['id="leases-advisor"', "shop.tasks.send_receipt"]),
        page(client, "/admin/django_leases/workerprocess/", ["package-test"]),
    ]
    every_job = [str(pk) for pk in Job.objects.values_list("pk", flat=True)]
    for action in ("cancel", "expire_stalled", "purge_finished"):
        pages.append(
            page(
                client,
                jobs_url,
                ['id="leases-question"', 'name="post" value="yes"'],
                {"action": action, ACTION_CHECKBOX_NAME: every_job},
            )
        )
    report["pages"] = pages
    report["workers"] = list(WorkerProcess.objects.values_list("worker_id", flat=True))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
