"""The admin: lease wording on the database clock, filters, counts, permissions, actions.

Rows are put into lease situations the way time would: the tests move lease_expires_at and
heartbeat_at on the database clock (Now() +/- an interval) instead of sleeping.
"""

from __future__ import annotations

import contextlib
import re
import threading
import uuid
from datetime import timedelta
from html import unescape
from unittest import mock

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.db.models import Value
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_leases.admin import JobAdmin
from django_leases.admin_lists import LeaseAdminPaginator
from django_leases.durations import duration_text
from django_leases.models import Job, JobFailure, WorkerProcess
from django_leases.states import FailureKind, JobState
from tests.worker_helpers import (
    ROW_INSTANCE,
    held_open,
    worker_row,
)

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"
LIST = "/admin/django_leases/job/"
WORKERS = "/admin/django_leases/workerprocess/"
# tests/settings.py: LEASE_SECONDS 30, so the heartbeat period is 10 s and a claim is
# stalled after 20 s without a renewal.


def seconds(n: float) -> Value:
    return Value(timedelta(seconds=n))


def claimed_job(
    worker: str = "w1",
    *,
    queue: str = "default",
    task: str = TASK,
    expires_in: float = 25,
    heartbeat_ago: float = 0,
) -> Job:
    """A job claimed by ``worker``, its lease and last renewal placed on the database clock.

    The claim is made in a queue of its own, so that older pending or expired jobs of the
    test are not taken instead; the job then moves to ``queue``.
    """
    job = Job.objects.enqueue(task, [1, 2], queue_name=f"claim-{uuid.uuid4()}")
    [claim] = Job.objects.claim(worker, [job.queue_name])
    assert claim.pk == job.pk
    Job.objects.filter(pk=job.pk).update(
        queue_name=queue,
        lease_expires_at=Now() + seconds(expires_in),
        heartbeat_at=Now() - seconds(heartbeat_ago),
    )
    return Job.objects.get(pk=job.pk)


def dead_job(queue: str = "default") -> Job:
    job = claimed_job(queue=queue)
    assert Job.objects.fail(job, message="boom", traceback="Traceback: boom", retry=False)
    return Job.objects.get(pk=job.pk)


def succeeded_job(queue: str = "default") -> Job:
    job = claimed_job(queue=queue)
    assert Job.objects.ack(job, {"ok": True})
    return Job.objects.get(pk=job.pk)


def rows(response) -> dict[int, str]:
    """Map each job id on the page to the visible text of its row."""
    found = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", response.content.decode(), re.S):
        link = re.search(r'href="/admin/django_leases/(?:job|workerprocess)/(\d+)/change/', row)
        if link:
            text = unescape(re.sub(r"<[^>]+>", " | ", row))
            found[int(link.group(1))] = re.sub(r"[\s|]*\|[\s|]*", " | ", text).strip(" |")
    return found


def cell(response, pk: int, field: str) -> str:
    row = re.search(
        rf"<tr>(?:(?!</tr>).)*?/{pk}/change/(?:(?!</tr>).)*?</tr>", response.content.decode(), re.S
    )
    assert row, f"no row for {pk}"
    value = re.search(rf'class="field-{field}[ "][^>]*>(.*?)</t[dh]>', row.group(0), re.S)
    assert value, f"no {field} cell for {pk}"
    return unescape(re.sub(r"<[^>]+>", "", value.group(1))).strip()


def staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_leases", codename__in=codenames)
    )
    return user


@pytest.fixture
def viewer(client):
    client.force_login(staff("viewer", "view_job", "view_workerprocess"))
    return client


@pytest.fixture
def operator(client):
    client.force_login(
        staff("operator", "view_job", "change_job", "delete_job", "view_workerprocess")
    )
    return client


# -- the lease column ----------------------------------------------------------------------


def test_lease_column_reads_countdown_expiry_and_stall(admin_client):
    """Invariant 1: lease wording is computed from database-clock values only."""
    healthy = claimed_job("w1", expires_in=42.5)
    expired = claimed_job("w2", expires_in=-200)
    stalled = claimed_job("w3", expires_in=60, heartbeat_ago=95.5)
    pending = Job.objects.enqueue(TASK, [3, 4])
    response = admin_client.get(LIST)
    # Half a second of margin each way; a loaded machine may spend more between statements.
    assert cell(response, healthy.pk, "lease") in ("expires in 42 s", "expires in 41 s")
    assert cell(response, expired.pk, "lease") == "expired 3 min ago"
    assert cell(response, stalled.pk, "lease") in (
        "stalled: no heartbeat for 95 s",
        "stalled: no heartbeat for 96 s",
    )
    assert cell(response, pending.pk, "lease") == "—"
    assert cell(response, stalled.pk, "heartbeat_age") in ("95 s ago", "96 s ago")
    assert cell(response, healthy.pk, "attempts_of_max") == "1/5"
    # Why a claim is stalled is judged as the filter judges it, by its worker's own period:
    # a worker beating every 60 s, stopped, its claim renewed 30 s ago, is gone, not silent.
    WorkerProcess.objects.register(
        "w-slow", instance="slow", hostname="h", pid=9, queues=["default"], heartbeat_seconds=60
    )
    WorkerProcess.objects.stopped("w-slow", "slow")
    slow = claimed_job("w-slow", expires_in=100, heartbeat_ago=30)
    assert cell(admin_client.get(LIST), slow.pk, "lease").startswith(
        "stalled: worker gone, expires in"
    )
    assert cell(response, healthy.pk, "fence") == "1"
    assert cell(response, healthy.pk, "claimed_by") == "w1"
    assert cell(response, pending.pk, "due") == "now"


def test_lease_column_ignores_the_web_servers_clock(admin_client):
    """Invariant 1 (one clock): a web server whose clock is a day ahead shows the same lease."""
    healthy = claimed_job("w1", expires_in=42.5)
    with mock.patch("django.utils.timezone.now", return_value=timezone.now() + timedelta(days=1)):
        response = admin_client.get(LIST)
    assert cell(response, healthy.pk, "lease") in ("expires in 42 s", "expires in 41 s")


def test_a_claim_whose_worker_is_gone_is_stalled_though_it_renewed_recently(admin_client):
    """Invariant 4: a stalled claim is only shown; its lease is left to run out."""
    worker_row("w-gone", "h1", 7, ["default"])
    WorkerProcess.objects.filter(worker_id="w-gone").update(last_seen_at=Now() - seconds(60))
    job = claimed_job("w-gone", expires_in=30.5, heartbeat_ago=1)
    response = admin_client.get(LIST)
    assert cell(response, job.pk, "lease") in (
        "stalled: worker gone, expires in 30 s",
        "stalled: worker gone, expires in 29 s",
    )
    job.refresh_from_db()
    assert job.state == JobState.CLAIMED and job.lease_expires_at > job.heartbeat_at


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.4, "0 s"),
        (42.9, "42 s"),
        (119, "119 s"),
        (180, "3 min"),
        (7199, "119 min"),
        (7200, "2 h"),
        (3 * 86400, "3 d"),
        (-95, "95 s"),
    ],
)
def test_duration_text(value, text):
    """Whole units, rounded down, for ages and what is left of a lease."""
    assert duration_text(value) == text


# -- filters, search and counts ------------------------------------------------------------


@pytest.fixture
def lease_mix():
    worker_row("w-stopped", "h", 1, ["default"])
    WorkerProcess.objects.stopped("w-stopped", ROW_INSTANCE)
    jobs = {
        "healthy": claimed_job("w1", expires_in=25),
        "expired": claimed_job("w2", expires_in=-5),
        "silent": claimed_job("w3", expires_in=25, heartbeat_ago=22),
        "orphan": claimed_job("w-stopped", expires_in=25),
        "emails": claimed_job("w1", queue="emails", task="tests.testapp.tasks.send_receipt"),
    }
    jobs["pending"] = Job.objects.enqueue(TASK, [5, 6])
    return jobs


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("lease=expired", {"expired"}),
        ("lease=stalled", {"silent", "orphan"}),
        ("lease=claimed", {"healthy", "silent", "orphan", "emails"}),
        ("state__exact=pending", {"pending"}),
        ("queue=emails", {"emails"}),
        ("task=tests.testapp.tasks.send_receipt", {"emails"}),
        ("queue=default&lease=claimed", {"healthy", "silent", "orphan"}),
    ],
)
def test_filters(admin_client, lease_mix, query, expected):
    """Invariant 1: expired and stalled are predicates on Now(), evaluated by the database."""
    response = admin_client.get(f"{LIST}?{query}")
    assert response.status_code == 200
    assert set(rows(response)) == {lease_mix[name].pk for name in expected}


def test_filter_choices_come_from_the_table_and_the_configured_queues(admin_client, lease_mix):
    response = admin_client.get(LIST)
    specs = {
        spec.parameter_name: [c["display"] for c in spec.choices(response.context["cl"])]
        for spec in response.context["cl"].filter_specs
        if hasattr(spec, "parameter_name")
    }
    assert specs["queue"] == ["All", "default", "emails", "reports"]
    assert specs["task"] == ["All", TASK, "tests.testapp.tasks.send_receipt"]
    assert len(specs["lease"]) == 4


def test_search_by_id_task_and_worker(admin_client, lease_mix):
    def found(term):
        return set(rows(admin_client.get(LIST, {"q": term})))

    assert found(str(lease_mix["expired"].pk)) == {lease_mix["expired"].pk}
    assert found("send_receipt") == {lease_mix["emails"].pk}
    assert found("w1") == {lease_mix["healthy"].pk, lease_mix["emails"].pk}
    assert found("no-such-thing") == set()


def test_a_task_search_names_the_tasks_present_instead_of_scanning_for_a_substring(
    admin_client, lease_mix
):
    """The census lists every task path present: a word found in some of them selects those
    tasks by the census index (queue_name, task_path), where LIKE '%word%' OR-ed with the
    unindexed claimed_by read every row (12 s for a rare task among 5,100,000 jobs,
    docs/scale.md). Each word narrows, as the admin's own search does."""
    other = claimed_job("w9", task="tests.testapp.tasks.send_receipt_copy")
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(LIST, {"q": "SEND_receipt"})
    assert set(rows(response)) == {lease_mix["emails"].pk, other.pk}
    by_name = f"{connection.ops.quote_name('task_path')} IN ("
    listing = [q["sql"] for q in queries.captured_queries if by_name in q["sql"]]
    assert listing, "the search did not select tasks by name"
    assert not any("LIKE" in q["sql"].upper() for q in queries.captured_queries)
    found = set(rows(admin_client.get(LIST, {"q": "receipt _copy"})))
    assert found == {other.pk}
    # A word no task path contains is a worker id; with a task word, both must hold.
    assert set(rows(admin_client.get(LIST, {"q": "w9"}))) == {other.pk}
    assert set(rows(admin_client.get(LIST, {"q": "receipt w1"}))) == {lease_mix["emails"].pk}
    # A quoted phrase is one word, as in Django's own search.
    assert set(rows(admin_client.get(LIST, {"q": '"receipt_copy"'}))) == {other.pk}


def test_a_word_that_is_a_known_worker_id_finds_that_workers_jobs_even_if_a_task_has_it(
    admin_client, lease_mix
):
    """Worker ids are chosen freely (--worker-id): one that is also part of a task path
    finds the worker's jobs, not the task's."""
    WorkerProcess.objects.create(worker_id="receipt", hostname="h", pid=1)
    mine = claimed_job("receipt")
    assert set(rows(admin_client.get(LIST, {"q": "receipt"}))) == {mine.pk}
    assert set(rows(admin_client.get(LIST, {"q": "send_receipt"}))) == {lease_mix["emails"].pk}


def test_counts_per_state_and_queue_above_the_list(admin_client, lease_mix):
    dead_job(queue="emails")
    response = admin_client.get(f"{LIST}?lease=expired")
    table = {
        row["queue"]: (
            dict(zip(response.context["leases_states"], [n for n, _ in row["cells"]], strict=True)),
            row["total"],
        )
        for row in response.context["leases_rows"]
    }
    assert table["default"] == (
        {"Pending": 1, "Claimed": 4, "Succeeded": 0, "Dead": 0, "Cancelled": 0},
        5,
    )
    assert table["emails"] == (
        {"Pending": 0, "Claimed": 1, "Succeeded": 0, "Dead": 1, "Cancelled": 0},
        2,
    )
    assert [n for n, _ in response.context["leases_totals"]] == [1, 5, 0, 1, 0]
    # The counts describe the whole table, whatever the list is filtered on.
    assert response.context["leases_total"] == 7
    page = response.content.decode()
    assert "1 expired lease<" in page and "2 stalled claims<" in page
    assert 'href="/admin/django_leases/job/?queue=emails&amp;state__exact=dead">1</a>' in page


def test_the_job_list_sorts_by_id_whatever_the_query_string_asks(admin_client):
    """(6) Sorting is by id only (docs/admin.md): ?o= naming another column, as a hand-made
    or old link may, is ignored (before: Django sorted a million jobs by task path or
    queue, an unindexed sort at every page, though no header offered it)."""
    for path in ("b.task", "a.task", "c.task"):
        Job.objects.enqueue(f"tests.testapp.tasks.{path}", [])
    newest_first = list(Job.objects.order_by("-id").values_list("pk", flat=True))
    # Column 1 is the id (0: the action checkbox); 2 the task path, 3 the queue.
    for order, expected in (
        ("2", newest_first),
        ("-2.-3", newest_first),
        ("3.1", newest_first[::-1]),
        ("-1", newest_first),
        ("1", newest_first[::-1]),
    ):
        response = admin_client.get(LIST, {"o": order})
        assert response.status_code == 200
        listed = [job.pk for job in response.context["cl"].result_list]
        assert listed == expected, (order, listed)


def test_paginator_counts_a_bounded_number_of_rows(admin_client, monkeypatch):
    """Counting stops at the bound; PostgreSQL then numbers pages from the planner's estimate."""
    monkeypatch.setattr(LeaseAdminPaginator, "exact_limit", 5)
    Job.objects.bulk_create([Job(task_path=TASK) for _ in range(12)])
    analyze_jobs()
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(LIST)
    assert any("LIMIT 6" in q["sql"] and "COUNT(" in q["sql"].upper() for q in queries)
    paginator = response.context["cl"].paginator
    if connection.vendor == "postgresql":
        assert paginator.is_estimate and paginator.count >= 6
        assert "about " in response.content.decode()
    else:
        assert not paginator.is_estimate and paginator.count == 12
    assert len(rows(response)) == 12


def analyze_jobs() -> None:
    """Planner statistics as of now (PostgreSQL), so its estimates are the ones tested."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {Job._meta.db_table}")


def test_an_estimate_below_the_bounded_count_is_shown_as_more_than_the_bound(
    admin_client, monkeypatch
):
    """The planner misjudges rows it has no statistics for (here a task that appeared after
    ANALYZE; on a big table, claimed jobs with a valid lease or a substring search): an
    estimate under what was counted is not shown as "about" it, the page says "more than"."""
    monkeypatch.setattr(LeaseAdminPaginator, "exact_limit", 5)
    Job.objects.bulk_create([Job(task_path=TASK) for _ in range(12)])
    analyze_jobs()
    newcomer = "tests.testapp.tasks.newcomer"
    Job.objects.bulk_create([Job(task_path=newcomer) for _ in range(10)])
    response = admin_client.get(LIST, {"task": newcomer})
    paginator = response.context["cl"].paginator
    page = re.sub(r"\s+", " ", response.content.decode())
    if connection.vendor == "postgresql":
        assert "more than 5 jobs" in page and "about " not in page
        assert paginator.is_lower_bound and not paginator.is_estimate
    else:
        assert not paginator.is_lower_bound and paginator.count == 10
        assert "10 jobs" in page
    assert len(rows(response)) == 10


def test_past_the_bound_pages_are_linked_only_as_far_as_rows_were_counted(
    admin_client, monkeypatch
):
    """A page the estimate promises may not exist, and a deep OFFSET reads every row it skips
    (3.5 s for page 100,000 of 5,100,000 jobs, docs/scale.md): past the bound the links stop
    at the rows counted. An exact count links every page."""
    monkeypatch.setattr(LeaseAdminPaginator, "exact_limit", 5)
    monkeypatch.setattr(JobAdmin, "list_per_page", 2)
    Job.objects.bulk_create([Job(task_path=TASK) for _ in range(12)])
    analyze_jobs()
    response = admin_client.get(LIST)
    linked = {int(n) for n in re.findall(r'href="\?p=(\d+)"', response.content.decode())}
    if connection.vendor == "postgresql":
        assert response.context["cl"].paginator.is_estimate
        assert linked == {2, 3}  # rows 1-6 were counted; page 1 is the current one
        assert len(rows(admin_client.get(LIST, {"p": 6}))) == 2  # still opens when asked
    else:
        assert linked == {2, 3, 4, 5, 6}


# -- the detail page -------------------------------------------------------------------------


def test_detail_shows_pretty_json_error_history_and_timestamps(admin_client):
    """Invariant 3: every failed attempt stays visible, with its traceback."""
    job = Job.objects.enqueue(
        TASK, [{"order": 7, "lines": [1, 2]}], {"notify": True}, max_attempts=3
    )
    [claim] = Job.objects.claim("w1")
    assert Job.objects.checkpoint(claim, {"done": 40})
    assert Job.objects.fail(
        claim,
        exception_class_path="builtins.ValueError",
        message="bad order",
        traceback='Traceback (most recent call last):\n  File "shop.py"\nValueError: bad order',
    )
    assert Job.objects.filter(pk=job.pk).retry_now() == 1  # skip the retry backoff
    [claim] = Job.objects.claim("w2")
    Job.objects.filter(pk=job.pk).update(lease_expires_at=Now() - seconds(1))
    [claim] = Job.objects.claim("w3")
    assert Job.objects.ack(claim, {"total": 12.5})
    response = admin_client.get(f"/admin/django_leases/job/{job.pk}/change/")
    page = unescape(response.content.decode())
    assert '"order": 7' in page and '"lines": [\n' in page  # indented, not one line
    assert '"notify": true' in page and '"done": 40' in page and '"total": 12.5' in page
    failures = re.findall(r'<tr class="leases-failure">(.*?)</tr>', page, re.S)
    assert len(failures) == 2 == JobFailure.objects.filter(job=job).count()
    assert (
        "builtins.ValueError" in failures[0]
        and '<pre class="leases-traceback">Traceback' in failures[0]
    )
    assert "w1" in failures[0] and "w2" in failures[1] and "Lease expired" in failures[1]
    for label in ("Enqueued at", "First claimed at", "Last claimed at", "Finished at"):
        assert label in page


def test_detail_labels_each_shown_value_with_its_own_name(admin_client):
    """Invariant 6: what the page shows of a caller's arguments is labelled as such (the
    schedule's link was labelled "Args" and the arguments "Args pretty" before)."""
    job = Job.objects.enqueue(TASK, [1], {"b": 2})
    page = admin_client.get(f"/admin/django_leases/job/{job.pk}/change/").content.decode()
    labels = re.findall(r"<label>([^<]*):</label>", page)
    for label in (
        "Made by schedule",
        "Args",
        "Kwargs",
        "Lease",
        "Checkpoint cursor",
        "Result",
        "Failed attempts",
    ):
        assert labels.count(label) == 1, (label, labels)
    assert not [label for label in labels if "pretty" in label.lower()], labels


def test_detail_is_read_only_and_cannot_be_posted(admin_client):
    """Invariant 2: no hand edit of a lease; only the verbs' conditional updates change a job."""
    job = claimed_job("w1")
    url = f"/admin/django_leases/job/{job.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert 'name="lease_expires_at"' not in page and 'name="claim_token"' not in page
    assert 'name="_save"' not in page
    assert str(job.claim_token) in page
    response = admin_client.post(url, {"lease_expires_at": "2000-01-01 00:00", "state": "pending"})
    assert response.status_code == 403
    assert admin_client.get("/admin/django_leases/job/add/").status_code == 403
    assert admin_client.post(f"/admin/django_leases/job/{job.pk}/delete/").status_code == 403
    after = Job.objects.get(pk=job.pk)
    assert (after.state, after.claim_token, after.lease_expires_at) == (
        job.state,
        job.claim_token,
        job.lease_expires_at,
    )


# -- permissions -----------------------------------------------------------------------------


def test_view_only_staff_see_the_lists_but_no_actions(viewer):
    """Invariant 2: only holders of the change permission reach the verbs."""
    job = claimed_job("w1", expires_in=-5)
    response = viewer.get(f"{LIST}?lease=expired")
    assert response.status_code == 200 and set(rows(response)) == {job.pk}
    assert 'name="action"' not in response.content.decode()
    assert viewer.get(WORKERS).status_code == 200
    viewer.post(LIST, {"action": "cancel", "_selected_action": [job.pk]})
    assert Job.objects.get(pk=job.pk).state == JobState.CLAIMED


def test_staff_with_change_permission_see_every_action(operator):
    page = operator.get(LIST).content.decode()
    for action in ("retry_now", "requeue", "cancel", "expire_stalled", "purge_finished"):
        assert f'value="{action}"' in page
    assert 'value="delete_selected"' not in page


def test_purge_asks_for_the_delete_permission_as_delete_selected_does(client):
    """Purge deletes jobs: staff with the change permission but not the delete one (who
    could purge before) see the other actions, not it, and a forced POST deletes nothing."""
    client.force_login(staff("changer", "view_job", "change_job"))
    done = succeeded_job()
    page = client.get(LIST).content.decode()
    assert 'value="cancel"' in page and 'value="purge_finished"' not in page
    client.post(LIST, {"action": "purge_finished", "_selected_action": [done.pk], "post": "yes"})
    assert Job.objects.filter(pk=done.pk).exists()


def test_purge_says_which_jobs_a_row_of_the_project_keeps(operator):
    """A job a project's row protects stays and the message says why, not "not succeeded
    or cancelled" (before: ProtectedError, a 500, and nothing purged)."""
    from tests.reportapp.models import Invoice

    kept, done, dead = succeeded_job(), succeeded_job(), dead_job()
    Invoice.objects.create(job=kept)
    assert act(operator, "purge_finished", [kept, done, dead]) == [
        "1 of 3 purged; 1 was not succeeded or cancelled; "
        "1 stays: a row of the project protects it."
    ]
    assert set(Job.objects.values_list("pk", flat=True)) == {kept.pk, dead.pk}


def test_staff_without_view_permission_are_refused(client):
    client.force_login(staff("nobody"))
    assert client.get(LIST).status_code == 403


# -- actions ---------------------------------------------------------------------------------


def act(client, action, jobs):
    """Run an action, answering yes where it asks first."""
    response = client.post(
        LIST,
        {"action": action, "_selected_action": [j.pk for j in jobs], "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_requeue_reports_what_really_changed(operator):
    """Invariant 2: the message is the verb's rowcount, not the size of the selection."""
    dead = [dead_job() for _ in range(3)]
    others = [succeeded_job(), claimed_job("w9")]
    assert act(operator, "requeue", dead + others) == [
        "3 of 5 requeued; 2 were no longer dead or cancelled."
    ]
    assert sorted(Job.objects.values_list("state", flat=True)) == sorted(
        [JobState.PENDING] * 3 + [JobState.SUCCEEDED, JobState.CLAIMED]
    )
    assert act(operator, "requeue", dead[:1]) == [
        "0 of 1 requeued; 1 was no longer dead or cancelled."
    ]


def test_retry_now_makes_delayed_pending_jobs_due(operator):
    """Invariant 1: due time is moved to the database's Now()."""
    later = Job.objects.enqueue(TASK, [1, 1], delay=3600)
    done = succeeded_job()
    assert act(operator, "retry_now", [later, done]) == ["1 of 2 made due now; 1 was not pending."]
    assert Job.objects.claimable().filter(pk=later.pk).exists()


def test_cancel_reports_finished_jobs_as_skipped(operator):
    pending = Job.objects.enqueue(TASK, [1, 1])
    done = succeeded_job()
    assert act(operator, "cancel", [pending, done]) == [
        "1 of 2 cancelled; 1 was no longer pending or claimed."
    ]
    assert Job.objects.get(pk=pending.pk).state == JobState.CANCELLED
    assert Job.objects.get(pk=done.pk).state == JobState.SUCCEEDED


def test_a_ticked_job_that_left_the_lists_filter_is_counted_as_left_alone(operator):
    """Invariant 2: on a filtered list (pending jobs), a ticked job a worker finished
    before the answer is still one the person asked for: "2 of 3", not "2 of 2"."""
    jobs = [Job.objects.enqueue(TASK, [n, 1]) for n in range(3)]
    Job.objects.filter(pk=jobs[0].pk).update(state=JobState.SUCCEEDED)
    response = operator.post(
        f"{LIST}?state__exact=pending",
        {"action": "cancel", "_selected_action": [j.pk for j in jobs], "post": "yes"},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == [
        "2 of 3 cancelled; 1 was no longer pending or claimed."
    ]


def test_a_job_that_left_the_filter_before_the_question_is_counted_through_it(operator):
    """Invariant 2: ticked on a list of pending jobs, one ran before the first submit; the
    question says 3 and carries the 3 ids, and the answer says "2 of 3"."""
    jobs = [Job.objects.enqueue(TASK, [n, 2]) for n in range(3)]
    Job.objects.filter(pk=jobs[0].pk).update(state=JobState.SUCCEEDED)
    ticked = {"action": "cancel", "_selected_action": [j.pk for j in jobs]}
    page = operator.post(f"{LIST}?state__exact=pending", ticked).content.decode()
    carried = re.findall(r'name="_selected_action" value="(\d+)"', page)
    assert sorted(map(int, carried)) == sorted(j.pk for j in jobs)
    response = operator.post(
        f"{LIST}?state__exact=pending",
        {"action": "cancel", "_selected_action": carried, "post": "yes"},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == [
        "2 of 3 cancelled; 1 was no longer pending or claimed."
    ]


def test_expire_stalled_ends_only_stalled_leases(operator):
    """Invariant 4: a healthy claim is never expired by hand, so no duplicate runs beside it;
    invariant 5: the stalled owner's token no longer wins once another worker claims."""
    healthy = claimed_job("w1", expires_in=25)
    stalled = claimed_job("w2", expires_in=25, heartbeat_ago=30)
    assert act(operator, "expire_stalled", [healthy, stalled]) == [
        "1 of 2 expired; 1 was not stalled claims."
    ]
    assert set(Job.objects.expired().values_list("pk", flat=True)) == {stalled.pk}
    assert Job.objects.get(pk=healthy.pk).lease_expires_at == healthy.lease_expires_at
    [taken] = Job.objects.claim("w3")
    assert taken.pk == stalled.pk
    assert not Job.objects.ack(stalled, "late")


def test_purge_counts_jobs_not_their_failure_rows(operator):
    """Invariant 3: only finished jobs go; dead and running ones stay for people."""
    done = succeeded_job()
    cancelled = Job.objects.enqueue(TASK, [1, 1])
    Job.objects.filter(pk=cancelled.pk).cancel()
    dead = dead_job()
    JobFailure.objects.create(job=done, attempt=1, fence=1, kind=FailureKind.EXCEPTION, message="x")
    assert act(operator, "purge_finished", [done, cancelled, dead]) == [
        "2 of 3 purged; 1 was not succeeded or cancelled."
    ]
    assert list(Job.objects.values_list("pk", flat=True)) == [dead.pk]
    assert JobFailure.objects.filter(job_id=done.pk).count() == 0


def test_actions_apply_to_every_row_selected_across_pages(operator):
    dead = [dead_job() for _ in range(3)]
    response = operator.post(
        f"{LIST}?state__exact=dead",
        {"action": "requeue", "select_across": "1", "index": "0", "_selected_action": [dead[0].pk]},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["3 of 3 requeued."]


@contextlib.contextmanager
def few_sqlite_parameters():
    """SQLite taking 999 parameters a statement (its limit before 3.32; 32,766 since, by
    default): selections larger than a statement takes, at a test's size."""
    import sqlite3

    connection.ensure_connection()
    was = connection.connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    connection.features.__dict__.pop("max_query_params", None)  # a cached_property
    try:
        yield
    finally:
        connection.connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, was)
        connection.features.__dict__.pop("max_query_params", None)


def across(client, action, state):
    """Run ``action`` on every job of ``state``, selected across the list's pages."""
    response = client.post(
        f"{LIST}?state__exact={state}",
        {
            "action": action,
            "select_across": "1",
            "index": "0",
            "post": "yes",
            "_selected_action": [Job.objects.first().pk],
        },
        follow=True,
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_an_action_across_more_jobs_than_one_statement_takes_parameters(operator):
    """Selected across pages, more jobs than a statement takes parameters (SQLite's
    32,766 by default): the action ran its verb on the ids it locked in one IN list, "too
    many SQL variables" (a 500); so did purge's delete. The ids go in chunks, the
    messages count them all."""
    if connection.vendor != "sqlite":
        pytest.skip("a per-connection parameter limit is SQLite's to lower")
    Job.objects.enqueue_many(TASK, [([1, 1], None)] * 2_500, delay=3600)
    with few_sqlite_parameters():
        assert across(operator, "retry_now", "pending") == ["2500 of 2500 made due now."]
    assert not Job.objects.filter(available_at__gt=Now()).exists()
    Job.objects.all().cancel()
    # Requeued across chunks (899 ids each here): of two jobs of one key, one in the first
    # chunk and one in the last, the newest goes back, as requeue() does in one call.
    oldest, newest = Job.objects.order_by("pk")[0].pk, Job.objects.order_by("-pk")[0].pk
    Job.objects.filter(pk__in=[oldest, newest]).update(unique_key="k")
    with few_sqlite_parameters():
        assert across(operator, "requeue", "cancelled") == [
            "2499 of 2500 requeued; 1 stays: another active job holds its unique key."
        ]
    assert Job.objects.get(pk=newest).state == JobState.PENDING
    assert Job.objects.get(pk=oldest).state == JobState.CANCELLED
    Job.objects.all().cancel()
    with few_sqlite_parameters():
        assert across(operator, "purge_finished", "cancelled") == ["2500 of 2500 purged."]
    assert not Job.objects.exists()


# -- workers ---------------------------------------------------------------------------------


def test_workers_page_shows_hosts_claims_and_who_looks_gone(admin_client):
    """Invariant 1: "gone" is judged on the database clock (last_seen_at vs Now())."""
    worker_row("w-alive", "web-1", 101, ["default", "emails"])
    worker_row("w-quiet", "web-2", 102, ["reports"])
    WorkerProcess.objects.filter(worker_id="w-quiet").update(last_seen_at=Now() - seconds(95.5))
    worker_row("w-stopped", "web-3", 103, ["default"])
    WorkerProcess.objects.stopped("w-stopped", ROW_INSTANCE)
    claimed_job("w-alive")
    claimed_job("w-alive", expires_in=-10)
    claimed_job("w-quiet", queue="reports")
    response = admin_client.get(WORKERS)
    pk = dict(WorkerProcess.objects.values_list("worker_id", "pk"))
    alive, quiet, stopped = pk["w-alive"], pk["w-quiet"], pk["w-stopped"]
    assert [cell(response, alive, f) for f in ("hostname", "pid", "queue_list")] == [
        "web-1",
        "101",
        "default, emails",
    ]
    assert cell(response, alive, "started_at")
    assert [cell(response, alive, f) for f in ("last_seen", "claims", "status")] == [
        "0 s ago",
        "2 (1 expired)",
        "alive",
    ]
    assert [cell(response, quiet, f) for f in ("last_seen", "claims", "status")] == [
        "95 s ago",
        "1",
        "gone: not seen for 95 s",
    ]
    assert [cell(response, stopped, f) for f in ("claims", "status")] == [
        "0",
        "gone: stopped 0 s ago",
    ]
    assert 'href="/admin/django_leases/job/?claimed_by=w-alive&amp;state__exact=claimed"' in (
        response.content.decode()
    )
    # The claims link lists exactly that worker's claims.
    listed = admin_client.get(LIST, {"claimed_by": "w-alive", "state__exact": "claimed"})
    assert len(rows(listed)) == 2


def test_workers_page_counts_every_workers_claims_in_one_grouped_statement(admin_client):
    """A subquery per worker walked every claimed job once for each worker listed (14 s for
    20 workers among 51,000 claims, docs/scale.md); the page now asks the jobs table once."""
    for n in range(3):
        worker_row(f"w{n}", "h", n, ["default"])
        claimed_job(f"w{n}")
    claimed_job("w0", expires_in=-10)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(WORKERS)
    pk = dict(WorkerProcess.objects.values_list("worker_id", "pk"))
    assert [cell(response, pk[w], "claims") for w in ("w0", "w1", "w2")] == [
        "2 (1 expired)",
        "1",
        "1",
    ]
    job_table = Job._meta.db_table
    reading_jobs = [q["sql"] for q in queries.captured_queries if job_table in q["sql"]]
    assert len(reading_jobs) == 1, reading_jobs
    assert "GROUP BY" in reading_jobs[0]
    assert WorkerProcess._meta.db_table not in reading_jobs[0]
    # The per-worker annotations stay for code that reads a worker or two.
    w0 = WorkerProcess.objects.with_claims().get(worker_id="w0")
    assert (w0.claims_held, w0.claims_expired, w0.looks_gone) == (2, 1, False)


def test_workers_page_is_read_only(admin_client):
    worker_row("w1", "h", 1, ["default"])
    worker = WorkerProcess.objects.get()
    assert admin_client.get("/admin/django_leases/workerprocess/add/").status_code == 403
    response = admin_client.post(
        f"/admin/django_leases/workerprocess/{worker.pk}/change/", {"hostname": "evil"}
    )
    assert response.status_code == 403
    assert WorkerProcess.objects.get().hostname == "h"


# -- confirmation and the admin log ----------------------------------------------------------


@pytest.mark.parametrize("action", ["cancel", "expire_stalled", "purge_finished"])
def test_actions_that_stop_or_delete_ask_first_and_change_nothing_until_confirmed(operator, action):
    """The first POST shows the selected jobs and a question; only the second acts (2)."""
    jobs = {
        "cancel": claimed_job("w1"),
        "expire_stalled": claimed_job("w1", heartbeat_ago=600),
        "purge_finished": succeeded_job(),
    }
    job = jobs[action]
    response = operator.post(LIST, {"action": action, "_selected_action": [job.pk]})
    page = response.content.decode()
    assert response.status_code == 200 and 'id="leases-question"' in page
    assert str(job) in unescape(page)
    assert f'name="_selected_action" value="{job.pk}"' in page
    assert 'name="post" value="yes"' in page
    after = Job.objects.get(pk=job.pk)
    assert (after.state, after.lease_expires_at) == (job.state, job.lease_expires_at)
    assert act(operator, action, [job])[0].startswith("1 of 1 ")


def test_the_confirmation_names_the_owner_of_a_claimed_job_only(operator):
    """A job whose attempt failed and waits for its retry keeps the id of its last worker
    in claimed_by; the page asking to cancel it names an owner only for a job that is
    claimed (before: "claimed by w2" for a pending job no worker held)."""
    held = claimed_job("w1")
    released = claimed_job("w2")
    assert Job.objects.fail(released, message="boom", retry=True)
    page = unescape(
        operator.post(
            LIST, {"action": "cancel", "_selected_action": [held.pk, released.pk]}
        ).content.decode()
    )
    assert f"{held} — claimed by w1" in page
    released = Job.objects.get(pk=released.pk)
    assert released.claimed_by == "w2" and released.state == JobState.PENDING
    assert f"{released}</li>" in page and "claimed by w2" not in page


def test_a_confirmed_action_across_every_page_acts_on_the_filtered_jobs(operator):
    """select_across carries through the question: the filter, not the page, is acted on."""
    expired = [claimed_job("w1", expires_in=-5) for _ in range(3)]
    healthy = claimed_job("w2")
    ask = operator.post(
        f"{LIST}?lease=expired",
        {"action": "cancel", "select_across": "1", "_selected_action": [expired[0].pk]},
    )
    assert 'name="select_across" value="1"' in ask.content.decode()
    response = operator.post(
        f"{LIST}?lease=expired",
        {
            "action": "cancel",
            "select_across": "1",
            "_selected_action": [expired[0].pk],
            "post": "yes",
        },
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["3 of 3 cancelled."]
    assert Job.objects.get(pk=healthy.pk).state == JobState.CLAIMED
    # Logged as changed, though the cancel took them out of the filter (?lease=expired).
    from django.contrib.admin.models import CHANGE, LogEntry

    logged = LogEntry.objects.values_list("object_id", "action_flag")
    assert sorted(logged) == sorted((str(job.pk), CHANGE) for job in expired)


def test_a_confirmed_action_across_more_jobs_than_a_form_may_carry_acts_on_them_all(
    operator, settings
):
    """Confirming an action on "all N jobs" sends the form the page gives, as a browser
    does: it carried every id of the filter as a field of its own, and above Django's
    DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000; 20 here) the answer was a 400 with nothing done.
    Across pages the filter is the selection; "No, take me back" keeps the filter."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 20
    jobs = [Job.objects.enqueue(TASK, [n, 1], queue_name="q-many") for n in range(30)]
    other = Job.objects.enqueue(TASK, [0, 0])
    url = f"{LIST}?queue_name=q-many"
    ask = operator.post(
        url, {"action": "cancel", "select_across": "1", "_selected_action": [jobs[0].pk]}
    )
    page = ask.content.decode()
    fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page)
    assert len(fields) < 20, fields
    assert f'href="{url}"' in page
    data: dict[str, list[str]] = {}
    for name, value in fields:
        data.setdefault(name, []).append(unescape(value))
    response = operator.post(url, data, follow=True)
    assert response.status_code == 200
    assert [str(m) for m in response.context["messages"]] == ["30 of 30 cancelled."]
    assert Job.objects.get(pk=other.pk).state == JobState.PENDING


def test_each_job_an_action_changed_gets_an_admin_log_entry(operator):
    """The admin log names every job the verb changed (a deletion for a purged one), and
    none it skipped: the rowcount's jobs, not the selection (2)."""
    from django.contrib.admin.models import CHANGE, DELETION, LogEntry

    pending = Job.objects.enqueue(TASK, [1, 1])
    done = succeeded_job()
    act(operator, "cancel", [pending, done])
    [entry] = LogEntry.objects.all()
    assert (entry.object_id, entry.action_flag, entry.user.username) == (
        str(pending.pk),
        CHANGE,
        "operator",
    )
    assert entry.get_change_message() == "Cancelled by the admin action."
    # Named as the action left it, as Django logs an object after its save.
    assert entry.object_repr == f"{TASK} #{pending.pk} (cancelled)"
    act(operator, "purge_finished", [done, Job.objects.get(pk=pending.pk), dead_job()])
    deleted = LogEntry.objects.filter(action_flag=DELETION)
    assert sorted(int(e.object_id) for e in deleted) == sorted([done.pk, pending.pk])
    assert not Job.objects.filter(pk__in=[done.pk, pending.pk]).exists()


@pytest.mark.django_db(transaction=True)
def test_a_change_made_by_another_session_during_an_action_is_not_logged_as_its(operator):
    """The admin log is the action's own changes: a job claimed by a worker while Retry now
    ran (its UPDATE waited on the claim's lock, then matched no row) was logged as "Made
    due now by the admin action." under "0 of 1 made due now", since the jobs were
    compared before and after. The action locks the selection it reads: it waits for the
    claim, reads the job claimed, changes and logs nothing (2)."""
    from django.contrib.admin.models import LogEntry

    if connection.vendor == "sqlite":
        pytest.skip("SQLite's IMMEDIATE transactions take turns: no lock to wait on")
    pending = Job.objects.enqueue(TASK, [1, 1])
    waited: list[bool] = []

    def claim():
        [claim] = Job.objects.claim("w-race", ["default"])
        assert claim.pk == pending.pk

    with held_open(claim) as held:

        def commit_once_the_action_waits():
            try:
                waited.append(held.until_it_blocks_another())
            finally:
                held.commit()
                connection.close()

        releaser = threading.Thread(target=commit_once_the_action_waits)
        releaser.start()
        said = act(operator, "retry_now", [pending])
        releaser.join(30)
    assert waited == [True], "the action never waited: no race"
    assert said == ["0 of 1 made due now; 1 was not pending."]
    assert not LogEntry.objects.exists()
    assert Job.objects.get(pk=pending.pk).state == JobState.CLAIMED


def test_requeue_reports_jobs_whose_unique_key_is_held_apart(operator):
    """A dead job whose unique key an active job holds stays dead, and the message says why
    instead of calling it ineligible."""
    first = Job.objects.enqueue(TASK, [1, 1], unique_key="report-2026-11")
    [claim] = Job.objects.claim("w1", ["default"])
    assert claim.pk == first.pk
    assert Job.objects.fail(claim, message="boom", retry=False)
    Job.objects.enqueue(TASK, [1, 1], unique_key="report-2026-11")
    other_dead = dead_job()
    assert act(
        operator, "requeue", [Job.objects.get(pk=first.pk), other_dead, succeeded_job()]
    ) == [
        "1 of 3 requeued; 1 was no longer dead or cancelled; "
        "1 stays: another active job holds its unique key."
    ]
    assert Job.objects.get(pk=first.pk).state == JobState.DEAD


def test_requeue_of_two_jobs_sharing_a_unique_key_puts_one_back(operator):
    """Two dead jobs of one unique key, selected together: the action raised an
    IntegrityError (a 500). The newest goes back; the message says why the other stays."""
    older = Job.objects.enqueue(TASK, [1, 1], unique_key="report-2026-11")
    Job.objects.filter(pk=older.pk).update(state=JobState.DEAD)
    newer = Job.objects.enqueue(TASK, [1, 2], unique_key="report-2026-11")
    Job.objects.filter(pk=newer.pk).update(state=JobState.DEAD)
    assert act(operator, "requeue", [older, newer]) == [
        "1 of 2 requeued; 1 stays: another active job holds its unique key."
    ]
    assert Job.objects.get(pk=newer.pk).state == JobState.PENDING
    assert Job.objects.get(pk=older.pk).state == JobState.DEAD


@pytest.mark.parametrize(
    "url",
    [
        f"{LIST}?queue_name=%00",
        f"{LIST}?queue=a%00b",
        f"{LIST}?task=%00",
        f"{LIST}?state__exact=%00",
        f"{LIST}?claimed_by__exact=w%00",
        f"{WORKERS}?worker_id=%00",
        "/admin/django_leases/schedule/?task_path=%00",
    ],
)
def test_a_nul_in_a_filter_is_refused_as_a_bad_lookup_not_a_500(admin_client, url):
    """(6) PostgreSQL cannot hold NUL in text: such a filter was a DataError when the page
    was read, a 500 (elsewhere it is no value a row could hold either). It is refused as
    Django refuses a lookup it cannot use: back to the list with ?e=1, which says so."""
    Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])
    response = admin_client.get(url)
    assert response.status_code == 302, response.status_code
    assert response["Location"].endswith("?e=1")
    assert admin_client.get(response["Location"]).status_code == 200


@pytest.mark.parametrize(
    "url",
    [
        f"{LIST}?claimed_by__regex=(",
        f"{LIST}?task_path__icontains=add",
        f"{LIST}?args__contains=1",
        f"{LIST}?args=1",
        f"{LIST}?pk__regex=(",
        f"{LIST}?pk__contains=1",
        f"{LIST}?failures__message__icontains=boom",
        f"{WORKERS}?hostname__startswith=a",
        "/admin/django_leases/schedule/?name__iregex=a",
        # A date part out of its range, or not a number: each was a 500 (ValueError).
        f"{LIST}?enqueued_at__year=99999",
        f"{LIST}?enqueued_at__year=0",
        # The calendar's ends: Django's bounds moved to UTC leave datetime's range (SQLite).
        f"{LIST}?enqueued_at__year=9999",
        f"{LIST}?enqueued_at__year__lt=1",
        f"{LIST}?finished_at__year=10000",
        f"{LIST}?enqueued_at__month=13",
        f"{LIST}?enqueued_at__year__in=2026,99999",
        f"{LIST}?enqueued_at__year=soon",
        f"{WORKERS}?started_at__year=99999",
        "/admin/django_leases/schedule/?created_at__year=99999",
        # Django never splits an address's __range value: a 500 (IndexError) or refused.
        f"{LIST}?id__range=5",
        f"{LIST}?id__range=1&id__range=5",
        f"{LIST}?id__range=1,5",
    ],
)
def test_a_filter_asking_a_column_more_than_its_value_is_refused(admin_client, url):
    """(6) Django's admin takes any lookup on a model's own field from the address:
    ``?claimed_by__regex=(`` was a 500 (the database refused the pattern) and a contains or
    a JSON lookup read every job at each page. Such a filter is refused as a lookup Django
    cannot use (?e=1); a column's value, a range or isnull, a part of a date (what
    date_hierarchy asks) and the list's own filters are not."""
    Job.objects.enqueue("tests.testapp.tasks.add", [1, 2])
    response = admin_client.get(url)
    assert response.status_code == 302, response.status_code
    assert response["Location"].endswith("?e=1")
    for fine in (
        f"{LIST}?state__exact=pending&queue=default&claimed_by=w1&lease=expired",
        f"{LIST}?queue_name=default&id__in=1,2&priority__gte=0&pk__lt=100",
        f"{LIST}?enqueued_at__year=2026&enqueued_at__month=12&enqueued_at__date__gte=2020-01-01",
        f"{LIST}?enqueued_at__year__in=2025,2026&enqueued_at__quarter=4&id__gte=1&id__lte=5",
        f"{WORKERS}?worker_id=w1",
        "/admin/django_leases/schedule/?paused__exact=1&backend=default",
    ):
        assert admin_client.get(fine).status_code == 200, fine


# -- the log and the change commit together; the limits of one request -----------------------


def _request_of(user: User):
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.test import RequestFactory

    request = RequestFactory().post(LIST)
    request.user = user
    request.session = {}
    request._messages = FallbackStorage(request)
    return request


@pytest.mark.django_db(transaction=True)
def test_an_action_whose_log_entries_cannot_be_written_changes_nothing():
    """Invariant 3: the entries go in the action's own transaction. A user row gone
    meanwhile (the entry's foreign key refused, as a killed web process would leave it
    unwritten) rolls the action back; before, the jobs stayed requeued with no entry."""
    from django.contrib import admin
    from django.contrib.admin.models import LogEntry
    from django.db import IntegrityError

    dead = [dead_job() for _ in range(2)]
    ghost = User(pk=987_654, username="ghost", is_staff=True, is_superuser=True)
    job_admin = admin.site._registry[Job]
    with pytest.raises(IntegrityError):
        job_admin.requeue(_request_of(ghost), Job.objects.filter(pk__in=[j.pk for j in dead]))
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.DEAD}
    assert not LogEntry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_schedule_switch_whose_log_entries_cannot_be_written_changes_nothing():
    """Invariant 3: pausing schedules commits with its entries or not at all."""
    from django.contrib import admin
    from django.db import IntegrityError

    from django_leases.models import Schedule

    schedule = Schedule.objects.create(
        name="nightly", task_path=TASK, spec={"every": 60}, backend="default"
    )
    ghost = User(pk=987_654, username="ghost", is_staff=True, is_superuser=True)
    schedule_admin = admin.site._registry[Schedule]
    with pytest.raises(IntegrityError):
        schedule_admin.pause(_request_of(ghost), Schedule.objects.filter(pk=schedule.pk))
    schedule.refresh_from_db()
    assert not schedule.paused


def test_a_jobs_page_shows_its_last_failed_attempts_and_counts_the_rest(admin_client):
    """Invariant 3: every failure row stays; the page shows the last 50, oldest of them
    first, and says how many came before (20,000 rows made a 107 MB page)."""
    job = dead_job()
    JobFailure.objects.bulk_create(
        JobFailure(
            job=job,
            attempt=n,
            fence=n,
            worker_id="w1",
            kind=FailureKind.EXCEPTION,
            exception_class_path="builtins.ValueError",
            message=f"failure number {n}.",
        )
        for n in range(1, 61)
    )
    page = unescape(admin_client.get(f"{LIST}{job.pk}/change/").content.decode())
    shown = re.findall(r"failure number (\d+)\.", page)
    assert shown == [str(n) for n in range(11, 61)]
    total = JobFailure.objects.filter(job=job).count()  # dead_job() made one more
    assert total >= 60
    assert f"{total - 50} earlier failed attempts not shown" in page


def test_purging_more_than_one_request_can_take_is_refused_before_asking(operator):
    """Invariant 3: past 10,000 finished jobs the purge is refused with a message naming
    leases_prune, and nothing is deleted; at the limit it asks as before."""
    Job.objects.bulk_create(
        Job(task_path=TASK, state=JobState.SUCCEEDED, queue_name="bulk-done") for _ in range(10_001)
    )
    response = operator.post(
        f"{LIST}?queue=bulk-done",
        {"action": "purge_finished", "select_across": "1", "index": "0", "_selected_action": ["1"]},
        follow=True,
    )
    messages_shown = [str(m) for m in response.context["messages"]]
    assert any(
        "More than 10,000 finished jobs" in m and "leases_prune" in m for m in messages_shown
    )
    assert Job.objects.filter(queue_name="bulk-done").count() == 10_001
    Job.objects.filter(pk=Job.objects.filter(queue_name="bulk-done").first().pk).delete()
    response = operator.post(
        f"{LIST}?queue=bulk-done",
        {"action": "purge_finished", "select_across": "1", "index": "0", "_selected_action": ["1"]},
    )
    assert b"Are you sure?" in response.content
