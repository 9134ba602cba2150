"""The admin in a real browser: headless Chromium logs in, filters, acts, reads the message.

Needs Debian's ``chromium`` (/usr/bin/chromium, or LEASES_CHROMIUM). Without it the test is
skipped, unless LEASES_REQUIRE_BROWSER=1 (CI) turns the skip into a failure. Screenshots are
written to docs/images/, which docs/admin.md shows.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db.models import Value
from django.db.models.functions import Now

from django_leases.models import Job, WorkerProcess
from django_leases.states import JobState
from tests.worker_helpers import worker_row

pytestmark = pytest.mark.django_db(transaction=True)

# The screenshots in docs/images are remade with LEASES_SCREENSHOTS=docs/images; a plain run
# writes them to a temporary folder, so testing leaves the working tree as it was.
IMAGES = Path(os.environ.get("LEASES_SCREENSHOTS") or tempfile.mkdtemp(prefix="leases-shots-"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def chromium_path() -> str:
    path = os.environ.get("LEASES_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        message = f"no Chromium at {path} (apt-get install chromium)"
        if os.environ.get("LEASES_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def admin_static():
    """Serve the admin's CSS and JS from the live server, so screenshots look like the admin.

    tests/settings.py has no STATIC_URL (and a live server started without one fails every
    request), so unless it gains one, point STATIC_URL/STATIC_ROOT at the admin's own static
    directory. Session-scoped: it must be in force when the session's live server starts.
    """
    from django.conf import settings
    from django.test import override_settings

    if settings.STATIC_URL:
        yield
        return
    import django.contrib.admin

    root = Path(django.contrib.admin.__file__).parent / "static"
    with override_settings(STATIC_URL="/static/", STATIC_ROOT=str(root)):
        yield


@pytest.fixture
def admin_server(admin_static, live_server):
    return live_server


def seconds(n: float) -> Value:
    return Value(timedelta(seconds=n))


def claim(worker: str, task: str, args: list, queue: str = "default") -> Job:
    job = Job.objects.enqueue(task, args, queue_name=queue)
    [claimed] = Job.objects.claim(worker, [queue])
    assert claimed.pk == job.pk
    return Job.objects.get(pk=job.pk)


def seconds_in(pattern: str, cells: list[str]) -> int:
    """The number in the one cell that reads ``pattern``."""
    [number] = [m.group(1) for t in cells if (m := re.fullmatch(pattern, t))] or [None]
    assert number is not None, (pattern, cells)
    return int(number)


@pytest.fixture
def jobs():
    """A small, lifelike queue: running, expired, stalled, failed, done and waiting jobs."""
    worker_row("web-1:4242", "web-1", 4242, ["default", "emails"])
    worker_row("web-2:977", "web-2", 977, ["reports"])
    WorkerProcess.objects.filter(worker_id="web-2:977").update(last_seen_at=Now() - seconds(340))
    healthy = claim("web-1:4242", "shop.tasks.send_receipt", [1042], "emails")
    expired = claim("web-2:977", "shop.tasks.build_report", [{"month": "2026-10"}], "reports")
    stalled = claim("web-1:4242", "shop.tasks.resize_images", [77, {"sizes": [64, 256]}])
    failing = Job.objects.enqueue(
        "shop.tasks.charge_card",
        [{"order": 991, "amount": "12.50"}],
        {"idempotency_key": "ord-991"},
        max_attempts=2,
    )
    [attempt] = Job.objects.claim("web-1:4242")
    assert attempt.pk == failing.pk
    assert Job.objects.fail(
        attempt,
        exception_class_path="shop.errors.CardDeclined",
        message="card declined (insufficient funds)",
        traceback="Traceback (most recent call last):\n"
        '  File "shop/tasks.py", line 48, in charge_card\n'
        "    gateway.charge(order, amount)\n"
        "shop.errors.CardDeclined: card declined (insufficient funds)",
    )
    Job.objects.filter(pk=failing.pk).update(available_at=Now())
    [attempt] = Job.objects.claim("web-1:4242")
    assert Job.objects.fail(
        attempt,
        exception_class_path="shop.errors.CardDeclined",
        message="card declined (insufficient funds)",
        traceback="...",
    )
    done = Job.objects.enqueue("shop.tasks.send_receipt", [1041], queue_name="emails")
    [attempt] = Job.objects.claim("web-1:4242", ["emails"])
    assert Job.objects.ack(attempt, {"sent_to": "ada@example.com"})
    waiting = Job.objects.enqueue("shop.tasks.send_newsletter", [], {"issue": 12}, delay=3600)
    # Time passes on the database clock: one lease ran out, one worker stopped renewing.
    Job.objects.filter(pk=expired.pk).update(
        lease_expires_at=Now() - seconds(185), heartbeat_at=Now() - seconds(340)
    )
    Job.objects.filter(pk=stalled.pk).update(heartbeat_at=Now() - seconds(95))
    Job.objects.filter(pk=healthy.pk).update(lease_expires_at=Now() + seconds(24))
    return {
        "seeded_at": time.monotonic(),
        "healthy": healthy,
        "expired": expired,
        "stalled": stalled,
        "failing": failing,
        "done": done,
        "waiting": waiting,
    }


def test_operator_filters_expired_jobs_cancels_one_and_reads_the_result(
    admin_server, jobs, monkeypatch
):
    """Invariants 1 and 2 end to end: the expired filter is the database's Now() predicate, and
    the message reports the cancel verb's rowcount."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    # Playwright's sync API runs an event loop in this thread; the ORM calls below are plain
    # synchronous calls all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    User.objects.create_superuser("ops", "ops@example.com", "a-long-test-password")
    IMAGES.mkdir(parents=True, exist_ok=True)
    jobs_url = f"{admin_server.url}/admin/django_leases/job/"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.goto(f"{admin_server.url}/admin/login/?next=/admin/django_leases/job/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "a-long-test-password")
            page.click("input[type=submit], button[type=submit]")
            page.wait_for_url(jobs_url)
            page.click("#toggle-nav-sidebar")  # more room for the list in the screenshots
            assert page.locator("#leases-summary").is_visible()
            lease_cells = page.locator("td.field-lease").all_inner_texts()
            # Browser start-up takes seconds of real time (more on a busy machine); the
            # wording follows the database clock, so the bounds widen by what has passed.
            passed = time.monotonic() - jobs["seeded_at"] + 1
            assert "expired 3 min ago" in lease_cells
            assert (
                95 <= seconds_in(r"stalled: no heartbeat for (\d+) s", lease_cells) <= 95 + passed
            )
            assert 24 - passed <= seconds_in(r"expires in (\d+) s", lease_cells) <= 24
            page.screenshot(path=str(IMAGES / "admin-job-list.png"), full_page=True)

            page.get_by_role("link", name="expired (claimed, lease passed)").click()
            page.wait_for_url("**/?lease=expired")
            ids = page.locator("input.action-select").evaluate_all("els => els.map(e => e.value)")
            assert ids == [str(jobs["expired"].pk)]
            assert page.locator("td.field-lease").all_inner_texts() == ["expired 3 min ago"]
            page.screenshot(path=str(IMAGES / "admin-expired-filter.png"), full_page=True)

            page.check("#action-toggle")
            page.select_option("select[name=action]", "cancel")
            page.click("button[name=index]")
            # The action asks first, naming the job and who holds it; nothing changed yet.
            assert "claimed by web-2:977" in page.locator("#leases-confirm-jobs").inner_text()
            assert Job.objects.get(pk=jobs["expired"].pk).state == JobState.CLAIMED
            page.screenshot(path=str(IMAGES / "admin-action-confirm.png"), full_page=True)
            page.click("input[type=submit]")
            message = page.locator("ul.messagelist li").inner_text()
            assert message == "1 of 1 cancelled."
            page.screenshot(path=str(IMAGES / "admin-action-result.png"), full_page=True)

            page.goto(f"{jobs_url}{jobs['failing'].pk}/change/")
            failures = page.locator("tr.leases-failure")
            assert failures.count() == 2
            assert "CardDeclined" in failures.nth(0).inner_text()
            assert page.locator("input[name=lease_expires_at]").count() == 0
            page.screenshot(path=str(IMAGES / "admin-job-detail.png"), full_page=True)

            page.goto(f"{admin_server.url}/admin/django_leases/workerprocess/")
            statuses = page.locator("td.field-status").all_inner_texts()
            assert sorted(statuses) == ["alive", "gone: not seen for 5 min"]
            page.screenshot(path=str(IMAGES / "admin-workers.png"), full_page=True)
        finally:
            browser.close()

    after = Job.objects.get(pk=jobs["expired"].pk)
    assert after.state == JobState.CANCELLED and after.claim_token is None
    [entry] = LogEntry.objects.all()
    assert (entry.object_id, entry.user.username) == (str(after.pk), "ops")
    # Nothing else was touched.
    assert Job.objects.get(pk=jobs["healthy"].pk).state == JobState.CLAIMED
    assert Job.objects.get(pk=jobs["stalled"].pk).state == JobState.CLAIMED
