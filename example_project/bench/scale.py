"""How far one PostgreSQL goes: many worker processes, a table of millions, pruning.

    python example_project/bench/scale.py curve --processes 1,2,4,8,16,32
    python example_project/bench/scale.py big-table --finished 5000000 --pending 100000
    python example_project/bench/scale.py storage

Runs django-leases only (the sys_leases settings of the harness), on its own scratch
databases ``<BENCH_DB_PREFIX>scale_curve`` and ``<BENCH_DB_PREFIX>scale_big``; BENCH_PGHOST,
BENCH_PGPORT, ... point it at a server as for run.py. Each mode prints its tables and writes
them, with the raw figures, to ``--out`` (scale-<mode>.md and .json). See docs/scale.md.

- curve: for each process count, start that many ``run_lease_worker`` processes, wait
  until every one has registered, commit ``--jobs`` no-op jobs in one statement and time
  the drain on the database clock. Meanwhile a probe process claims ten jobs of the same
  queue every 20 ms with ``Job.objects.claim`` (what a worker calls) and times each claim;
  the harness samples CPU (psutil: the workers, the PostgreSQL server, the whole machine),
  the wait events of active backends, the WAL syncs, and pg_stat_statements.
- big-table: the claim's plan and latency with ``--pending`` jobs alone, then with
  ``--finished`` finished jobs beside them; then the claim latency of two draining workers
  while ``leases_prune`` deletes the older half of the finished jobs, against the same
  without pruning, in one run.
- storage: drain ``--pending`` jobs on the big table with the storage parameters of
  migration 0004 reset to PostgreSQL's defaults, then set, alternately; dead tuples,
  HOT updates, heap growth and autovacuum runs of the job table over each drain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import PG, dsn  # noqa: E402

PREFIX = os.environ.get("BENCH_DB_PREFIX", "bench_")
JOB = "django_leases_job"
TASK = "sys_leases.tasks.noop"


def log(*args: object) -> None:
    sys.stderr.write(" ".join(str(a) for a in args) + "\n")
    sys.stderr.flush()


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def env_for(db: str, **more: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(HERE),
        DJANGO_SETTINGS_MODULE="sys_leases.settings",
        BENCH_SYSTEM="leases",
        BENCH_DB=db,
        PYTHONUNBUFFERED="1",
    )
    env.update(more)
    return env


def connect(db: str) -> psycopg.Connection:
    return psycopg.connect(dsn(db), autocommit=True)


def ensure_database(db: str) -> None:
    with connect("postgres") as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone():
            conn.execute(f'CREATE DATABASE "{db}"')
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"],
        env=env_for(db),
        check=True,
        cwd=HERE,
    )
    with connect(db) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")


def truncate(conn: psycopg.Connection) -> None:
    conn.execute(
        "TRUNCATE django_leases_jobeffect, django_leases_jobfailure, django_leases_job, "
        "django_leases_workerprocess RESTART IDENTITY"
    )


def insert_pending(
    conn: psycopg.Connection, count: int, queue: str = "default", *, analyze: bool = False
) -> None:
    """``count`` due no-op jobs in one statement (the NOTIFY trigger wakes the workers).

    ``analyze``: ANALYZE the table in the same transaction, so the workers woken by its
    commit plan their claims with statistics that count these jobs (as a table in
    production has them), not those of the empty table the drain started from.
    """
    with conn.transaction():
        _insert_pending(conn, count, queue)
        if analyze:
            conn.execute(f"ANALYZE {JOB}")


def _insert_pending(conn: psycopg.Connection, count: int, queue: str) -> None:
    conn.execute(
        f"""INSERT INTO {JOB} (queue_name, task_path, args, kwargs, priority, state,
            lease_seconds, fence, attempts, max_attempts, leases_lost, claimed_by,
            on_lease_lost, dead_reason)
        SELECT %s, %s, '[]', '{{}}', 0, 'pending', 30, 0, 0, 5, 0, '', 'retry', ''
        FROM generate_series(1, %s)""",
        [queue, TASK, count],
    )


def insert_finished(conn: psycopg.Connection, count: int, days: float = 60) -> None:
    """``count`` finished jobs (96 % succeeded, 3 % dead, 1 % cancelled), finished evenly over
    the last ``days`` days, each with the columns a real finished job has."""
    conn.execute(
        f"""INSERT INTO {JOB} (queue_name, task_path, args, kwargs, priority, state,
            available_at, lease_seconds, fence, attempts, max_attempts, leases_lost,
            claimed_by, heartbeat_at, result, enqueued_at, started_at, last_attempted_at,
            finished_at, on_lease_lost, dead_reason)
        SELECT CASE WHEN i %% 3 = 0 THEN 'emails' ELSE 'default' END, %(task)s,
            jsonb_build_array(i, 'order-' || i), '{{}}', 0,
            CASE WHEN i %% 100 < 96 THEN 'succeeded' WHEN i %% 100 < 99 THEN 'dead'
                 ELSE 'cancelled' END,
            t, 30, 1, 1, 5, 0, 'host-' || (i %% 8) || '-' || (1000 + i %% 32), t,
            jsonb_build_object('ok', i), t, t, t, t + interval '0.2 seconds', 'retry',
            CASE WHEN i %% 100 BETWEEN 96 AND 98 THEN 'attempts' ELSE '' END
        FROM generate_series(1, %(count)s) AS i,
             LATERAL (SELECT now() - make_interval(secs => %(span)s * (1 - i::float8 / %(count)s))
                      - interval '1 hour' AS t) AS tt""",
        {"task": TASK, "count": count, "span": days * 86400},
    )


# -- processes --------------------------------------------------------------------------


def start_workers(db: str, count: int, **env: str) -> list[subprocess.Popen]:
    procs = []
    for i in range(count):
        with open(Path(tempfile.gettempdir()) / f"scale-w{i}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "django",
                        "run_lease_worker",
                        "-v",
                        "0",
                        "--queue",
                        "default",
                        # No-op handlers open no connection; the check would reserve one
                        # per handler slot.
                        "--skip-connection-check",
                    ],
                    env=env_for(db, **env),
                    cwd=HERE,
                    start_new_session=True,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def stop(procs: list[subprocess.Popen], wait: float = 15.0) -> None:
    """Stop the processes this script started (their own process groups only)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_registered(conn: psycopg.Connection, count: int, procs: list, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        (n,) = conn.execute(
            "SELECT count(*) FROM django_leases_workerprocess WHERE stopped_at IS NULL"
        ).fetchone()
        if n >= count:
            return time.monotonic() - started
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(
                f"a worker exited at start; see {tempfile.gettempdir()}/scale-w*.log"
            )
        time.sleep(0.2)
    raise RuntimeError(f"only {n} of {count} workers registered in {timeout:.0f} s")


class Probe:
    """A process that claims ``limit`` jobs of the queue with Job.objects.claim every
    ``gap`` seconds, acknowledges them, and writes each claim's duration (ms)."""

    def __init__(self, db: str, gap: float = 0.02, limit: int = 10) -> None:
        fd, self.path = tempfile.mkstemp(prefix="scale-probe-")
        os.close(fd)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__)),
                "probe",
                "--gap",
                str(gap),
                "--limit",
                str(limit),
                "--record",
                self.path,
            ],
            env=env_for(db),
            cwd=HERE,
            start_new_session=True,
        )

    def mark(self) -> int:
        return len(self.samples())

    def samples(self) -> list[tuple[float, float, int]]:
        rows = []
        for line in Path(self.path).read_text().splitlines():
            at, ms, got = line.split()
            rows.append((float(at), float(ms), int(got)))
        return rows

    def close(self) -> None:
        stop([self.proc])
        os.unlink(self.path)


def cmd_probe(a: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.db import connection

    from django_leases.models import Job

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    fd = os.open(a.record, os.O_WRONLY | os.O_APPEND)
    connection.ensure_connection()
    while not stopping:
        t = time.perf_counter()
        jobs = Job.objects.claim("scale-probe", ["default"], limit=a.limit)
        ms = (time.perf_counter() - t) * 1000
        if jobs:
            Job.objects.ack_many([(j, None) for j in jobs])
        os.write(fd, f"{time.time():.3f} {ms:.3f} {len(jobs)}\n".encode())
        time.sleep(a.gap)


# -- what the machine and the server did -------------------------------------------------


class Sampler(threading.Thread):
    """Samples, every ``period`` s until stopped: wait events of the database's active
    backends (pg_stat_activity), and CPU time of the workers, of the server's processes
    and of the whole machine (psutil)."""

    def __init__(self, db: str, workers: list[subprocess.Popen], period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.db, self.workers, self.period = db, workers, period
        self.waits: Counter[str] = Counter()
        self.by_statement: Counter[str] = Counter()
        self.samples = 0
        self.max_connections = 0
        self.done = threading.Event()

    def run(self) -> None:
        with connect(self.db) as conn:
            while not self.done.is_set():
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event, query FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend'"
                ).fetchall()
                self.samples += 1
                self.max_connections = max(self.max_connections, len(rows))
                for state, kind, event, query in rows:
                    if state == "active":
                        wait = "CPU (no wait event)" if kind is None else f"{kind}:{event}"
                        self.waits[wait] += 1
                        self.by_statement[f"{statement_of(query)} {wait}"] += 1
                time.sleep(self.period)


def statement_of(query: str) -> str:
    """Which of the worker's statements ``query`` is, by what only it says."""
    for name, pattern in STATEMENTS.items():
        if re.search(pattern, query, re.S):
            return name
    return "other"


def server_pids() -> list[int]:
    """The PostgreSQL server's processes: the postmaster listening on BENCH_PGPORT and its
    children (psutil), or [] if it cannot be found from here."""
    import psutil

    port = int(PG["port"])
    for conn in psutil.net_connections("tcp"):
        if conn.status == "LISTEN" and conn.laddr.port == port and conn.pid:
            master = psutil.Process(conn.pid)
            return [master.pid, *(c.pid for c in master.children(recursive=True))]
    return []


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
    return total


def machine_busy() -> tuple[float, float]:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + t.nice + getattr(t, "softirq", 0) + getattr(t, "irq", 0), t.iowait


# How each owner's statement (claiming.py, owner_writes.py) starts or what it alone says (a regex), to find it
# in pg_stat_statements, whose text keeps the layout but not the constants.
STATEMENTS = {
    "claim": r"^\s*WITH due AS",
    "ack": r"result = v\.result",
    "renew": r"^\s*UPDATE.*heartbeat_at = statement_timestamp\(\)\s+FROM unnest",
}


def statement_stats(conn: psycopg.Connection) -> dict[str, dict]:
    out = {}
    for name, pattern in STATEMENTS.items():
        row = conn.execute(
            "SELECT sum(calls), sum(total_exec_time) / nullif(sum(calls), 0), max(max_exec_time) "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = current_database() AND query ~ %s",
            [pattern],
        ).fetchone()
        out[name] = {"calls": int(row[0] or 0), "mean_ms": row[1], "max_ms": row[2]}
    return out


# -- curve ------------------------------------------------------------------------------


def drain_point(db: str, processes: int, jobs: int, cap: float) -> dict:
    with connect(db) as conn:
        truncate(conn)
        conn.execute("VACUUM ANALYZE")
        procs = start_workers(db, processes, BENCH_LEASE_SECONDS="3")
        probe = None
        sampler = None
        try:
            started_in = wait_registered(conn, processes, procs, 60 + 3 * processes)
            time.sleep(1.0)
            probe = Probe(db)
            time.sleep(1.0)
            conn.execute("SELECT pg_stat_statements_reset()")
            conn.execute("SELECT pg_stat_reset_shared('wal')")
            pids = [p.pid for p in procs]
            server = server_pids()
            sampler = Sampler(db, procs)
            sampler.start()
            mark = probe.mark()
            w0, s0, (m0, io0), t0 = (
                cpu_seconds(pids),
                cpu_seconds(server),
                machine_busy(),
                time.monotonic(),
            )
            insert_pending(conn, jobs, analyze=True)
            began = time.monotonic()
            while True:
                (done,) = conn.execute(
                    f"SELECT count(*) FROM {JOB} WHERE state = 'succeeded'"
                ).fetchone()
                if done >= jobs or time.monotonic() - began > cap:
                    break
                time.sleep(0.1)
            w1, s1, (m1, io1), t1 = (
                cpu_seconds(pids),
                cpu_seconds(server),
                machine_busy(),
                time.monotonic(),
            )
            sampler.done.set()
            sampler.join()
            window = probe.samples()[mark:]
            count, first, last = conn.execute(
                f"SELECT count(*), min(finished_at), max(finished_at) FROM {JOB} "
                "WHERE state = 'succeeded' AND claimed_by <> 'scale-probe'"
            ).fetchone()
            wal = conn.execute(
                "SELECT wal_records, wal_bytes, wal_write, wal_sync, wal_sync_time FROM pg_stat_wal"
            ).fetchone()
            stats = statement_stats(conn)
            lock_waits = sum(n for k, n in sampler.waits.items() if k.startswith("Lock:"))
        finally:
            if sampler is not None:
                sampler.done.set()
            if probe is not None:
                probe.close()
            stop(procs)
    seconds = (last - first).total_seconds() if count > 1 else float("nan")
    elapsed = t1 - t0
    claims = [ms for _, ms, _ in window]
    active = sum(sampler.waits.values()) or 1
    return {
        "processes": processes,
        "jobs_per_s": (count - 1) / seconds if seconds else None,
        "finished": count,
        "capped": count < jobs,
        "start_s": started_in,
        "claim_p50_ms": pct(claims, 50),
        "claim_p99_ms": pct(claims, 99),
        "claims_probed": len(claims),
        "cpu_workers": (w1 - w0) / elapsed,
        "cpu_server": (s1 - s0) / elapsed,
        "cpu_machine": (m1 - m0) / elapsed,
        "iowait": (io1 - io0) / elapsed,
        "waits": {k: n / active for k, n in sampler.waits.most_common(8)},
        "waits_by_statement": {k: n / active for k, n in sampler.by_statement.most_common(12)},
        "lock_wait_share": lock_waits / active,
        "active_backends": sum(sampler.waits.values()) / max(sampler.samples, 1),
        "connections": sampler.max_connections,
        "wal_sync": wal[3],
        "wal_sync_ms": wal[4],
        "wal_syncs_per_s": wal[3] / elapsed,
        "statements": stats,
    }


def cmd_curve(a: argparse.Namespace) -> dict:
    db = f"{PREFIX}scale_curve"
    ensure_database(db)
    counts = [int(n) for n in a.processes.split(",")]
    points: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(a.rounds):
        order = counts if r % 2 == 0 else list(reversed(counts))
        for n in order:
            point = drain_point(db, n, a.jobs, a.cap)
            points[n].append(point)
            log(f"round {r + 1} processes {n}: {json.dumps(point, default=str)}")
            # Kept after every point: a run cut short still has what it measured.
            partial = Path(a.out) / "scale-curve.partial.json"
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(points, default=str))
    return {"mode": "curve", "points": {str(n): p for n, p in points.items()}}


def curve_table(result: dict) -> str:
    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows if r[key] is not None)

    def span(rows: list[dict], key: str, fmt: str) -> str:
        values = [r[key] for r in rows if r[key] is not None]
        if len(values) < 2:
            return format(med(rows, key), fmt)
        return (
            f"{format(med(rows, key), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"
        )

    lines = [
        "| worker processes | jobs/s | claim p50 ms | claim p99 ms | CPU workers | CPU PostgreSQL "
        "| CPU machine | active backends | lock waits | top wait events (share of active samples) "
        "| WAL syncs/s | connections |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for n, rows in result["points"].items():
        waits = Counter[str]()
        for r in rows:
            waits.update(r["waits"])
        top = ", ".join(f"{k} {v / len(rows):.0%}" for k, v in waits.most_common(3))
        lines.append(
            f"| {n} | {span(rows, 'jobs_per_s', ',.0f')} | {med(rows, 'claim_p50_ms'):.1f} "
            f"| {span(rows, 'claim_p99_ms', '.1f')} | {med(rows, 'cpu_workers'):.2f} "
            f"| {med(rows, 'cpu_server'):.2f} | {med(rows, 'cpu_machine'):.2f} "
            f"| {med(rows, 'active_backends'):.1f} | {med(rows, 'lock_wait_share'):.1%} | {top} "
            f"| {med(rows, 'wal_syncs_per_s'):.0f} | {max(r['connections'] for r in rows)} |"
        )
    lines.append("")
    lines.append("Statements seen by pg_stat_statements over each drain (median over rounds):")
    lines.append("")
    lines.append(
        "| worker processes | claims | claim mean ms | acks | ack mean ms | renewals | renewal mean ms |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    for n, rows in result["points"].items():

        def st(name: str, key: str, rows: list[dict] = rows) -> float:
            values = [
                r["statements"][name][key] for r in rows if r["statements"][name][key] is not None
            ]
            return statistics.median(values) if values else float("nan")

        lines.append(
            f"| {n} | {st('claim', 'calls'):,.0f} | {st('claim', 'mean_ms'):.2f} "
            f"| {st('ack', 'calls'):,.0f} | {st('ack', 'mean_ms'):.2f} "
            f"| {st('renew', 'calls'):,.0f} | {st('renew', 'mean_ms'):.2f} |"
        )
    return "\n".join(lines)


# -- big table --------------------------------------------------------------------------


def claim_plan(db: str) -> dict:
    """The plan of the claim statement claim() sends (rendered by claiming.py), and its
    EXPLAIN ANALYZE in a transaction that is rolled back."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__)), "plan"],
        env=env_for(db),
        cwd=HERE,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cmd_plan(a: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.db import connection, transaction

    from django_leases.claiming import ClaimVerbs
    from django_leases.lease_statements import pg_sql
    from django_leases.models import Job

    sql = pg_sql(ClaimVerbs._PG_CLAIM, Job, connection.alias)
    statement = connection.ops.compose_sql(
        sql, {"worker": "scale-plan", "queues": ["default"], "limit": 10, "lease": None}
    )

    def nodes(plan: dict) -> list[str]:
        here = plan["Node Type"] + (f" using {plan['Index Name']}" if "Index Name" in plan else "")
        return [here] + [n for child in plan.get("Plans", []) for n in nodes(child)]

    def walk(plan: dict) -> list[dict]:
        return [plan] + [n for child in plan.get("Plans", []) for n in walk(child)]

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}")
        plan = cursor.fetchone()[0]
        plan = plan[0] if isinstance(plan, list) else json.loads(plan)[0]
        transaction.set_rollback(True)
    top = plan["Plan"]
    print(
        json.dumps(
            {
                "nodes": nodes(top),
                "execution_ms": plan["Execution Time"],
                "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
                # Pages read by the scans alone (a ModifyTable's counts include its scans').
                "scan_pages": sum(
                    n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0)
                    for n in walk(top)
                    if n["Node Type"].endswith("Scan") and "Relation Name" in n
                ),
            }
        )
    )


def quiet_claims(db: str, count: int) -> dict:
    """``count`` claims of ten (and their acks) by one probe, nothing else running."""
    probe = Probe(db, gap=0.005)
    try:
        deadline = time.monotonic() + 120
        while probe.mark() < count and time.monotonic() < deadline:
            time.sleep(0.2)
        ms = [m for _, m, _ in probe.samples()[:count]]
    finally:
        probe.close()
    return {"claims": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99)}


def table_stats(conn: psycopg.Connection) -> dict:
    row = conn.execute(
        "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count, "
        "pg_relation_size(relid), pg_total_relation_size(relid), "
        "pg_relation_size('leases_job_due_idx') FROM pg_stat_user_tables WHERE relname = %s",
        [JOB],
    ).fetchone()
    keys = [
        "live",
        "dead",
        "upd",
        "hot_upd",
        "autovacuums",
        "heap_bytes",
        "total_bytes",
        "due_idx_bytes",
    ]
    return dict(zip(keys, row, strict=True))


class Feeder(threading.Thread):
    """Keeps ``rate`` jobs/s due for the workers, in batches every 0.25 s."""

    def __init__(self, db: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.db, self.rate = db, rate
        self.done = threading.Event()

    def run(self) -> None:
        with connect(self.db) as conn:
            while not self.done.is_set():
                insert_pending(conn, max(self.rate // 4, 1))
                time.sleep(0.25)


def loaded_claims(db: str, seconds: float, *, prune_days: float | None) -> dict:
    """Two workers drain what a feeder enqueues while the probe claims beside them, for
    ``seconds``, or while leases_prune runs if ``prune_days`` is given."""
    procs = start_workers(db, 2)
    feeder = Feeder(db, 1000)
    probe = None
    result: dict = {}
    try:
        with connect(db) as conn:
            wait_registered(conn, 2, procs, 60)
            feeder.start()
            probe = Probe(db)
            time.sleep(3)
            mark = probe.mark()
            before = table_stats(conn)
            t0 = time.monotonic()
            if prune_days is None:
                time.sleep(seconds)
            else:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "django",
                        "leases_prune",
                        "--older-than-days",
                        str(prune_days),
                        "--include-dead",
                        "--batch-size",
                        "1000",
                    ],
                    env=env_for(db),
                    cwd=HERE,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result["prune_output"] = out.stdout.strip().splitlines()
            result["seconds"] = time.monotonic() - t0
            after = table_stats(conn)
            ms = [m for _, m, _ in probe.samples()[mark:]]
            result.update(
                claims=len(ms),
                p50_ms=pct(ms, 50),
                p99_ms=pct(ms, 99),
                max_ms=max(ms),
                live_before=before["live"],
                live_after=after["live"],
            )
    finally:
        feeder.done.set()
        if probe is not None:
            probe.close()
        stop(procs)
    return result


def cmd_big_table(a: argparse.Namespace) -> dict:
    db = f"{PREFIX}scale_big"
    ensure_database(db)
    result: dict = {"mode": "big-table", "finished": a.finished, "pending": a.pending}
    with connect(db) as conn:
        truncate(conn)
        insert_pending(conn, a.pending)
        conn.execute("VACUUM ANALYZE")
        result["small_plan"] = claim_plan(db)
        result["small_claims"] = quiet_claims(db, a.claims)
        log("small table:", result["small_plan"], result["small_claims"])
        t = time.monotonic()
        insert_finished(conn, a.finished)
        conn.execute("VACUUM ANALYZE")
        result["load_s"] = time.monotonic() - t
        (pending,) = conn.execute(f"SELECT count(*) FROM {JOB} WHERE state = 'pending'").fetchone()
        if pending < a.pending:
            insert_pending(conn, a.pending - pending)
            conn.execute(f"ANALYZE {JOB}")
        result["big_plan"] = claim_plan(db)
        result["big_claims"] = quiet_claims(db, a.claims)
        result["big_stats"] = table_stats(conn)
        log("big table:", result["big_plan"], result["big_claims"], result["big_stats"])
    result["not_pruning"] = loaded_claims(db, a.window, prune_days=None)
    log("not pruning:", result["not_pruning"])
    result["pruning"] = loaded_claims(db, 0, prune_days=30)
    log("pruning:", result["pruning"])
    return result


def big_table_md(r: dict) -> str:
    same = r["small_plan"]["nodes"] == r["big_plan"]["nodes"]
    lines = [
        "| table | claim plan | buffers | EXPLAIN ANALYZE ms | claim p50 ms | claim p99 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("small", f"{r['pending']:,} pending"),
        ("big", f"{r['pending']:,} pending + {r['finished']:,} finished"),
    ):
        plan, claims = r[f"{key}_plan"], r[f"{key}_claims"]
        lines.append(
            f"| {label} | {'same as above' if key == 'big' and same else ' → '.join(dict.fromkeys(plan['nodes']))} "
            f"| {plan['buffers']} | {plan['execution_ms']:.2f} | {claims['p50_ms']:.2f} | {claims['p99_ms']:.2f} |"
        )
    lines += [
        "",
        "| two workers draining, probe claiming | seconds | claims probed | claim p50 ms | claim p99 ms | max ms | jobs in table before → after |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for key, label in (("not_pruning", "not pruning"), ("pruning", "leases_prune running")):
        x = r[key]
        lines.append(
            f"| {label} | {x['seconds']:.0f} | {x['claims']:,} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} "
            f"| {x['max_ms']:.1f} | {x['live_before']:,} → {x['live_after']:,} |"
        )
    if r["pruning"].get("prune_output"):
        lines += ["", "leases_prune said: " + " ".join(r["pruning"]["prune_output"])]
    return "\n".join(lines)


def cmd_claims_ab(a: argparse.Namespace) -> dict:
    """The claim on the big table and on a table of its pending jobs alone, interleaved
    (small, big, small, big, ...) so that both see the same machine: the probe's claim
    latency, the claim statement's own execution time (pg_stat_statements, which leaves out
    the commit's WAL flush) and the plan."""
    big, small = f"{PREFIX}scale_big", f"{PREFIX}scale_curve"
    ensure_database(small)
    result: dict = {"mode": "claims-ab", "rounds": []}
    with connect(small) as conn:
        truncate(conn)
        insert_pending(conn, a.pending)
        conn.execute("VACUUM ANALYZE")
    with connect(big) as conn:
        (pending,) = conn.execute(f"SELECT count(*) FROM {JOB} WHERE state = 'pending'").fetchone()
        if pending < a.pending:
            insert_pending(conn, a.pending - pending)
        conn.execute(f"VACUUM ANALYZE {JOB}")
        result["big_counts"] = dict(
            conn.execute(f"SELECT state, count(*) FROM {JOB} GROUP BY state").fetchall()
        )
    for r in range(a.rounds):
        for name, db in (("small", small), ("big", big)):
            with connect(db) as conn:
                conn.execute("SELECT pg_stat_statements_reset()")
                claims = quiet_claims(db, a.claims)
                stats = statement_stats(conn)["claim"]
            plan = claim_plan(db)
            row = {
                "table": name,
                "round": r,
                **claims,
                "server_mean_ms": stats["mean_ms"],
                "nodes": plan["nodes"],
                "buffers": plan["scan_pages"],
            }
            result["rounds"].append(row)
            log("claims-ab:", row)
    return result


def claims_ab_md(r: dict) -> str:
    lines = [
        "| table | claim p50 ms | claim p99 ms | claim statement, server mean ms | pages its scans read |",
        "|---|---:|---:|---:|---:|",
    ]
    counts = ", ".join(f"{n:,} {s}" for s, n in sorted(r["big_counts"].items()))
    for name, label in (("small", "pending jobs alone"), ("big", counts)):
        rows = [x for x in r["rounds"] if x["table"] == name]

        def m(key: str, rows: list[dict] = rows) -> str:
            values = [x[key] for x in rows]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        lines.append(
            f"| {label} | {m('p50_ms')} | {m('p99_ms')} | {m('server_mean_ms')} "
            f"| {statistics.median(x['buffers'] for x in rows):.0f} |"
        )
    return "\n".join(lines)


# -- storage ----------------------------------------------------------------------------


def cmd_storage(a: argparse.Namespace) -> dict:
    from importlib import import_module

    storage = import_module("django_leases.migrations.0004_job_storage").JOB_STORAGE
    db = f"{PREFIX}scale_big"
    result: dict = {"mode": "storage", "pending": a.pending, "settings": storage, "runs": []}
    with connect(db) as conn:
        (finished,) = conn.execute(
            f"SELECT count(*) FROM {JOB} WHERE finished_at IS NOT NULL"
        ).fetchone()
        result["finished"] = finished
        for r in range(a.rounds * 2):
            with_storage = r % 2 == 1
            conn.execute(f"DELETE FROM {JOB} WHERE finished_at IS NULL")
            if with_storage:
                conn.execute(
                    f"ALTER TABLE {JOB} SET ("
                    + ", ".join(f"{k} = {v}" for k, v in storage.items())
                    + ")"
                )
            else:
                conn.execute(f"ALTER TABLE {JOB} RESET ({', '.join(storage)})")
            conn.execute(f"VACUUM ANALYZE {JOB}")
            insert_pending(conn, a.pending, analyze=True)
            time.sleep(1.5)  # let the counters of the insert settle
            procs = start_workers(db, a.workers, BENCH_LEASE_SECONDS="3")
            try:
                wait_registered(conn, a.workers, procs, 60)
                before = table_stats(conn)
                peak_dead = before["dead"]
                t0 = time.monotonic()
                while True:
                    (left,) = conn.execute(
                        f"SELECT count(*) FROM {JOB} WHERE finished_at IS NULL"
                    ).fetchone()
                    peak_dead = max(peak_dead, table_stats(conn)["dead"])
                    if not left or time.monotonic() - t0 > 600:
                        break
                    time.sleep(1)
                seconds = time.monotonic() - t0
                time.sleep(2)
                after = table_stats(conn)
            finally:
                stop(procs)
            upd = after["upd"] - before["upd"]
            run = {
                "storage": "0004" if with_storage else "default",
                "seconds": seconds,
                "jobs_per_s": a.pending / seconds,
                "updates": upd,
                "hot_ratio": (after["hot_upd"] - before["hot_upd"]) / upd if upd else None,
                "peak_dead": peak_dead,
                "dead_after": after["dead"],
                "autovacuums": after["autovacuums"] - before["autovacuums"],
                "heap_growth_mb": (after["heap_bytes"] - before["heap_bytes"]) / 2**20,
                "due_idx_growth_mb": (after["due_idx_bytes"] - before["due_idx_bytes"]) / 2**20,
            }
            result["runs"].append(run)
            log("storage:", run)
    return result


def storage_md(r: dict) -> str:
    lines = [
        "| storage parameters | jobs/s | updates | HOT share | peak dead tuples | dead after | "
        "autovacuum runs | heap growth MiB | due index growth MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["runs"]:
        lines.append(
            f"| {x['storage']} | {x['jobs_per_s']:,.0f} | {x['updates']:,} | {x['hot_ratio']:.1%} "
            f"| {x['peak_dead']:,} | {x['dead_after']:,} | {x['autovacuums']} "
            f"| {x['heap_growth_mb']:.1f} | {x['due_idx_growth_mb']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench-scale", help="where the tables go")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("curve")
    p.add_argument("--processes", default="1,2,4,8,16,32")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--cap", type=float, default=10.0, help="stop a drain after this many s")
    p.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("big-table")
    p.add_argument("--finished", type=int, default=5_000_000)
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=1000, help="quiet claims timed per table")
    p.add_argument("--window", type=float, default=30.0, help="s of claims without pruning")
    p = sub.add_parser("storage")
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p = sub.add_parser("claims-ab")
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p = sub.add_parser("probe")
    p.add_argument("--gap", type=float, default=0.02)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--record", required=True)
    sub.add_parser("plan")
    a = parser.parse_args()
    if a.mode == "probe":
        cmd_probe(a)
        return
    if a.mode == "plan":
        cmd_plan(a)
        return
    os.environ.update(env_for(f"{PREFIX}scale_big"))
    result = {
        "curve": cmd_curve,
        "big-table": cmd_big_table,
        "storage": cmd_storage,
        "claims-ab": cmd_claims_ab,
    }[a.mode](a)
    result["command"] = " ".join(sys.argv)
    result["server"] = f"{PG['host']}:{PG['port']}"
    md = {
        "curve": curve_table,
        "big-table": big_table_md,
        "storage": storage_md,
        "claims-ab": claims_ab_md,
    }[a.mode](result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"scale-{a.mode}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"scale-{a.mode}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
