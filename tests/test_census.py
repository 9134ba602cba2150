"""The admin's census on a big PostgreSQL table: every group present, exact counts up to
the cap, estimates past it, marked as such."""

from __future__ import annotations

import pytest
from django.db import connection

from django_leases.models import Job
from django_leases.operators import CENSUS_CAP
from django_leases.states import JobState

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_big_table_census_finds_every_group_and_counts_small_ones_exactly():
    """Invariant 6's cousin for operators: the header never hides a queue, task or state
    that has jobs (a skip scan finds each), counts up to CENSUS_CAP are the GROUP BY's, and
    a larger group is an estimate never below the cap, flagged ``estimated``."""
    if connection.vendor != "postgresql":
        pytest.skip("the sampled census is PostgreSQL's")
    groups = {
        ("default", "tests.testapp.tasks.add", JobState.PENDING): 3,
        ("default", "tests.testapp.tasks.add", JobState.SUCCEEDED): CENSUS_CAP + 500,
        ("emails", "tests.testapp.tasks.add", JobState.DEAD): 1,
        ("emails", "tests.testapp.tasks.other", JobState.CANCELLED): 7,
        ("rare", "tests.testapp.tasks.add", JobState.PENDING): 1,
    }
    Job.objects.bulk_create(
        Job(queue_name=q, task_path=t, state=s) for (q, t, s), n in groups.items() for _ in range(n)
    )
    exact = {(r["queue_name"], r["task_path"], r["state"]): r["n"] for r in Job.objects.census()}
    assert exact == groups
    big = Job.objects.all()._pg_big_census(connection.alias)
    found = {(r["queue_name"], r["task_path"], r["state"]): r for r in big}
    assert set(found) == set(groups)
    for key, n in groups.items():
        if n <= CENSUS_CAP:
            assert (found[key]["n"], found[key]["estimated"]) == (n, False), key
        else:
            assert found[key]["estimated"] and found[key]["n"] > CENSUS_CAP, found[key]
