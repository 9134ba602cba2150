"""The lease advisor: percentiles of seeded handler durations, verdicts, the command, the admin page.

Finished jobs are seeded with known durations around one reading of the database clock, so
every duration the advisor computes (finished_at - last_attempted_at) is exact.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db.models.functions import Now
from django.test import override_settings

from django_leases import advisor
from django_leases.durations import duration_text
from django_leases.exceptions import InvalidLeaseOption
from django_leases.models import Job
from django_leases.states import JobState

pytestmark = pytest.mark.django_db

ADD = "tests.testapp.tasks.add"  # queue "default": lease 30 s (tests/settings.py)
RECEIPT = "tests.testapp.tasks.send_receipt"  # queue "emails"
ADVISOR = "/admin/django_leases/job/advisor/"


def db_now():
    """One reading of the database clock, to anchor seeded stamps on."""
    job = Job.objects.enqueue(ADD, [0, 0])
    now = Job.objects.filter(pk=job.pk).annotate(now=Now()).values_list("now", flat=True).get()
    job.delete()
    return now


def seed(
    task_path: str,
    durations: list[float],
    *,
    lease: float = 30.0,
    ago: timedelta = timedelta(0),
    state: str = JobState.SUCCEEDED,
) -> None:
    """Finished jobs of ``task_path``, one per duration, that finished ``ago`` before now."""
    end = db_now() - ago
    Job.objects.bulk_create(
        [
            Job(
                task_path=task_path,
                queue_name="default",
                state=state,
                lease_seconds=lease,
                attempts=1,
                fence=1,
                last_attempted_at=end - timedelta(seconds=d),
                finished_at=end,
            )
            for d in durations
        ]
    )


def by_task(rows):
    return {r.task_path: r for r in rows}


def test_percentiles_are_nearest_rank_on_a_known_distribution():
    """p50/p99/p99.9/max of 1..1000 s are 500, 990, 999 and 1000: observed values, no interpolation."""
    seed(ADD, [float(i) for i in range(1000, 0, -1)])
    [row] = advisor.report()
    assert (row.samples, row.p50, row.p99, row.p999, row.max) == (1000, 500.0, 990.0, 999.0, 1000.0)


def test_durations_come_from_database_stamps_and_only_succeeded_jobs():
    """Only succeeded jobs count, and the duration is finished_at - last_attempted_at as stored."""
    seed(ADD, [2.5] * 30)
    seed(ADD, [500.0] * 5, state=JobState.DEAD)
    rows = list(Job.objects.handler_durations())
    assert len(rows) == 30
    assert {(task, lease, duration) for task, lease, duration in rows} == {
        (ADD, 30.0, timedelta(seconds=2.5))
    }


def test_days_window_is_measured_on_the_database_clock():
    """Jobs that finished before the window (Now() - days) are left out; --days 0 keeps all."""
    seed(ADD, [1.0] * 25)
    seed(ADD, [100.0] * 25, ago=timedelta(days=10))
    [recent] = advisor.report(7)
    assert (recent.samples, recent.max) == (25, 1.0)
    [everything] = advisor.report(None)
    assert (everything.samples, everything.max) == (50, 100.0)


def test_lease_below_p999_with_headroom_is_flagged_with_the_lease_to_use():
    """A 30 s lease for handlers whose p99.9 is 999 s: duplicates likely without heartbeats;
    recommend ceil(999 x 1.5) = 1499 s."""
    seed(ADD, [float(i) for i in range(1, 1001)])
    [row] = advisor.report()
    assert [f.code for f in row.findings] == [advisor.SHORT]
    assert row.recommended_lease == 1499.0
    assert "duplicates are likely" in row.verdict and "set the lease to 25.0 min" in row.verdict


def test_lease_that_fits_is_ok_and_never_recommended_below_the_floor():
    """Handlers up to 1 s under a 30 s lease: no finding, and the recommendation stays at the
    30 s floor that outlasts a database failover."""
    seed(RECEIPT, [i / 100 for i in range(1, 101)])
    [row] = advisor.report()
    assert row.ok, row.verdict
    assert (row.p999, row.recommended_lease) == (1.0, 30.0)


@override_settings(
    TASKS={
        "default": {
            "BACKEND": "django_leases.backends.LeaseBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"LEASE_SECONDS": 30, "QUEUE_OPTIONS": {"emails": {"LEASE_SECONDS": 600}}},
        }
    }
)
def test_lease_far_above_need_is_flagged():
    """A 600 s lease for sub-second handlers: a crash stalls the job 600 s; recommend 30 s."""
    seed(RECEIPT, [i / 100 for i in range(1, 101)], lease=600)
    [row] = advisor.report()
    assert row.lease == 600.0
    assert [f.code for f in row.findings] == [advisor.LONG]
    assert row.recommended_lease == 30.0


@override_settings(
    TASKS={
        "default": {
            "BACKEND": "django_leases.backends.LeaseBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"LEASE_SECONDS": 30, "HEARTBEAT_SECONDS": 15},
        }
    }
)
def test_heartbeat_above_a_third_of_the_lease_is_flagged():
    """HEARTBEAT_SECONDS 15 for a 30 s lease: fewer than two beats may fail; at most 10 s."""
    seed(ADD, [1.0] * 50)
    [row] = advisor.report()
    assert row.heartbeat == 15.0
    assert [f.code for f in row.findings] == [advisor.HEARTBEAT]
    assert row.recommended_heartbeat == 10.0


def test_few_samples_are_reported_but_not_judged():
    """Below --min-samples the tail is a guess: the figures are shown, no lease verdict given."""
    seed(ADD, [1000.0] * 5)
    [row] = advisor.report()
    assert [f.code for f in row.findings] == [advisor.FEW]


def test_undeclared_task_falls_back_to_the_lease_its_jobs_carried():
    """A task no longer declared is judged against the lease stored on its finished jobs."""
    seed("gone.tasks.old", [1.0] * 30, lease=45)
    [row] = advisor.report()
    assert row.lease == 45.0 and row.ok


def test_command_prints_a_table_and_verdicts_per_task():
    """lease_report: one table row per task with the percentiles, lease and heartbeat, then verdicts."""
    seed(ADD, [float(i) for i in range(1, 1001)])
    seed(RECEIPT, [0.5] * 40)
    out = StringIO()
    call_command("lease_report", stdout=out, no_color=True)
    text = out.getvalue()
    header, rule, add_line, receipt_line = text.splitlines()[:4]
    assert header.split() == [
        "task",
        "jobs",
        "p50",
        "p99",
        "p99.9",
        "max",
        "lease",
        "heartbeat",
        "advice",
    ]
    cells = re.split(r"\s{2,}", add_line.strip())
    assert cells == [
        ADD,
        "1000",
        "8.3 min",
        "16.5 min",
        "16.6 min",
        "16.7 min",
        "30 s",
        "lease/3",
        advisor.SHORT,
    ]
    assert re.split(r"\s{2,}", receipt_line.strip())[-1] == "ok"
    assert f"{ADD}: lease 30 s is below p99.9 16.6 min x 1.5" in text


def test_command_json_and_check_exit_status():
    """--json carries the recommendation; --check exits 1 while a task has a finding."""
    seed(ADD, [float(i) for i in range(1, 1001)])
    out = StringIO()
    call_command("lease_report", "--json", stdout=out)
    [row] = json.loads(out.getvalue())
    assert (row["task"], row["p99_9"], row["recommended_lease"]) == (ADD, 999.0, 1499.0)
    with pytest.raises(CommandError) as raised:
        call_command("lease_report", "--check", stdout=StringIO())
    assert raised.value.returncode == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--days", "40000"], "--days: must be at least 0 and at most 36500, got 40000"),
        (["--days", "99999999"], "--days: must be at least 0 and at most 36500"),
        (["--days", "nan"], "--days: must be at least 0 and at most 36500, got nan"),
        (["--days", "-1"], "--days: must be at least 0 and at most 36500, got -1"),
        (["--headroom", "inf"], "--headroom: must be at least 1 and at most 100, got inf"),
        (["--headroom", "nan"], "--headroom: must be at least 1 and at most 100, got nan"),
        (["--headroom", "0.5"], "--headroom: must be at least 1 and at most 100"),
        (["--min-lease", "nan"], "--min-lease: must be at least 1 and at most 43200, got nan"),
        (["--min-samples", "0"], "--min-samples: must be at least 1 and at most 1000000000"),
    ],
)
def test_command_options_out_of_range_are_refused_naming_them(argv, said):
    """(6) Before: --days was checked as seconds (40000 accepted, 99999999 a DataError
    traceback), --headroom inf or nan a traceback, --min-lease nan accepted and a 9 s
    lease recommended below it."""
    with pytest.raises(CommandError, match=re.escape(said)):
        call_command("lease_report", *argv, stdout=StringIO())


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"since_days": -1}, "since_days"),
        ({"since_days": "7"}, "since_days"),
        ({"headroom": float("nan")}, "headroom"),
        ({"floor": 0.1}, "floor"),
        ({"min_samples": 2.5}, "min_samples"),
        ({"min_samples": True}, "min_samples"),
    ],
)
def test_report_refuses_arguments_out_of_range_naming_them(kwargs, named):
    """(6) advisor.report() is public: its own checks, not only the command's (before,
    report(headroom=nan) recommended nan leases and report(min_samples=2.5) compared
    counts with a float)."""
    with pytest.raises(InvalidLeaseOption) as raised:
        advisor.report(**kwargs)
    assert raised.value.option == named


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.25, "0.25 s"), (4.5, "4.5 s"), (12, "12 s"), (500, "8.3 min"), (7200, "2.0 h")],
)
def test_measured_durations_keep_their_digits_on_the_admins_ladder_of_units(value, text):
    """The advisor's figures (precise) and the admin's ages change unit at the same
    lengths: one function writes both."""
    assert duration_text(value, precise=True) == text
    assert duration_text(value).split()[1] == text.split()[1]


def test_command_with_no_finished_jobs_says_so():
    """An empty table is a sentence, not an error."""
    out = StringIO()
    call_command("lease_report", stdout=out)
    assert "nothing to measure yet" in out.getvalue()


def test_admin_advisor_page_shows_the_same_verdicts(client):
    """The admin page (linked from the job list) shows each task's figures and findings."""
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client.login(username="admin", password="pw")
    seed(ADD, [float(i) for i in range(1, 1001)])
    seed(RECEIPT, [0.5] * 40)
    listing = client.get("/admin/django_leases/job/")
    assert b'id="leases-advisor-link"' in listing.content and ADVISOR.encode() in listing.content
    page = client.get(ADVISOR)
    assert page.status_code == 200
    html = page.content.decode()
    assert f'data-task="{ADD}" class="leases-advice-warn"' in html
    assert f'data-code="{advisor.SHORT}"' in html
    assert f'data-task="{RECEIPT}" class="leases-advice-ok"' in html
    assert "<td>16.6 min</td>" in html and "<td>25.0 min</td>" in html


def test_admin_advisor_page_needs_view_permission(client):
    """Anonymous users are sent to the login page; staff without view permission get 403."""
    assert client.get(ADVISOR).status_code == 302
    User.objects.create_user("staff", password="pw", is_staff=True)
    client.login(username="staff", password="pw")
    assert client.get(ADVISOR).status_code == 403


@pytest.mark.parametrize(
    "days, window",
    [("-1", "7"), ("inf", "7"), ("nan", "7"), ("x", "7"), ("1e9", "7"), ("30", "30"), ("0", "all")],
)
def test_admin_advisor_page_falls_back_to_a_week_on_a_bad_window(client, days, window):
    """?days= that is not a sane number of days shows the default week instead of an error."""
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client.login(username="admin", password="pw")
    seed(ADD, [1.0, 2.0])
    page = client.get(ADVISOR, {"days": days})
    assert page.status_code == 200
    assert f"over the last {window} days" in page.content.decode()
