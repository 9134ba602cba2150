"""System checks: every bad option is an error that names it, each with its own id."""

from __future__ import annotations

import pytest
from django.core.checks import Error, Warning
from django.test import override_settings

from django_leases.checks import check_backend, check_database
from django_leases.conf import LeaseOptions, get_options
from django_leases.exceptions import InvalidLeaseOption

BACKEND = "django_leases.backends.LeaseBackend"


def ids(options):
    return [m.id for m in check_backend("default", options) if isinstance(m, Error)]


@pytest.mark.parametrize(
    ("options", "check_id", "named"),
    [
        ({"LEASE_SECONDS": 12 * 3600 + 1}, "django_leases.E001", "LEASE_SECONDS"),
        ({"LEASE_SECONDS": 0.5}, "django_leases.E001", "LEASE_SECONDS"),
        ({"LEASE_SECONDS": "30"}, "django_leases.E001", "LEASE_SECONDS"),
        ({"LEASE_SECONDS": float("nan")}, "django_leases.E001", "LEASE_SECONDS"),
        ({"HEARTBEAT_SECONDS": float("nan")}, "django_leases.E002", "HEARTBEAT_SECONDS"),
        ({"LEASE_SECONDS": 30, "HEARTBEAT_SECONDS": 30}, "django_leases.E002", "HEARTBEAT_SECONDS"),
        ({"HEARTBEAT_SECONDS": 0}, "django_leases.E002", "HEARTBEAT_SECONDS"),
        ({"LEASE_SECOND": 30}, "django_leases.E003", "LEASE_SECOND"),
        ({"MAX_ATTEMPTS": 0}, "django_leases.E005", "MAX_ATTEMPTS"),
        ({"MAX_ATTEMPTS": 2.5}, "django_leases.E005", "MAX_ATTEMPTS"),
        ({"RETENTION_DAYS": -1}, "django_leases.E006", "RETENTION_DAYS"),
        ({"POLL_SECONDS": 0}, "django_leases.E007", "POLL_SECONDS"),
        ({"CONCURRENCY": 0}, "django_leases.E008", "CONCURRENCY"),
        ({"GRACE_SECONDS": -1}, "django_leases.E009", "GRACE_SECONDS"),
        ({"DATABASE": "nowhere"}, "django_leases.E010", "DATABASE"),
        ({"NOTIFY": "yes"}, "django_leases.E011", "NOTIFY"),
        ({"QUEUE_OPTIONS": {"reports": {"LEASE_SECONDS": 0}}}, "django_leases.E012",
         "QUEUE_OPTIONS['reports']['LEASE_SECONDS']"),
        ({"QUEUE_OPTIONS": {"reports": {"LEASE": 60}}}, "django_leases.E012",
         "QUEUE_OPTIONS['reports']['LEASE']"),
    ],
)
def test_each_bad_option_is_an_error_with_its_own_id_naming_the_option(options, check_id, named):
    messages = check_backend("default", options)
    assert [m.id for m in messages if isinstance(m, Error)] == [check_id]
    assert f"[{named!r}]" in messages[0].msg


def test_an_unknown_option_suggests_the_close_one():
    [message] = [m for m in check_backend("default", {"LEASE_SECOND": 30}) if isinstance(m, Error)]
    assert "did you mean 'LEASE_SECONDS'" in message.msg


def test_defaults_are_modelled_on_sqs_and_pass():
    options = LeaseOptions.from_dict({})
    assert options.lease_seconds == 30 and options.heartbeat_seconds == 10
    assert ids({}) == []


def test_from_dict_raises_the_first_problem_naming_the_option():
    with pytest.raises(InvalidLeaseOption, match="HEARTBEAT_SECONDS"):
        LeaseOptions.from_dict({"LEASE_SECONDS": 5, "HEARTBEAT_SECONDS": 6})


@override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"LEASE_SECONDS": 60}}})
def test_get_options_reads_the_lease_backend_of_tasks():
    assert get_options().lease_seconds == 60
    assert get_options("default").heartbeat_seconds == 20


@pytest.mark.django_db(databases="__all__")
@override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"LEASE_SECONDS": 99999}}})
def test_django_check_framework_runs_the_backend_checks():
    from django.core.checks import run_checks

    assert "django_leases.E001" in [m.id for m in run_checks()]


def test_a_database_without_skip_locked_that_is_not_sqlite_is_refused():
    from django.db import connections

    connection = connections["default"]
    if connection.vendor == "sqlite":
        pytest.skip("needs a server database whose feature flag the test can turn off")
    features = connection.features
    saved = features.has_select_for_update_skip_locked
    features.has_select_for_update_skip_locked = False
    try:
        [message] = check_database("default", "default")
    finally:
        features.has_select_for_update_skip_locked = saved
    assert message.id == "django_leases.E004" and "SKIP LOCKED" in message.msg


def test_sqlite_without_immediate_transactions_is_warned_about():
    from django.db import connections

    connection = connections["default"]
    if connection.vendor != "sqlite":
        assert check_database("default", "default") == []
        return
    saved = connection.settings_dict["OPTIONS"].pop("transaction_mode", None)
    try:
        [message] = check_database("default", "default")
    finally:
        connection.settings_dict["OPTIONS"]["transaction_mode"] = saved
    assert isinstance(message, Warning) and message.id == "django_leases.W001"
    assert check_database("default", "default") == []
