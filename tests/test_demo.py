"""The README's demo (example_project's lease_tour) on a scratch SQLite file, as CI runs it.

Real run_lease_worker subprocesses; every wait in the tour is a poll with a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHOP = Path(__file__).resolve().parent.parent / "example_project"


def manage(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env["SHOP_SQLITE"] = str(tmp_path / "shop.sqlite3")
    return subprocess.run([sys.executable, "manage.py", *args], cwd=SHOP, env=env, timeout=timeout,
                          capture_output=True, text=True)


@pytest.fixture
def shop_db(tmp_path):
    migrated = manage(tmp_path, "migrate", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    return tmp_path


def test_tour_shows_a_takeover_after_sigkill_and_exits_zero(shop_db):
    """The killed worker's job is claimed by the survivor with a higher fence, resumes from
    its checkpoint, and the tour ends with the summary table and the admin instructions."""
    run = manage(shop_db, "lease_tour")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "[stale] worker-a wakes up: its renewal touches 0 rows and its ack is refused" in out
    assert "[kill -9]" in out and "[takeover]" in out and "fence 2" in out
    assert "Takeover after SIGKILL: yes. Nothing lost." in out
    assert "nightly_backfill     1          1     0" in out
    assert "user admin, password leases-demo" in out


def test_tour_exits_nonzero_when_no_worker_is_left_to_take_over(shop_db):
    """With every worker killed nobody can take the job over: the tour fails at its deadline."""
    run = manage(shop_db, "lease_tour", "--skip-steps", "--kill-all", "--deadline", "10")
    assert run.returncode == 1
    assert "gave up waiting for another worker to take job" in run.stderr
