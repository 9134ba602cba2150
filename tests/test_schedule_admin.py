"""The schedules page: next and last run on the database clock, pause, resume, run now,
and the link from a job back to the schedule that made it."""

from __future__ import annotations

from datetime import timedelta
from html import unescape

import pytest
from django.db.models import F
from django.db.models.functions import Now

from django_leases.enqueue_options import EnqueueOptions
from django_leases.models import Job, Schedule, ScheduleRun
from django_leases.schedules import Periodic, ScheduleSpec

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"
LIST = "/admin/django_leases/schedule/"


def fields_for(schedule):
    return EnqueueOptions.of({}).check(schedule.task_path)


@pytest.fixture
def schedule():
    Schedule.objects.sync("default", [ScheduleSpec("nightly", TASK, Periodic(every=600))])
    Schedule.objects.enqueue_due("default", fields_for)
    return Schedule.objects.get(name="nightly")


def place(name, seconds):
    """The next tick ``seconds`` from the database's now (negative: in the past)."""
    Schedule.objects.filter(name=name).update(
        next_tick_at=Now() + timedelta(seconds=seconds), revision=F("revision") + 1
    )


def act(client, action, schedule):
    return client.post(
        LIST, {"action": action, "_selected_action": [schedule.pk], "index": 0}, follow=True
    )


def test_the_list_says_when_the_next_run_is_and_what_the_last_one_made(admin_client, schedule):
    """Invariant 1: "in 4 min" is the next tick minus the database's now; the last run
    shows its job (linked) and the job's state."""
    place("nightly", 4 * 60 + 30)
    page = unescape(admin_client.get(LIST).content.decode())
    assert "in 4 min" in page and "every 600 s" in page
    place("nightly", -1)
    Schedule.objects.enqueue_due("default", fields_for)
    job = Job.objects.get()
    page = unescape(admin_client.get(LIST).content.decode())
    assert f"/admin/django_leases/job/{job.pk}/change/" in page
    assert f"job {job.pk}" in page and "(Pending)" in page


def test_pause_and_resume_actions(admin_client, schedule):
    """Invariant 3: the actions call the verbs and say how many rows changed."""
    page = act(admin_client, "pause", schedule).content.decode()
    assert "1 of 1 paused" in page
    assert Schedule.objects.get(pk=schedule.pk).paused
    assert "paused" in unescape(admin_client.get(LIST).content.decode())
    page = act(admin_client, "pause", schedule).content.decode()
    assert "0 of 1 paused" in page
    page = act(admin_client, "resume", schedule).content.decode()
    assert "1 of 1 resumed" in page
    row = Schedule.objects.get(pk=schedule.pk)
    assert not row.paused and row.next_tick_at is None


def test_run_now_enqueues_a_job_that_links_back(admin_client, schedule):
    """Invariant 3: run now makes one job (not a tick), and the job's page names the
    schedule that made it."""
    page = unescape(act(admin_client, "run_now", schedule).content.decode())
    job = Job.objects.get()
    assert f"job {job.pk}" in page
    run = ScheduleRun.objects.get()
    assert (run.kind, run.job_id, run.tick_at) == ("run_now", job.pk, None)
    row = Schedule.objects.get(pk=schedule.pk)
    assert (row.ticks, row.last_tick_at) == (0, None)
    job_page = unescape(
        admin_client.get(f"/admin/django_leases/job/{job.pk}/change/").content.decode()
    )
    assert f"/admin/django_leases/schedule/{schedule.pk}/change/" in job_page
    assert "run now" in job_page


def test_a_schedule_page_lists_its_recent_runs(admin_client, schedule):
    """Invariant 3: ticks, skipped ticks and run-now jobs are all visible on the page."""
    place("nightly", -1)
    Schedule.objects.enqueue_due("default", fields_for)
    page = unescape(admin_client.get(f"{LIST}{schedule.pk}/change/").content.decode())
    assert "recent runs" in page.lower() and "tick" in page
    assert "misfire: once; overlap: allow" in page


def test_a_schedule_of_a_task_no_longer_declared_is_not_run(admin_client, schedule):
    """Invariant 6: run now on a schedule whose task the code lost says so; nothing is
    written."""
    Schedule.objects.filter(pk=schedule.pk).update(task_path="tests.testapp.tasks.gone")
    page = unescape(act(admin_client, "run_now", schedule).content.decode())
    assert "Not run: nightly" in page
    assert Job.objects.count() == 0


def test_schedule_actions_write_the_admin_log_as_job_actions_do(admin_client, schedule):
    """Pause, Resume and Run now wrote no admin log entry (every job action does): each
    schedule an action changed gets one, none it left alone."""
    from django.contrib.admin.models import LogEntry

    act(admin_client, "pause", schedule)
    act(admin_client, "pause", schedule)  # already paused: no change, no entry
    act(admin_client, "resume", schedule)
    act(admin_client, "run_now", schedule)
    job = Job.objects.get()
    said = [e.get_change_message() for e in LogEntry.objects.order_by("pk")]
    assert said == [
        "Paused by the admin action.",
        "Resumed from now by the admin action.",
        f"Run now by the admin action: job {job.pk}.",
    ]
    assert {e.object_id for e in LogEntry.objects.all()} == {str(schedule.pk)}


def test_a_schedule_removed_from_the_code_is_not_run_now(admin_client, schedule):
    """Run now on a schedule the code no longer declares (the list says "removed from
    code") enqueued its job: refused, saying why; nothing is written."""
    Schedule.objects.sync("default", [])
    page = unescape(act(admin_client, "run_now", schedule).content.decode())
    assert "Not run: nightly: removed from the code" in page
    assert not Job.objects.exists() and not ScheduleRun.objects.exists()


def test_run_now_of_a_schedule_whose_backend_is_gone_says_so(admin_client, schedule):
    """Invariant 6: a row whose backend alias left settings.TASKS is refused naming the
    backend (before: "no task ... is declared", which sent people to the code)."""
    Schedule.objects.filter(pk=schedule.pk).update(backend="retired")
    page = unescape(act(admin_client, "run_now", schedule).content.decode())
    assert "Not run: nightly: its backend 'retired' is no longer in settings.TASKS" in page
    assert not Job.objects.exists() and not ScheduleRun.objects.exists()


def test_run_now_on_a_held_unique_key_says_so(admin_client, schedule, monkeypatch):
    """Invariant 3: a task whose unique_key is held (on_duplicate="merge") is not run now:
    the page says why (no server error) and no run links the other call's job."""
    from django_leases import schedule_query

    keyed = EnqueueOptions.of({"unique_key": "report", "on_duplicate": "merge"})
    monkeypatch.setattr(schedule_query, "fields_for", lambda s: keyed.check(s.task_path))
    held = Job.objects.enqueue(TASK, [0, 0], unique_key="report")
    response = act(admin_client, "run_now", schedule)
    assert response.status_code == 200
    assert "Not run: nightly" in unescape(response.content.decode())
    assert list(Job.objects.values_list("pk", flat=True)) == [held.pk]
    assert not ScheduleRun.objects.exists()
