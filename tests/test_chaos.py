"""The chaos suite's short profile, as part of the normal test run (PostgreSQL only).

Runs ``python -m tests.chaos --profile short --sabotage``: real run_lease_worker processes
on a throwaway PostgreSQL 15 cluster of its own (never the shared server), under kill -9,
SIGSTOP past the lease, a TCP partition, a PostgreSQL restart, max_connections exhausted,
clocks five minutes ahead and behind, and handlers that block or ignore cancellation. In the
pass through PgBouncer (tests/run.sh) everything goes through a PgBouncer in front of that
cluster (``--pooler``), the workers' LISTEN excepted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ON_POSTGRES = os.environ.get("DATABASE_URL", "").startswith("postgres")
# The pass through PgBouncer (tests/run.sh): the chaos run goes through one of its own too.
POOLED = bool(os.environ.get("LEASES_POOLER_DIRECT_URL"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not ON_POSTGRES,
        reason="the chaos suite restarts and partitions a "
        "PostgreSQL cluster of its own; run with DATABASE_URL=postgres://...",
    ),
]


@pytest.fixture(scope="module")
def chaos_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("chaos")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.chaos",
            "--profile",
            "short",
            "--sabotage",
            "--out",
            str(out),
            *(["--pooler"] if POOLED else []),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # Through the pooler the drain is slower on a loaded machine (260 s seen alone).
        timeout=480 if POOLED else 290,
    )
    report_path = out / "report.json"
    assert report_path.exists(), (
        f"the harness crashed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    report = json.loads(report_path.read_text())
    report["exit"], report["stderr"] = done.returncode, done.stderr[-4000:]
    return report


def test_every_fault_was_injected_at_least_once(chaos_report):
    """The run is a real chaos run: each fault kind happened and skewed clocks took part."""
    f = chaos_report["figures"]
    assert set(f["faults"]) == {"kill", "sigstop", "partition", "pg_restart", "pressure"}, f[
        "faults"
    ]
    assert f["skewed_workers"] == ["+5m", "-5m"]
    assert f["job_kinds"].get("hog") and f["job_kinds"].get("deaf"), f["job_kinds"]
    assert f["takeovers"] > 0 and f["recovery_after_kill"]["n"] > 0
    assert f["pooler"] == ("pgbouncer" if POOLED else None)


def test_the_five_invariants_held(chaos_report):
    """(1) leases on the DB clock, (2)+(5) stale acks refused and results discarded,
    (3) no job lost and every job terminal, (4) overlapping executions only after expiry,
    fenced effects exactly once, and each lost handler stopped within its bound."""
    assert chaos_report["violations"] == [], chaos_report["violations"]
    f = chaos_report["figures"]
    assert f["lost"] == 0 and f["succeeded"] == f["jobs"] >= 300
    assert f["effects_exactly_once"] == f["jobs"]
    assert f["duplicate_executions"] == f["duplicates_allowed"]
    assert chaos_report["exit"] == 0, chaos_report["stderr"]


def test_the_checker_catches_a_broken_queue(chaos_report):
    """A checker that cannot fail proves nothing: a stale ack applied, a takeover before
    expiry, a lease from a worker's clock and a job left behind are each flagged."""
    caught = chaos_report["sabotage"]
    assert any("not applied exactly once" in v for v in caught["stale_ack_applied"]), caught
    assert any("before their lease expired" in v for v in caught["takeover_before_expiry"]), caught
    assert any("database clock" in v for v in caught["lease_on_worker_clock"]), caught
    assert any("terminal state" in v for v in caught["job_left_behind"]), caught
