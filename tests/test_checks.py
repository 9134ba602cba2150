"""System checks: every bad option is an error that names it, each with its own id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.checks import Error, Warning
from django.test import override_settings

from django_leases.checks import check_backend, check_database
from django_leases.conf import LeaseOptions, get_options
from django_leases.exceptions import InvalidLeaseOption
from tests.worker_helpers import ROOT

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
        (
            {"QUEUE_OPTIONS": {"reports": {"LEASE_SECONDS": 0}}},
            "django_leases.E012",
            "['QUEUE_OPTIONS']['reports']['LEASE_SECONDS']",
        ),
        (
            {"QUEUE_OPTIONS": {"reports": {"LEASE": 60}}},
            "django_leases.E012",
            "['QUEUE_OPTIONS']['reports']['LEASE']",
        ),
        ({"RETRY": []}, "django_leases.E014", "RETRY"),  # before: the default ladder
        ({"RETRY": list(range(51))}, "django_leases.E014", "RETRY"),
        (
            {"QUEUE_OPTIONS": {"reports": {"RETRY": {"delays": []}}}},
            "django_leases.E012",
            "['QUEUE_OPTIONS']['reports']['RETRY']['delays']",
        ),
        ({"TASK_MODULES": "shop.jobs"}, "django_leases.E016", "TASK_MODULES"),
        (
            {"TASK_MODULES": ["tests.testapp.no_such_module"]},
            "django_leases.E016",
            "['TASK_MODULES'][0]",
        ),
        ({"TASK_MODULES": [""]}, "django_leases.E016", "['TASK_MODULES'][0]"),
    ],
)
def test_each_bad_option_is_an_error_with_its_own_id_naming_the_option(options, check_id, named):
    messages = check_backend("default", options)
    assert [m.id for m in messages if isinstance(m, Error)] == [check_id]
    path = named if named.startswith("[") else f"[{named!r}]"
    assert f"TASKS['default']['OPTIONS']{path} " in messages[0].msg


def test_a_message_names_the_setting_as_python_would_index_it():
    """(6) OPTIONS that is no dict is TASKS[alias]['OPTIONS'] (before: ['OPTIONS'] twice),
    and a per-queue option's path reads as an index, not as a quoted string of one."""
    [message] = check_backend("default", [])
    assert message.msg.startswith("TASKS['default']['OPTIONS'] must be a dict"), message.msg
    [message] = check_backend("default", {"QUEUE_OPTIONS": {"reports": {"RETRY": "x"}}})
    assert "TASKS['default']['OPTIONS']['QUEUE_OPTIONS']['reports']['RETRY']" in message.msg


@pytest.mark.parametrize(
    ("retry", "said"),
    [
        ([], "['RETRY'] is an empty list of delays"),
        ([10, -1], "['RETRY'][1] must be"),
        ({"delays": []}, "['RETRY']['delays'] is an empty list of delays"),
        ({"delays": [10, -1]}, "['RETRY']['delays'][1] must be"),
        ({"delays": "30"}, "['RETRY']['delays'] must be a list of delays in seconds"),
        ({"factor": 0.5}, "['RETRY']['factor'] must be a number >= 1"),
    ],
)
def test_a_retry_setting_is_named_where_python_indexes_it(retry, said):
    """(6) E014 names the place in RETRY as Python indexes the setting (before: "RETRY:
    retry: is an empty list", the enqueue() option's name inside the setting's)."""
    [message] = check_backend("default", {"RETRY": retry})
    assert message.id == "django_leases.E014"
    assert message.msg.startswith(f"TASKS['default']['OPTIONS']{said}"), message.msg


@pytest.mark.parametrize(
    ("queues", "said"),
    [
        ("default", "['QUEUES'] must be a list of queue names, got 'default'"),
        ([5], "['QUEUES'][0]: a queue name must be 1-100 characters, got 5"),
        (["default", "x" * 101], "['QUEUES'][1]: a queue name must be 1-100 characters"),
        (["default", "nul\x00"], "['QUEUES'][1]: a queue name contains a NUL character"),
        ({"default", 5}, "['QUEUES'] item 5: a queue name must be 1-100 characters, got 5"),
    ],
)
def test_queues_that_are_not_a_list_of_names_are_an_error(queues, said):
    """(6) Django's own QUEUES key, read as Django reads it: a string would be its letters
    (and every task's import fails on "Queue 'default' is not valid"), a name that is no
    text fails at the worker's start as a --queue it was not given (before: check passed
    both). E022 names QUEUES; a list of names, or an empty one (any name), passes."""
    tasks = {"default": {"BACKEND": BACKEND, "QUEUES": queues}}
    with override_settings(TASKS=tasks):
        [error] = [m for m in check_backend("default", {}) if m.id == "django_leases.E022"]
    assert isinstance(error, Error) and error.msg.startswith(f"TASKS['default']{said}"), error.msg
    for fine in (["default", "emails"], [], ("default",)):
        with override_settings(TASKS={"default": {"BACKEND": BACKEND, "QUEUES": fine}}):
            assert "django_leases.E022" not in {m.id for m in check_backend("default", {})}


def test_per_queue_options_for_a_queue_not_listed_are_warned_of():
    """(6) QUEUE_OPTIONS for a queue QUEUES does not list apply to no job (a typo loses its
    lease and retry overrides without a word; before: check passed). W004 names it and
    the closest listed queue; with QUEUES empty (any name) every queue may hold jobs."""
    options = {"QUEUE_OPTIONS": {"emial": {"LEASE_SECONDS": 60}, "reports": {"MAX_ATTEMPTS": 2}}}
    [warning] = [m for m in check_backend("default", options) if m.id == "django_leases.W004"]
    assert isinstance(warning, Warning)
    assert "['QUEUE_OPTIONS']['emial']" in warning.msg and warning.hint == "Did you mean 'emails'?"
    tasks = {"default": {"BACKEND": BACKEND, "QUEUES": [], "OPTIONS": options}}
    with override_settings(TASKS=tasks):
        assert "django_leases.W004" not in {m.id for m in check_backend("default", options)}
    # Without QUEUES, Django's default: "default" only.
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": options}}):
        found = [m.msg for m in check_backend("default", options) if m.id == "django_leases.W004"]
    assert sorted("emial" if "['emial']" in m else "reports" for m in found) == ["emial", "reports"]
    # Nothing names a QUEUES key the settings do not have.
    assert all(
        "other than 'default', the only queue of a backend without QUEUES" in m for m in found
    )
    assert not any("['QUEUES']" in m for m in found), found


def test_an_unknown_option_suggests_the_close_one():
    [message] = [m for m in check_backend("default", {"LEASE_SECOND": 30}) if isinstance(m, Error)]
    assert "did you mean 'LEASE_SECONDS'?" in message.msg


@pytest.mark.parametrize(
    ("options", "said"),
    [
        # in lower case: no suggestion before, and no stop before "Known options"
        (
            {"lease_seconds": 30},
            "['lease_seconds'] is not an option of django_leases; "
            "did you mean 'LEASE_SECONDS'? Known options: DATABASE, ",
        ),
        (
            {"NOTHING_LIKE_IT": 1},
            "['NOTHING_LIKE_IT'] is not an option of django_leases. Known options: DATABASE, ",
        ),
        # an entry of TASK_MODULES named as Python indexes it (was "['TASK_MODULES'] [0] ...")
        (
            {"TASK_MODULES": ["tests.testapp.no_such_module"]},
            "TASKS['default']['OPTIONS']['TASK_MODULES'][0] 'tests.testapp.no_such_module' is not "
            "a module that can be imported",
        ),
        (
            {"TASK_MODULES": ["tests.testapp.tasks", ""]},
            "TASKS['default']['OPTIONS']['TASK_MODULES'][1] must be a dotted module path",
        ),
    ],
)
def test_option_messages_read_as_sentences_naming_the_setting(options, said):
    messages = [m for m in check_backend("default", options) if isinstance(m, Error)]
    assert any(said in m.msg for m in messages), [m.msg for m in messages]


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


def test_a_mysql_jobs_database_in_repeatable_read_is_warned_about():
    """Under REPEATABLE READ a plain read in the caller's transaction does not see a job
    committed since it began: enqueue with a key another transaction took raised a bare
    IntegrityError "kept conflicting; try again", which no retry of that transaction
    mends. The setting is named (W006); Django's default, read committed, is not."""
    from django.db import connection

    if connection.vendor != "mysql":
        pytest.skip("isolation_level is MySQL's OPTIONS here")
    options = connection.settings_dict["OPTIONS"]
    saved = options.get("isolation_level")
    try:
        options["isolation_level"] = "repeatable read"
        [message] = check_database("default", "default")
        options["isolation_level"] = None  # Django sets none: the server's default
        [unset] = check_database("default", "default")
        assert unset.id == "django_leases.W006" and "None" in unset.msg
        options["isolation_level"] = "read committed"
        assert check_database("default", "default") == []
    finally:
        options.pop("isolation_level")
        if saved is not None:
            options["isolation_level"] = saved
    assert isinstance(message, Warning) and message.id == "django_leases.W006"
    assert "isolation_level" in message.msg and "'repeatable read'" in message.msg


def test_backends_sharing_a_database_with_different_retentions_are_warned_about():
    """A job records no backend, so leases_prune for one backend deletes every finished job
    of its database past that backend's RETENTION_DAYS (invariant 3: no job goes before its
    time unannounced): the backend with the longer retention is warned, naming the other;
    one on a database of its own, or with the same retention, is not."""
    tasks = {
        "long": {"BACKEND": BACKEND, "OPTIONS": {"RETENTION_DAYS": 30}},
        "short": {"BACKEND": BACKEND, "QUEUES": ["s"], "OPTIONS": {"RETENTION_DAYS": 7}},
        "same": {"BACKEND": BACKEND, "QUEUES": ["m"], "OPTIONS": {"RETENTION_DAYS": 7}},
        "apart": {"BACKEND": BACKEND, "OPTIONS": {"DATABASE": "queue", "RETENTION_DAYS": 90}},
    }
    with override_settings(TASKS=tasks):
        messages = {alias: check_backend(alias, tasks[alias]["OPTIONS"]) for alias in tasks}
    [warning] = messages["long"]
    assert isinstance(warning, Warning) and warning.id == "django_leases.W002"
    assert "TASKS['short'] (7 days)" in warning.msg and "'same'" in warning.msg
    assert "30 days" in warning.msg and "'default'" in warning.msg
    assert messages["short"] == messages["same"] == messages["apart"] == []


def test_backends_of_one_database_taking_the_same_queues_are_warned_about():
    """A job records its queue, not its backend: two backends of one database that take a
    queue in common run each other's jobs of it (before: no check said so). Each is told,
    naming the other and the queues (an empty QUEUES takes every queue); backends with
    queues of their own, or on another database, are not."""
    tasks = {
        "web": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]},
        "slow": {"BACKEND": BACKEND, "OPTIONS": {"LEASE_SECONDS": 600}},  # ["default"]
        "reports": {"BACKEND": BACKEND, "QUEUES": ["reports"]},
        "apart": {"BACKEND": BACKEND, "OPTIONS": {"DATABASE": "queue"}},
    }
    with override_settings(TASKS=tasks):
        messages = {alias: check_backend(alias, tasks[alias].get("OPTIONS", {})) for alias in tasks}
    [web], [slow] = messages["web"], messages["slow"]
    assert isinstance(web, Warning) and web.id == slow.id == "django_leases.W005"
    assert "TASKS['slow'] ('default') takes too" in web.msg and "'emails'" not in web.msg
    assert "TASKS['web'] ('default')" in slow.msg and "database 'default'" in slow.msg
    assert messages["reports"] == messages["apart"] == []
    tasks["any"] = {"BACKEND": BACKEND, "QUEUES": []}
    with override_settings(TASKS=tasks):
        [anything] = check_backend("any", {})
        [reports] = check_backend("reports", {})
    assert "TASKS['web'] ('default', 'emails'), TASKS['slow'] ('default')" in anything.msg
    assert "TASKS['reports'] ('reports')" in anything.msg and " take too" in anything.msg
    assert "TASKS['any'] ('reports') takes too" in reports.msg
    # A QUEUES that is no list (E022 for its own backend) is not read as its letters here.
    tasks["typo"] = {"BACKEND": BACKEND, "QUEUES": "reports"}
    with override_settings(TASKS=tasks):
        [anything] = check_backend("any", {})
    assert "TASKS['reports'] ('reports')" in anything.msg and "'typo'" not in anything.msg


def test_a_schedule_name_two_backends_of_one_database_declare_is_an_error(monkeypatch):
    """(4) A schedule is one row per name in its database, owned by one backend: two
    backends of one database that declare the same name would take the row from each
    other at every worker start (before: no check said so). Each is told, naming the
    other and the name; a backend on another database, or a name of its own, is not."""
    from django_leases import registry
    from tests.testapp.tasks import add

    # Discovered under the project's TASKS, as a process does at its start (under this
    # test's, which has no "default" backend, the task modules could not be imported: the
    # test passed only after another had discovered them).
    registry.discover()
    # The process's declarations restored after this test's backends.
    monkeypatch.setattr(registry, "_declared", {a: dict(t) for a, t in registry._declared.items()})
    monkeypatch.setattr(registry, "_inherited", set(registry._inherited))

    def every(seconds):
        return {"task": "tests.testapp.tasks.add", "every": seconds, "args": [1, 2]}

    tasks = {
        "twin-a": {"BACKEND": BACKEND, "OPTIONS": {"SCHEDULES": {"sweep": every(60)}}},
        "twin-b": {
            "BACKEND": BACKEND,
            "OPTIONS": {"SCHEDULES": {"sweep": every(120), "tidy": every(60)}},
        },
        "twin-c": {"BACKEND": BACKEND, "OPTIONS": {"SCHEDULES": {"mine": every(60)}}},
        "twin-apart": {
            "BACKEND": BACKEND,
            "OPTIONS": {"DATABASE": "queue", "SCHEDULES": {"sweep": every(60)}},
        },
    }
    with override_settings(TASKS=tasks):
        for alias in tasks:
            add.using(backend=alias)  # declared for each: SCHEDULES may name it
        messages = {alias: schedule_messages(alias, tasks[alias]["OPTIONS"]) for alias in tasks}
    [error] = messages["twin-a"]
    assert isinstance(error, Error) and error.id == "django_leases.E021"
    assert "TASKS['twin-b'] ('sweep')" in error.msg and "'default'" in error.msg
    [error] = messages["twin-b"]
    assert error.id == "django_leases.E021" and "TASKS['twin-a'] ('sweep')" in error.msg
    assert "tidy" not in error.msg
    assert messages["twin-c"] == messages["twin-apart"] == []
    tasks["twin-c"]["OPTIONS"]["SCHEDULES"]["sweep"] = every(30)
    with override_settings(TASKS=tasks):
        [error] = schedule_messages("twin-a", tasks["twin-a"]["OPTIONS"])
    assert "TASKS['twin-b'] ('sweep'), TASKS['twin-c'] ('sweep') declare too" in error.msg
    # Names compare as spelled on every database (MySQL's too, migration 0009): "Sweep"
    # is a row of its own.
    tasks["twin-c"]["OPTIONS"]["SCHEDULES"] = {"Sweep": every(30)}
    with override_settings(TASKS=tasks):
        assert schedule_messages("twin-c", tasks["twin-c"]["OPTIONS"]) == []


def schedule_messages(alias, options):
    """check_backend()'s messages but W005 (these backends share the queue 'default')."""
    return [m for m in check_backend(alias, options) if m.id != "django_leases.W005"]


@pytest.mark.django_db
def test_use_tz_false_is_warned_of_and_a_time_given_is_refused_naming_it():
    """(6) With USE_TZ = False no time a caller gives can be taken (Django stores no aware
    datetime then, and a naive one names no instant on the database clock): the backend
    is warned of (W003), and an enqueue with run_after raises InvalidTask naming it and
    USE_TZ, never the database adapter's ValueError (an aware time) or "must be an aware
    datetime" for Django's own timezone.now() (before). A job without one still goes."""
    from datetime import UTC, datetime, timedelta

    from django.tasks.exceptions import InvalidTask
    from django.utils import timezone

    from tests.testapp.tasks import add

    options = {"RETENTION_DAYS": 7}
    before = check_backend("default", options)
    assert "django_leases.W003" not in {m.id for m in before}
    with override_settings(USE_TZ=False):
        # (E020 too, where a test imported tasks declaring schedules: they need USE_TZ.)
        [warning] = [
            m
            for m in check_backend("default", options)
            if m not in before and m.id != "django_leases.E020"
        ]
        assert isinstance(warning, Warning) and warning.id == "django_leases.W003"
        assert "run_after and deadline each needs USE_TZ = True" in warning.msg
        # What the backend says it supports is what it takes (before: True, and refused).
        from django.tasks import task_backends

        assert task_backends["default"].supports_defer is False
        for when in (timezone.now(), datetime(2030, 1, 1, tzinfo=UTC)):
            with pytest.raises(InvalidTask, match="run_after: needs USE_TZ = True"):
                add.using(run_after=when + timedelta(minutes=5)).enqueue(1, 2)
        assert add.enqueue(1, 2).id
        # Beside the other warnings, not instead of them.
        tasks = {
            "long": {"BACKEND": BACKEND, "OPTIONS": {"RETENTION_DAYS": 30}},
            "short": {"BACKEND": BACKEND, "OPTIONS": {"RETENTION_DAYS": 7}},
        }
        with override_settings(TASKS=tasks):
            found = {m.id for m in check_backend("long", tasks["long"]["OPTIONS"])}
        assert {"django_leases.W002", "django_leases.W003"} <= found
    assert task_backends["default"].supports_defer is True


def run_in_project_without_the_app(*command: str) -> subprocess.CompletedProcess:
    """``command`` (python arguments) in a project whose TASKS use the lease backend but
    whose INSTALLED_APPS lack 'django_leases' (tests/testapp/no_app_settings.py)."""
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "tests.testapp.no_app_settings",
        },
    )


def test_a_backend_configured_without_the_app_installed_is_refused_at_enqueue():
    """Issue 15.2, in a real project process. Django registers the check that calls the
    backend's check() when django.tasks is first imported, and without the app nothing
    imports it before the checks run, so a plain `manage.py check` says no issues (the
    documented limitation); it reports E017 once django.tasks was imported during setup.
    enqueue() refuses with the fix in every case, before writing anything (3)."""
    plain = run_in_project_without_the_app("-m", "django", "check")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "System check identified no issues" in plain.stdout
    assert "django_leases.E017" not in plain.stdout + plain.stderr

    imported = run_in_project_without_the_app(
        "-c",
        (
            "import django; django.setup(); import django.tasks; "
            "from django.core.management import call_command; call_command('check')"
        ),
    )
    assert imported.returncode != 0
    assert "django_leases.E017" in imported.stderr
    assert "HINT: Add 'django_leases' to INSTALLED_APPS" in imported.stderr

    enqueued = run_in_project_without_the_app(
        "-m", "django", "shell", "-c", "from tests.testapp.tasks import add; add.enqueue(1, 2)"
    )
    assert enqueued.returncode != 0
    assert (
        "django.core.exceptions.ImproperlyConfigured: TASKS['default'] uses "
        "django_leases.backends.LeaseBackend: add 'django_leases' to INSTALLED_APPS, then run "
        "`python manage.py migrate`"
    ) in enqueued.stderr
    assert "RuntimeError" not in enqueued.stderr

    worker = run_in_project_without_the_app("-m", "django", "run_lease_worker")
    assert worker.returncode != 0 and "Unknown command: 'run_lease_worker'" in worker.stderr


def test_tasks_declared_where_no_worker_looks_are_listed_with_the_fix():
    """Issue 15.3: a @task in tests/testapp/jobs.py, a module neither an app's tasks module
    nor in TASK_MODULES, is an error naming the task and the setting that fixes it."""
    from django.tasks import task_backends

    from tests.testapp.jobs import shipped

    [error] = [m for m in task_backends["default"].check() if m.id == "django_leases.E018"]
    assert shipped.module_path in error.msg
    assert (
        "TASKS['default']['OPTIONS']['TASK_MODULES']" in error.hint
        and "'tests.testapp.jobs'" in error.hint
    )
    with override_settings(
        TASKS={
            "default": {
                "BACKEND": BACKEND,
                "QUEUES": ["default", "emails"],
                "OPTIONS": {"TASK_MODULES": ["tests.testapp.jobs"]},
            }
        }
    ):
        # (Other tests of this process may have imported tests/shopapp/jobs_only.py.)
        assert [
            m.id
            for m in task_backends["default"].check()
            if m.id == "django_leases.E018" and shipped.module_path in m.msg
        ] == []


@pytest.mark.parametrize(
    ("module", "for_tests"),
    [
        ("shop.tests", True),
        ("shop.test_views", True),
        ("shop.tests_api", True),
        ("shop.views_test", True),
        ("shop.tests.factories", True),
        ("tests", True),
        ("conftest", True),
        ("shop.tasks", False),
        ("shop.jobs", False),
        ("tests.testapp.jobs", False),  # a project package named tests: its own modules
        ("shop.contests", False),
        ("shop.testimonials", False),
    ],
)
def test_tasks_a_test_module_declares_are_left_out_of_e018(module, for_tests):
    """`manage.py test` imports the test modules before it runs the checks, and E018 then
    stopped the whole run over a task a test declared for itself (the package test runs
    such a project's tests through the installed wheel). Which modules count as tests."""
    from django_leases import registry

    assert registry.is_test_module(module) is for_tests


def test_a_tasks_module_that_raises_at_import_is_an_error_of_the_check(tmp_path, monkeypatch):
    """A module discovery imports (here a TASK_MODULES entry; a module of an app's tasks
    package alike) that raises at import: every worker's start would fail on it, so
    `manage.py check` says so, naming the error (before: the check swallowed it and said
    nothing) (6)."""
    from django.core.checks import run_checks

    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no partner key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = {
        "default": {
            "BACKEND": BACKEND,
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"TASK_MODULES": ["raises_at_import"]},
        }
    }
    with override_settings(TASKS=tasks):
        found = [m for m in run_checks() if m.id == "django_leases.E023"]
    [error] = found
    assert error.obj == "TASKS['default']"
    assert "RuntimeError: no partner key" in error.msg


@pytest.mark.django_db(databases="__all__")
def test_a_backend_whose_task_modules_cannot_import_does_not_break_the_others_checks():
    """The E018 check imports every backend's TASK_MODULES; one that cannot be imported is
    the E016 of its own backend, not a crash of `manage.py check`."""
    from django.core.checks import run_checks

    with override_settings(
        TASKS={
            "default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]},
            "broken": {
                "BACKEND": BACKEND,
                "OPTIONS": {"TASK_MODULES": ["tests.testapp.no_such_module"]},
            },
        }
    ):
        found = [(m.id, m.obj) for m in run_checks() if m.id.startswith("django_leases.E01")]
    assert ("django_leases.E016", "TASKS['broken']") in found
