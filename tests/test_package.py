"""What a user installs is what is tested: the sdist and the wheel, built and installed.

Builds both archives with ``python -m build`` from a copy of the checkout's files, checks
that they hold every file ``git ls-files django_leases`` lists and that ``twine check``
passes, installs the wheel (not editable) into a fresh virtualenv outside the checkout, and
runs the user's project in tests/userproject on it, on SQLite and on PostgreSQL: migrate,
its own tests (``manage.py test``), enqueue from its views through Django's test client, ``run_lease_worker --burst``, then
every admin page as a superuser (tests/userproject/check_project.py reports, this asserts).

Slow (a build, a virtualenv, Django and psycopg from the package index): it runs once per
``bash tests/run.sh``, in the SQLite pass, and drives PostgreSQL itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("LEASES_PG_URL", "postgres://postgres@127.0.0.1:5432/test")
# The user project's database on that server: its own, created and dropped here.
PG_NAME = (os.environ.get("LEASES_TEST_DB_NAME") or "test_leases") + "_package"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("DATABASE_URL", "sqlite://").startswith("sqlite"),
        reason="builds and installs the package once per test run, in the SQLite pass, "
        "where it runs its user project on SQLite and on PostgreSQL itself",
    ),
    pytest.mark.skipif(
        bool(os.environ.get("LEASES_DJANGO")),
        reason="runs in the main pass of tests/run.sh (its virtualenv takes the newest "
        "Django); this pass pins another Django into the checkout's virtualenv",
    ),
]


def run(*args: str | Path, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert done.returncode == 0, f"{args}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def checkout_files(*paths: str) -> set[str]:
    """The files git has or would add (tracked, or new and not ignored), as they are now."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"git ls-files failed (the package test needs a git checkout): {done.stderr}")
    return {f for f in done.stdout.splitlines() if (ROOT / f).is_file()}


def outside_checkout(path: Path) -> Path:
    assert not path.resolve().is_relative_to(ROOT), f"{path} is inside the checkout"
    return path


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel, built as a release would be: the wheel from the sdist."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` module is missing: pip install -e '.[test]'")
    source = outside_checkout(tmp_path_factory.mktemp("source"))
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    done = run(sys.executable, "-m", "build", "--outdir", out, source)
    # setuptools says what it finds ambiguous in the layout or the manifest as warnings
    # (byte-compiling is only off in this environment).
    noise = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if re.search(r"\w+Warning\b|^\s*warning: (?!.*byte-compiling is disabled)", line)
    ]
    assert noise == [], "\n".join(noise)
    return out


def only(dist: Path, pattern: str) -> Path:
    [path] = dist.glob(pattern)
    return path


def app_entries(names: list[str], prefix: str = "") -> set[str]:
    return {
        n.removeprefix(prefix)
        for n in names
        if n.startswith(f"{prefix}django_leases/") and not n.endswith("/")
    }


def test_the_wheel_holds_every_file_of_the_app(dist):
    """Templates, py.typed and modules alike: exactly the files git lists, nothing left out,
    no byte-code or stray files."""
    wheel = zipfile.ZipFile(only(dist, "django_leases-*.whl"))
    files = app_entries(wheel.namelist())
    want = checkout_files("django_leases")
    assert any(f.endswith(".html") for f in want) and "django_leases/py.typed" in want
    assert sorted(want - files) == [], "missing from the wheel"
    assert sorted(files - want) == [], "in the wheel but not in the checkout"
    licence = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert licence, wheel.namelist()


def test_the_sdist_holds_every_file_of_the_app_and_builds_the_wheel(dist):
    """The wheel above was built from this sdist, so it holds what a build needs; it also
    carries the README, the licence and the changelog, and no half of the test suite."""
    sdist = only(dist, "django_leases-*.tar.gz")
    top = sdist.name.removesuffix(".tar.gz") + "/"
    with tarfile.open(sdist) as archive:
        names = [m.name + ("/" if m.isdir() else "") for m in archive.getmembers()]
    want = checkout_files("django_leases")
    files = app_entries(names, top)
    assert sorted(want - files) == [], "missing from the sdist"
    assert sorted(files - want) == [], "in the sdist but not in the checkout"
    for name in ("README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "PKG-INFO"):
        assert top + name in names, name
    assert not [n for n in names if n.startswith(top + "tests/")]


def test_the_changelog_has_an_entry_for_this_version(dist):
    """CHANGELOG.md: "Unreleased" on top, then an entry for the version being built (unless
    it is a development version, whose changes are the Unreleased ones)."""
    version = only(dist, "django_leases-*.whl").name.split("-")[1]
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased", headings
    if re.fullmatch(r"\d+\.\d+\.\d+", version):
        assert any(h.startswith(f"{version} (") for h in headings), (version, headings)


def test_twine_check_passes(dist):
    """The metadata and the long description (the README) render on the package index."""
    done = run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert done.stdout.count("PASSED") == 2, done.stdout


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh virtualenv outside the checkout with the wheel (and psycopg) installed."""
    home = outside_checkout(tmp_path_factory.mktemp("venv")) / "venv"
    run(sys.executable, "-m", "venv", home)
    wheel = only(dist, "django_leases-*.whl")
    run(
        home / "bin" / "python",
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--quiet",
        f"{wheel}[postgres]",
        env=user_env(),
    )
    return home


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment without what points at the checkout or its settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV", "DATABASE_URL", "PYTHONHOME"}
    }
    return {**env, **extra}


@pytest.fixture
def postgres_database():
    """The user project's own PostgreSQL database, created empty and dropped afterwards."""
    import psycopg
    from psycopg import sql

    url = urlparse(PG_URL)
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        wanted = os.environ.get("LEASES_DATABASES", "sqlite postgres").split()
        message = f"PostgreSQL unreachable at {PG_URL}: {exc}"
        if "postgres" in wanted:
            pytest.fail(message)
        pytest.skip(message + " (LEASES_DATABASES leaves PostgreSQL out)")
    name = sql.Identifier(PG_NAME)
    with admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(name))
        try:
            yield {
                "USER_DATABASE": "postgres",
                "USER_PG_NAME": PG_NAME,
                "USER_PG_HOST": url.hostname or "127.0.0.1",
                "USER_PG_PORT": str(url.port or 5432),
                "USER_PG_USER": unquote(url.username or "postgres"),
                "USER_PG_PASSWORD": unquote(url.password or ""),
            }
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))


@pytest.fixture(params=["sqlite", "postgres"])
def database(request):
    if request.param == "sqlite":
        return {"USER_DATABASE": "sqlite"}
    return request.getfixturevalue("postgres_database")


def test_a_user_project_runs_on_the_installed_wheel(venv, database, tmp_path, dist):
    """migrate, the project's own tests pass, enqueue from a view, a burst worker runs the jobs (one fails once and is
    retried), and every admin page answers 200 with what it exists to show: the job list
    with its counts and advisor link under each filter, a job's error history, the
    advisor, the workers, and the confirmation page of each action that asks first."""
    project = outside_checkout(tmp_path) / "project"
    shutil.copytree(ROOT / "tests" / "userproject", project)
    done = run(venv / "bin" / "python", "check_project.py", cwd=project, env=user_env(**database))
    report = json.loads(done.stdout)

    # The project ran on the installed wheel, not on the checkout.
    assert Path(report["django_leases"]["file"]).is_relative_to(venv), report["django_leases"]
    wheel_version = only(dist, "django_leases-*.whl").name.split("-")[1]
    assert report["django_leases"]["version"] == wheel_version
    # The worker's --version names the app's (before: Django's alone).
    assert report["version"]["exit"] == 0
    assert report["version"]["output"].startswith(f"django-leases {wheel_version} (Django ")
    assert report["migrate"]["exit"] == 0, report["migrate"]["output"]
    assert report["check"]["exit"] == 0, report["check"]["output"]
    assert "no issues" in report["check"]["output"], report["check"]["output"]
    # A task a test module declares stopped `manage.py test` at the checks (E018).
    assert report["test"]["exit"] == 0, report["test"]["output"]
    assert "Ran 1 test" in report["test"]["output"], report["test"]["output"]

    assert (report["enqueue_receipt"], report["enqueue_sync"]) == (200, 200)
    assert report["worker"]["exit"] == 0, report["worker"]["output"]
    assert report["receipt"] == {"status": "SUCCESSFUL", "return_value": "receipt for order 7 sent"}
    assert report["sync"] == {
        "state": "succeeded",
        "attempts": 2,
        "failures": ["partner API unreachable for order 8"],
    }
    assert report["workers"] == ["package-test"]

    pages = report["pages"]
    assert len(pages) == 17, [p["url"] for p in pages]
    broken = [p for p in pages if p["status"] != 200 or p["missing"]]
    assert broken == [], broken
