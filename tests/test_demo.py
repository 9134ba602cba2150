"""The README's demo (example_project's lease_tour) on a scratch SQLite file, as CI runs it.

Real run_lease_worker subprocesses; every wait in the tour is a poll with a deadline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHOP = Path(__file__).resolve().parent.parent / "example_project"


def manage(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")
    }
    env["SHOP_SQLITE"] = str(tmp_path / "shop.sqlite3")
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=SHOP,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def shop_db(tmp_path):
    migrated = manage(tmp_path, "migrate", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    return tmp_path


ADMIN_SCRIPT = """
import json
from django.test import Client
from django.test.utils import setup_test_environment
from django_leases.models import Job

setup_test_environment()
client = Client()
assert client.login(username="admin", password="leases-demo")
url = "/admin/django_leases/job/"
seen = {}
for name, query in [("all", {}), ("claimed", {"lease": "claimed"}), ("expired", {"lease": "expired"}),
                    ("stalled", {"lease": "stalled"}), ("dead", {"state__exact": "dead"})]:
    page = client.get(url, query)
    rows = page.context["cl"].result_list
    seen[name] = {"status": page.status_code,
                  "rows": [[j.pk, j.task_path.rsplit(".", 1)[-1], j.state, j.lease_status]
                           for j in rows],
                  "header": [page.context["leases_expired"][0], page.context["leases_stalled"][0]],
                  "html": page.content.decode()}
dead = seen["dead"]["rows"][0][0] if seen["dead"]["rows"] else 0
page = client.get(f"{url}{dead}/change/")
seen["dead_page"] = {"status": page.status_code, "html": page.content.decode()}
seen["workers"] = client.get("/admin/django_leases/workerprocess/").status_code
print(json.dumps(seen))
"""


def test_tour_shows_a_takeover_after_sigkill_and_leaves_a_job_in_each_admin_view(shop_db):
    """The killed worker's job is claimed by the survivor with a higher fence and resumes
    after the cursor its killed worker committed (the quick start's checkpoint example);
    the tour ends with the summary table and the admin instructions. What it leaves behind
    is what the admin shows, read through the admin itself (its filters, on the demo's
    database, logged in as the demo user): one expired claim and one stalled claim, both of
    the killed reporting worker, a dead job with its error history, and no healthy claim."""
    import json

    run = manage(shop_db, "lease_tour")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "[stale] worker-a wakes up: its renewal touches 0 rows and its ack is refused" in out
    assert "[kill -9]" in out and "[takeover]" in out and "fence 2" in out
    assert "Takeover after SIGKILL: yes. Nothing lost." in out
    # The periodic part: three ticks ran, each tick recorded once.
    assert (
        len(re.findall(r"\[tick\] .* UTC \(database clock\): job \d+, run by tour-tick-", out)) == 3
    )
    assert re.search(r"\[schedule\] \d+ ticks decided so far, \d+ recorded, each once", out)
    assert "/admin/django_leases/schedule/" in out
    assert "nightly_backfill     1          1     0" in out
    assert "user admin, password leases-demo" in out
    killed_at = re.search(r"killed while it holds job \d+ at cursor (\d+) with fence 1", out)
    resumed = re.search(r"resuming after cursor (\d+)", out)
    resumed_after = re.search(r"result \{.*'resumed_after': (\d+)", out)
    done_up_to = re.search(r"result \{.*'done_up_to': (\d+)", out)
    assert killed_at and resumed and resumed_after and done_up_to, out
    assert killed_at[1] == resumed[1] == resumed_after[1] != "0"
    assert int(done_up_to[1]) > int(resumed_after[1])
    for view in ("?lease=expired", "?lease=stalled", "?lease=claimed", "/workerprocess/"):
        assert view in out

    shown = manage(shop_db, "shell", "-c", ADMIN_SCRIPT)
    assert shown.returncode == 0, shown.stderr
    seen = json.loads(shown.stdout.strip().splitlines()[-1])
    assert all(seen[v]["status"] == 200 for v in ("all", "claimed", "expired", "stalled", "dead"))
    [expired] = seen["expired"]["rows"]
    [stalled] = seen["stalled"]["rows"]
    assert expired[1:] == ["sales_report", "claimed", "expired"]
    assert stalled[1:] == ["sales_report", "claimed", "stalled"]
    assert expired[0] != stalled[0]
    # A valid lease, nobody renewing it: the "claimed" filter holds the stalled claim alone.
    assert seen["claimed"]["rows"] == [stalled]
    assert not [row for row in seen["all"]["rows"] if row[3] == "healthy"]
    assert seen["all"]["header"] == [1, 1]
    assert "stalled: no heartbeat for" in seen["stalled"]["html"]
    assert re.search(r"expired \d+ s ago", seen["expired"]["html"])
    [dead] = seen["dead"]["rows"]
    assert dead[1:3] == ["sync_to_partner", "dead"]
    page = seen["dead_page"]
    assert page["status"] == 200 and seen["workers"] == 200
    assert page["html"].count("builtins.ConnectionError") == 3  # one row per attempt
    assert "partner API timed out syncing order" in page["html"]


def test_tour_exits_nonzero_when_no_worker_is_left_to_take_over(shop_db):
    """With every worker killed nobody can take the job over: the tour fails at its deadline."""
    run = manage(shop_db, "lease_tour", "--skip-steps", "--kill-all", "--deadline", "10")
    assert run.returncode == 1
    assert "gave up waiting for another worker to take job" in run.stderr


CLIENT_SCRIPT = """
import json
from django.test import Client
from django.db import connections
from django.test.utils import setup_test_environment
from django_leases.models import Job

setup_test_environment()
client = Client()
seen = {}
for atomic in (False, True):
    # Read per request by Django's handler: the project's setting, switched in place.
    connections["default"].settings_dict["ATOMIC_REQUESTS"] = atomic
    placed = client.post("/order/", {"email": "ada@example.com"})
    result_id = placed.url.rstrip("/").rsplit("/", 1)[-1]
    poll = client.get(f"/results/{result_id}.json").json()
    seen[str(atomic)] = [placed.status_code, poll["status"], poll["finished"]]
job = Job.objects.get(pk=int(result_id))
seen["job"] = [job.task_path, job.args, job.state]
seen["missing_result"] = client.get("/results/999999.json").status_code
# Another session cannot read this one's receipt, nor this one a job of another task.
seen["other_session"] = Client().get(f"/results/{result_id}.json").status_code
from shop.tasks import resize_image
other = resize_image.enqueue("cat.png", 100).id
session = client.session
session["receipts"] = [*session["receipts"], other]
session.save()
seen["other_task"] = client.get(f"/results/{other}.json").status_code
seen["missing_job"] = client.get("/orders/jobs/999999/").status_code
print(json.dumps(seen))
"""


def test_the_order_view_redirects_to_a_result_page_that_polls_the_job(shop_db):
    """docs/django-tasks.md's example: POST an order, follow the redirect's job id to the
    JSON the status page polls (READY, not finished: no worker runs here), with and without
    ATOMIC_REQUESTS; an unknown job, another task's job and another session's receipt are
    404s, not a 500 or another customer's receipt (3, 6)."""
    import json

    run = manage(shop_db, "shell", "-c", CLIENT_SCRIPT)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["False"] == [302, "READY", False]
    assert seen["True"] == [302, "READY", False]
    assert seen["job"] == ["shop.tasks.send_receipt", [2], "pending"]
    assert (seen["missing_result"], seen["missing_job"]) == (404, 404)
    # Before: the other task's id was a 500 (TaskResultMismatch), and any session read any
    # receipt by counting ids.
    assert (seen["other_session"], seen["other_task"]) == (404, 404)


def _function_source(text: str, name: str) -> str:
    """The decorator line, the def and its body: up to the first line back at column 0."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {name}("))
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()),
        len(lines),
    )
    return "\n".join(lines[start - 1 : end]).rstrip()


def test_the_quick_starts_checkpoint_example_is_the_code_the_demo_runs():
    """docs/quickstart.md's nightly_backfill is word for word the shop's, which the tour
    above kills mid-job and checks resumes after the committed cursor."""
    docs = (SHOP.parent / "docs" / "quickstart.md").read_text()
    shop = (SHOP / "shop" / "tasks.py").read_text()
    shown = _function_source(docs, "nightly_backfill")
    assert shown.startswith("@task\ndef nightly_backfill(") and "job.checkpoint(" in shown
    assert shown == _function_source(shop, "nightly_backfill")
