"""Benchmark django-leases against a hand-written limit and its peers, on one PostgreSQL.

    python example_project/bench/run.py                       # the full run (~25 min)
    python example_project/bench/run.py --jobs 500 --rounds 1 # a smoke run

Every system runs in turn, interleaved (A B C A B C ...), for --rounds rounds; figures are
medians with min-max over rounds. django-leases runs from the virtualenv that runs this
script; each peer is installed from PyPI into its own virtualenv under --venvs (created
here with pip on first use, never inside the repository). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from common import dsn, url  # noqa: E402

# What each peer's virtualenv gets from PyPI (psutil only so the harness can read RSS).
PEERS = {
    "tasksdb": ["django-tasks-db", "psycopg[binary]"],
    "procrastinate": ["procrastinate[django]", "psycopg[binary,pool]"],
    "ox": ["django-ox", "psycopg[binary]"],
    # Not Django: a plain asyncio queue, run with each of the two drivers it supports.
    "pgqueuer": ["pgqueuer", "psycopg[binary]", "asyncpg"],
    "pgqueuer-asyncpg": ["pgqueuer", "psycopg[binary]", "asyncpg"],
}
PEER_DIST = {
    "tasksdb": "django-tasks-db",
    "procrastinate": "procrastinate",
    "ox": "django-ox",
    "pgqueuer": "pgqueuer",
    "pgqueuer-asyncpg": "pgqueuer",
}
# Peers sharing one virtualenv (the same package with another driver).
PEER_VENV = {"pgqueuer-asyncpg": "pgqueuer"}
# Peers without Django: their own worker script and driver (same commands as driver.py).
NOT_DJANGO = {"pgqueuer", "pgqueuer-asyncpg"}
# BENCH_DB_PREFIX ("bench_") lets two harness runs share one server without sharing tables.
DB_PREFIX = os.environ.get("BENCH_DB_PREFIX", "bench_")
DATABASES = {
    name: f"{DB_PREFIX}{name.replace('-', '_')}"
    for name in ("limit", "leases", "tasksdb", "procrastinate", "ox", *NOT_DJANGO)
}
TABLE_PREFIX = {
    "limit": "limit_job",
    "leases": "django_leases_",
    "tasksdb": "django_tasks_database_",
    "procrastinate": "procrastinate_",
    "ox": "django_ox_",
    "pgqueuer": "pgqueuer",
    "pgqueuer-asyncpg": "pgqueuer",
}
# count(*), first and last finish of succeeded no-op jobs, on the database clock.
FINISHED_SQL = {
    "limit": "SELECT count(*), min(finished_at), max(finished_at) FROM limit_job "
    "WHERE state = 'succeeded'",
    "leases": "SELECT count(*), min(finished_at), max(finished_at) FROM django_leases_job "
    "WHERE state = 'succeeded'",
    "tasksdb": "SELECT count(*), min(finished_at), max(finished_at) FROM "
    "django_tasks_database_dbtaskresult WHERE status = 'SUCCESSFUL'",
    "procrastinate": "SELECT count(*), min(at), max(at) FROM procrastinate_events "
    "WHERE type = 'succeeded'",
    "ox": "SELECT count(*), min(finished_at), max(finished_at) FROM django_ox_oxtask "
    "WHERE status = 'SUCCESSFUL'",
    # Written when the worker flushes its buffered acks: the finish as the database saw it.
    "pgqueuer": "SELECT count(*), min(created), max(created) FROM pgqueuer_log "
    "WHERE status = 'successful'",
}
FINISHED_SQL["pgqueuer-asyncpg"] = FINISHED_SQL["pgqueuer"]
LABELS = {
    "limit": "limit (1 claim + 1 ack)",
    "limit10": "limit, batches of 10",
    "leases": "django-leases",
    "tasksdb": "django-tasks-db",
    "procrastinate": "Procrastinate",
    "ox": "django-ox",
    "pgqueuer": "PgQueuer (psycopg)",
    "pgqueuer-asyncpg": "PgQueuer (asyncpg)",
}


def log(*args: object) -> None:
    sys.stderr.write(" ".join(str(a) for a in args) + "\n")
    sys.stderr.flush()


@dataclass
class System:
    """One queue under test, with the environment its processes run in."""

    kind: str  # limit | leases | tasksdb | procrastinate | ox
    batch: int = 1  # limit only
    conn_max_age: str = "0"  # Django's default unless a variant says otherwise
    venvs: Path = Path("/tmp/bench-venvs")
    record: str = ""
    extra_env: dict = field(default_factory=dict)
    tag: str = ""  # a variant other than CONN_MAX_AGE, e.g. "c10"
    # A tuned django-leases variant's own worker options, e.g. ("-v", "0").
    worker_args: tuple[str, ...] = ()
    # --baseline-ref: django-leases as of a git ref, from a copy put first on PYTHONPATH.
    ref: str = ""
    root: Path | None = None

    @property
    def key(self) -> str:
        base = "limit10" if self.kind == "limit" and self.batch > 1 else self.kind
        if self.tag:
            return f"{base}@{self.tag}"
        return (
            base
            if self.conn_max_age == "0" or self.kind == "limit"
            else f"{base}@cma={self.conn_max_age}"
        )

    @property
    def tuned(self) -> bool:
        """A variant of django-leases with settings other than a user's defaults."""
        return bool(self.worker_args or self.extra_env)

    @property
    def label(self) -> str:
        base = LABELS["limit10" if self.kind == "limit" and self.batch > 1 else self.kind]
        if self.ref:
            base += f" @ {self.ref}"
        if self.extra_env.get("BENCH_CONCURRENCY"):
            base += f" (CONCURRENCY={self.extra_env['BENCH_CONCURRENCY']})"
        if self.worker_args:
            base += f" ({' '.join(self.worker_args)})"
        if self.extra_env.get("BENCH_PREPARED"):
            base += " (prepared statements)"
        if self.conn_max_age != "0" and self.kind not in ("limit", "procrastinate"):
            base += f" (CONN_MAX_AGE={self.conn_max_age})"
        return base

    @property
    def db(self) -> str:
        # A baseline gets a database of its own: its migrations may differ.
        return DATABASES[self.kind] + ("_base" if self.ref else "")

    @property
    def python(self) -> str:
        if self.kind in ("limit", "leases"):
            return sys.executable
        return str(self.venvs / PEER_VENV.get(self.kind, self.kind) / "bin" / "python")

    def env(self, **more: str) -> dict:
        env = dict(os.environ)
        env.pop("BENCH_PREPARED", None)  # only the tuned variant's own (extra_env)
        settings = (
            "sys_leases.settings"
            if self.kind == "limit"
            else ""
            if self.kind in NOT_DJANGO
            else f"sys_{self.kind}.settings"
        )
        env.update(
            PYTHONPATH=os.pathsep.join(str(p) for p in (self.root, HERE) if p),
            DJANGO_SETTINGS_MODULE=settings,
            BENCH_SYSTEM="leases" if self.kind == "limit" else self.kind,
            BENCH_DB=self.db,
            BENCH_CONN_MAX_AGE=self.conn_max_age,
            BENCH_RECORD=self.record,
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        env.update(more)
        return env

    def worker_cmd(self) -> list[str]:
        django = [self.python, "-m", "django"]
        return {
            "limit": [
                self.python,
                str(HERE / "limit.py"),
                "worker",
                "--batch",
                str(self.batch),
                "--listen",
            ],
            # As a user starts it: default verbosity, one line per event.
            "leases": [*django, "run_lease_worker", *self.worker_args],
            "tasksdb": [*django, "db_worker", "--no-startup-delay", "--no-reload", "-v", "0"],
            "procrastinate": [*django, "procrastinate", "worker"],
            "ox": [*django, "ox_worker"],
            "pgqueuer": [self.python, str(HERE / "sys_pgqueuer" / "app.py")],
            "pgqueuer-asyncpg": [self.python, str(HERE / "sys_pgqueuer" / "app.py")],
        }[self.kind]

    def driver(self, *args: str, timeout: float = 600, **env: str) -> dict:
        script = HERE / (
            "limit.py"
            if self.kind == "limit"
            else "pgq_driver.py"
            if self.kind in NOT_DJANGO
            else "driver.py"
        )
        out = subprocess.run(
            [self.python, str(script), *args],
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=HERE,
        )
        if out.returncode:
            raise RuntimeError(f"{self.key} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def version(self) -> str:
        if self.kind == "limit":
            return f"psycopg {psycopg.__version__}"
        if self.ref:
            return f"django-leases at {self.ref} ({git_rev(self.ref)})"
        if self.kind == "leases":
            from importlib.metadata import version

            return f"django-leases {version('django-leases')} (Django {version('Django')})"
        other = "asyncpg" if self.kind == "pgqueuer-asyncpg" else "Django"
        # One word per distribution, "-" for one not installed (PgQueuer's psycopg
        # environment has no Django): a missing one used to blank them all.
        code = (
            "from importlib.metadata import version, PackageNotFoundError\n"
            "def v(name):\n"
            "    try:\n"
            "        return version(name)\n"
            "    except PackageNotFoundError:\n"
            "        return '-'\n"
            f"print(v({PEER_DIST[self.kind]!r}), v({other!r}), v('psycopg'))"
        )
        out = subprocess.run(
            [self.python, "-c", code], capture_output=True, text=True
        ).stdout.split()
        if not out:
            return "?"
        if self.kind == "pgqueuer":
            return f"pgqueuer {out[0]} (psycopg {out[2]})"
        return f"{PEER_DIST[self.kind]} {out[0]} ({other} {out[1]}, psycopg {out[2]})"


# -- environment ------------------------------------------------------------------------


def git_rev(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True, text=True
    ).stdout.strip()


def baseline_copy(ref: str, into: Path) -> Path:
    """django_leases/ as of ``ref`` (git archive), under ``into``: put first on PYTHONPATH,
    it shadows the installed (editable) package in the same virtualenv."""
    root = into / f"leases-{git_rev(ref) or 'ref'}"
    root.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "django_leases"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def ensure_venv(kind: str, venvs: Path) -> None:
    target = venvs / PEER_VENV.get(kind, kind)
    if (target / ".bench-ready").exists():
        return
    log(f"creating {target} with pip install {' '.join(PEERS[kind])} ...")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
    subprocess.run(
        [str(target / "bin" / "pip"), "install", "-q", *PEERS[kind], "psutil"], check=True
    )
    (target / ".bench-ready").write_text("ok\n")


def admin_conn() -> psycopg.Connection:
    return psycopg.connect(dsn("postgres"), autocommit=True)


def ensure_database(system: System) -> None:
    with admin_conn() as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [system.db]).fetchone():
            conn.execute(f'CREATE DATABASE "{system.db}"')
    if system.kind == "limit":
        system.driver("setup")
        return
    if system.kind in NOT_DJANGO:
        with psycopg.connect(dsn(system.db)) as conn:
            if conn.execute("SELECT to_regclass('pgqueuer_log')").fetchone()[0]:
                return
    out = subprocess.run(
        [system.python, "-m", "pgqueuer", "--pg-dsn", url(system.db), "install"]
        if system.kind in NOT_DJANGO
        else [system.python, "-m", "django", "migrate", "-v", "0"],
        env=system.env(),
        capture_output=True,
        text=True,
        cwd=HERE,
    )
    if out.returncode:
        raise RuntimeError(f"migrate for {system.key} failed:\n{out.stderr[-3000:]}")


def reset(system: System) -> None:
    with psycopg.connect(dsn(system.db), autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE %s",
                [TABLE_PREFIX[system.kind].replace("_", r"\_") + "%"],
            )
        ]
        if tables:
            conn.execute("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " CASCADE")
        conn.execute("VACUUM ANALYZE")


def finished(system: System, conn: psycopg.Connection) -> tuple[int, object, object]:
    return conn.execute(FINISHED_SQL[system.kind]).fetchone()


# -- processes --------------------------------------------------------------------------


def start_workers(system: System, count: int, **env: str) -> list[subprocess.Popen]:
    procs = []
    for i in range(count):
        log_path = Path(tempfile.gettempdir()) / f"bench-{system.key}-w{i}.log"
        # The child keeps its own copy of the descriptor; the harness closes its one.
        with open(log_path, "w") as log_file:
            procs.append(
                subprocess.Popen(
                    system.worker_cmd(),
                    env=system.env(**env),
                    cwd=HERE,
                    start_new_session=True,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def stop(procs: list[subprocess.Popen], *, hard: bool = False, wait: float = 8.0) -> None:
    """Stop the worker processes this harness started (their own process groups only)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL if hard else signal.SIGTERM)
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def rss_of(procs: list[subprocess.Popen]) -> list[int]:
    import psutil

    sizes = []
    for p in procs:
        try:
            proc = psutil.Process(p.pid)
            sizes.append(sum(q.memory_info().rss for q in [proc, *proc.children(recursive=True)]))
        except psutil.Error:
            sizes.append(0)
    return sizes


def cpu_seconds(pids: list[int], *, with_children: bool) -> dict[int, float]:
    """User + system CPU seconds of each live pid (and its children's, for workers)."""
    import psutil

    seconds = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)] if with_children else [proc]
            seconds[pid] = sum(sum(q.cpu_times()[:2]) for q in procs)
        except psutil.Error:
            continue
    return seconds


class CpuMeter:
    """CPU spent from just before the jobs are committed to the end of the drain: the
    workers' processes, and the PostgreSQL backends connected to the system's database
    (the harness's own connection left out), sampled during the drain so that connections
    opened meanwhile count from their start."""

    def __init__(self, conn: psycopg.Connection, db: str, workers: list[int]) -> None:
        self.conn, self.db, self.workers = conn, db, workers
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.started = False

    def _backends(self) -> list[int]:
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [self.db],
        ).fetchall()
        return [r[0] for r in rows]

    def sample(self) -> None:
        now = cpu_seconds(self._backends(), with_children=False)
        now.update({-p: s for p, s in cpu_seconds(self.workers, with_children=True).items()})
        for pid, secs in now.items():
            # A backend first seen mid-drain counts from its start (it was opened for it).
            self.first.setdefault(pid, secs if not self.started or pid < 0 else 0.0)
            self.last[pid] = secs
        self.started = True

    def spent(self) -> tuple[float, float]:
        """(worker seconds, database seconds) since the first sample."""
        worker = sum(self.last[p] - self.first[p] for p in self.last if p < 0)
        db = sum(self.last[p] - self.first[p] for p in self.last if p >= 0)
        return worker, db


# Jobs each latency round first runs through its workers (warm_up): enough that every
# handler thread of two workers runs some.
WARM_UP_JOBS = 200


def settle(count: int) -> None:
    """Let worker processes start (imports, first connection) on this 2-core machine."""
    time.sleep(1.5 + 0.6 * count)


# -- workloads --------------------------------------------------------------------------


def drain(
    system: System,
    workers: int,
    jobs: int,
    cap: float,
    *,
    do_reset: bool = True,
    profile_to: Path | None = None,
) -> dict:
    """Start idle workers, commit ``jobs`` no-op jobs in one transaction, and time the drain
    from the first to the last finish on the database clock (worker start-up excluded).
    Stops after ``cap`` seconds of draining if the queue is not empty by then."""
    if do_reset:
        reset(system)
    procs = start_workers(system, workers)
    spy = None
    try:
        settle(workers)
        with psycopg.connect(dsn(system.db), autocommit=True) as conn:
            # From before the jobs exist (idle workers cost little): a first look at the
            # queue may already find thousands done on a loaded machine.
            meter = CpuMeter(conn, system.db, [p.pid for p in procs])
            meter.sample()
            prefill = system.driver("prefill", str(jobs))
            conn.execute("ANALYZE")
            peak = [0] * workers
            first_seen = None
            last_rss = 0.0
            began = time.monotonic()
            while True:
                count, _, _ = finished(system, conn)
                now = time.monotonic()
                if count and first_seen is None:
                    first_seen = now
                    if profile_to is not None:
                        # Sample only while jobs drain, not the idle time around it.
                        spy = subprocess.Popen(
                            [
                                str(Path(sys.executable).parent / "py-spy"),
                                "record",
                                "--pid",
                                str(procs[0].pid),
                                "--rate",
                                "250",
                                "--idle",
                                "--threads",
                                "--format",
                                "raw",
                                "-o",
                                str(profile_to),
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                if now - last_rss > 0.5:
                    meter.sample()
                    peak = [max(a, b) for a, b in zip(peak, rss_of(procs), strict=True)]
                    last_rss = now
                if count >= jobs or (first_seen and now - first_seen > cap):
                    break
                if first_seen is None and now - began > 60:
                    raise RuntimeError(f"{system.key}: no job finished within 60 s")
                if any(p.poll() is not None for p in procs) and count < jobs:
                    raise RuntimeError(
                        f"{system.key}: a worker exited early; see "
                        f"{tempfile.gettempdir()}/bench-{system.key}-w*.log"
                    )
                time.sleep(0.1)
            meter.sample()
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
                spy = None
            count, first, last = finished(system, conn)
            worker_cpu, db_cpu = meter.spent()
            done = max(count, 1)
    finally:
        if spy is not None:
            spy.kill()
            spy.wait()
        stop(procs)
    seconds = (last - first).total_seconds() if count > 1 else float("nan")
    return {
        "jobs_per_s": (count - 1) / seconds if seconds else float("nan"),
        "finished": count,
        "seconds": seconds,
        "capped": count < jobs,
        "rss_peak": peak,
        "prefill": prefill,
        # CPU milliseconds per job finished while the meter ran (worker, database).
        "cpu_ms_per_job": [1000 * worker_cpu / done, 1000 * db_cpu / done],
    }


def warm_up(system: System, jobs: int = WARM_UP_JOBS) -> None:
    """Run ``jobs`` no-op jobs through the workers just started and wait until they are done:
    each handler thread then holds its connection, as in a worker that has been running
    (a worker's first job per thread opens one, about 4 ms here)."""
    with psycopg.connect(dsn(system.db), autocommit=True) as conn:
        before = finished(system, conn)[0]
        system.driver("prefill", str(jobs))
        deadline = time.monotonic() + 60
        while finished(system, conn)[0] < before + jobs:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system.key}: the warm-up jobs did not finish in 60 s")
            time.sleep(0.1)
    time.sleep(1.0)  # idle again


def latency(system: System, samples: int, gap: float, workers: int = 2) -> dict:
    """Enqueue one job at a time to idle, warmed-up workers; enqueue-to-start = start -
    moment before enqueue() (time.time() in both processes, same machine)."""
    reset(system)
    fd, record = tempfile.mkstemp(prefix=f"bench-lat-{system.key}-")
    os.close(fd)
    procs = start_workers(system, workers, BENCH_RECORD=record)
    try:
        settle(workers)
        warm_up(system)
        system.driver("feed", "--count", str(samples), "--gap", str(gap))
        deadline = time.monotonic() + 5 + 2 * samples * gap
        lines: list[list[str]] = []
        while time.monotonic() < deadline:
            lines = [
                ln.split() for ln in Path(record).read_text().splitlines() if ln.startswith("start")
            ]
            if len(lines) >= samples:
                break
            time.sleep(0.2)
    finally:
        stop(procs)
        os.unlink(record)
    ms = sorted((float(ln[2]) - float(ln[1])) * 1000 for ln in lines)
    return {
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        "max_ms": ms[-1] if ms else None,
        "samples": len(ms),
        "sent": samples,
    }


def recovery(system: System, samples: int, timeout: float, lease: float) -> dict:
    """kill -9 a worker that holds a job; time until another (idle, already running) worker
    starts it again."""
    times = []
    for n in range(samples):
        reset(system)
        fd, record = tempfile.mkstemp(prefix=f"bench-rec-{system.key}-")
        os.close(fd)
        env = {"BENCH_RECORD": record, "BENCH_LEASE_SECONDS": str(lease)}
        tag = f"r{n}"

        def attempts(record: str = record, tag: str = tag) -> list[float]:
            return [
                float(ln.split()[2])
                for ln in Path(record).read_text().splitlines()
                if ln.startswith(f"attempt {tag} ")
            ]

        holder = start_workers(system, 1, **env)
        rescuer: list[subprocess.Popen] = []
        try:
            settle(1)
            system.driver(
                "submit-sleep", "--seconds", "600", "--tag", tag, BENCH_LEASE_SECONDS=str(lease)
            )
            deadline = time.monotonic() + 30
            while not attempts() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not attempts():
                raise RuntimeError(f"{system.key}: the holder never started the job")
            rescuer = start_workers(system, 1, **env)
            settle(1)
            killed_at = time.time()
            os.killpg(holder[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
            while len(attempts()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            seen = attempts()
            times.append(seen[1] - killed_at if len(seen) >= 2 else None)
        finally:
            stop(holder + rescuer, hard=True)
            os.unlink(record)
    recovered = sorted(t for t in times if t is not None)
    return {
        "samples": times,
        "recovered": len(recovered),
        "p50_s": pct(recovered, 50),
        "p99_s": pct(recovered, 99),
        "timeout_s": timeout,
        "lease_s": lease,
    }


def enqueue_rate(system: System, single: int, bulk: int) -> dict:
    reset(system)
    return system.driver("enqueue-rate", "--single", str(single), "--bulk", str(bulk))


def heartbeat(system: System, held: int, jobs: int, cap: float, period: float) -> dict:
    """Drain ``jobs`` with 2 workers while one holder renews ``held`` claims every
    ``period`` seconds (held=0: the baseline)."""
    reset(system)
    holder = None
    try:
        if held:
            holder = subprocess.Popen(
                [
                    system.python,
                    str(HERE / "driver.py"),
                    "hold",
                    "--count",
                    str(held),
                    "--period",
                    str(period),
                ],
                env=system.env(),
                cwd=HERE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            json.loads(holder.stdout.readline())
        result = drain(system, 2, jobs, cap, do_reset=False)
        if holder is not None:
            # Let at least one renewal of the held claims run after the drain as well.
            time.sleep(min(period, 12))
    finally:
        report = None
        if holder is not None:
            holder.send_signal(signal.SIGTERM)
            report = json.loads(holder.communicate(timeout=60)[0].strip().splitlines()[-1])
    result["held"] = held
    if report:
        renewals = report["renewals"]
        result["renewals"] = len(renewals)
        result["statements_per_renewal"] = max((r["statements"] for r in renewals), default=None)
        result["renew_ms"] = (
            statistics.median(r["seconds"] * 1000 for r in renewals) if renewals else None
        )
        result["claim_all_s"] = report["claim_seconds"]
        result["held_after"] = min((r["held"] for r in renewals), default=None)
    return result


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def med(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return None, None, None
    return statistics.median(vals), min(vals), max(vals)


def fmt(m: tuple, unit: str = "", digits: int = 0) -> str:
    if m[0] is None:
        return "n/a"
    f = f"{{:,.{digits}f}}"
    if m[1] == m[2]:
        return f.format(m[0]) + unit
    return f"{f.format(m[0])}{unit} ({f.format(m[1])}-{f.format(m[2])})"


# -- profile ----------------------------------------------------------------------------


def summarize_profile(raw: Path, top: int = 22) -> list[tuple[str, float]]:
    """Inclusive share of the worker's main-thread samples per function (py-spy raw, idle
    included, so waiting on the database or on the waker shows as time)."""
    totals: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "MainThread" not in stack.split(";")[0]:
            continue
        n = int(count)
        samples += n
        names = set()
        for frame in stack.split(";")[1:]:
            if " (" not in frame:
                continue
            func, where = frame.split(" (", 1)
            names.add(f"{func} ({where.split(':')[0].rsplit('site-packages/', 1)[-1]})")
        for name in names:
            totals[name] = totals.get(name, 0) + n
    ranked = (
        [
            (name, 100 * n / samples)
            for name, n in sorted(totals.items(), key=lambda kv: -kv[1])
            if n < 0.99 * samples
        ]
        if samples
        else []
    )
    return ranked[:top]


# -- the run ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per drain (10,000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument(
        "--cap",
        type=float,
        default=20.0,
        help="stop a drain after this many seconds of draining (rate over the window)",
    )
    parser.add_argument(
        "--systems",
        default="limit,limit10,leases,tasksdb,procrastinate,ox,pgqueuer,pgqueuer-asyncpg",
    )
    parser.add_argument(
        "--cma-variants",
        default="leases,tasksdb,ox",
        help="systems also drained with 2 workers and CONN_MAX_AGE=None",
    )
    parser.add_argument(
        "--leases-concurrency",
        type=int,
        default=1,
        help="also drain django-leases with this CONCURRENCY (2 workers; 0: skip)",
    )
    parser.add_argument(
        "--leases-quiet",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also drain django-leases with -v 0 (2 workers): no line per job",
    )
    parser.add_argument(
        "--leases-prepared",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run django-leases with psycopg's prepared statements (OPTIONS "
        "server_side_binding and prepare_threshold): drain, enqueue and latency",
    )
    parser.add_argument("--workloads", default="drain,enqueue,latency,recovery,heartbeat")
    parser.add_argument("--enqueue-single", type=int, default=2000)
    parser.add_argument("--enqueue-bulk", type=int, default=10_000)
    parser.add_argument("--latency-samples", type=int, default=100)
    parser.add_argument("--latency-gap", type=float, default=0.05)
    parser.add_argument("--recovery-samples", type=int, default=5, help="per round, django-leases")
    parser.add_argument("--recovery-lease", type=float, default=5.0)
    parser.add_argument("--recovery-timeout", type=float, default=20.0)
    parser.add_argument("--held", default="1000,10000")
    parser.add_argument(
        "--heartbeat-period",
        type=float,
        default=10.0,
        help="renewal period of the holder (default: lease/3 = 10 s)",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy one django-leases worker")
    parser.add_argument(
        "--venvs", type=Path, default=Path(os.environ.get("BENCH_VENVS", "/tmp/bench-venvs"))
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument(
        "--baseline-ref",
        default="",
        help="also run django-leases as of this git ref (e.g. main), as system leases@<ref>, "
        "interleaved with the others so before/after ratios come from one run",
    )
    a = parser.parse_args()

    wanted = a.systems.split(",")
    workloads = a.workloads.split(",")
    worker_counts = [int(w) for w in a.workers.split(",")]
    systems: list[System] = []
    for key in wanted:
        kind = "limit" if key.startswith("limit") else key
        if kind in PEERS:
            try:
                ensure_venv(kind, a.venvs)
            except subprocess.CalledProcessError as e:
                log(f"SKIP {key}: could not install it: {e}")
                continue
        systems.append(System(kind, batch=10 if key == "limit10" else 1, venvs=a.venvs))
    if a.leases_prepared and "leases" in wanted:
        systems.append(
            System("leases", venvs=a.venvs, tag="prepared", extra_env={"BENCH_PREPARED": "1"})
        )
    if a.baseline_ref:
        copies = Path(tempfile.mkdtemp(prefix=f"{DB_PREFIX}baseline-"))
        root = baseline_copy(a.baseline_ref, copies)
        log(f"baseline {a.baseline_ref}: {root}")
        systems.append(
            System("leases", venvs=a.venvs, tag=a.baseline_ref, ref=a.baseline_ref, root=root)
        )
    variants = [
        System(s.kind, conn_max_age="none", venvs=a.venvs)
        for s in systems
        if s.kind in a.cma_variants.split(",") and s.batch == 1 and not s.ref and not s.tuned
    ]
    if a.leases_concurrency and "leases" in wanted:
        variants.append(
            System(
                "leases",
                venvs=a.venvs,
                tag=f"c{a.leases_concurrency}",
                extra_env={"BENCH_CONCURRENCY": str(a.leases_concurrency)},
            )
        )
    if a.leases_quiet and "leases" in wanted:
        variants.append(System("leases", venvs=a.venvs, tag="v0", worker_args=("-v", "0")))
    broken: dict[str, str] = {}
    for system in systems:
        try:
            ensure_database(system)
        except Exception as e:  # noqa: BLE001 -- report and go on with the others
            broken[system.key] = str(e)
            log(f"SKIP {system.key}: {e}")
    systems = [s for s in systems if s.key not in broken]
    variants = [s for s in variants if s.kind not in broken]
    by_kind = {s.key: s for s in systems}

    results: dict = {
        "drain": {},
        "enqueue": {},
        "latency": {},
        "recovery": {},
        "heartbeat": {},
        "errors": dict(broken),
    }

    def attempt(bucket: dict, key: str, fn, *args, **kwargs) -> None:
        for tries in range(5):
            try:
                bucket.setdefault(key, []).append(fn(*args, **kwargs))
                return
            except Exception as e:  # noqa: BLE001
                if "too many clients" in str(e) and tries < 4:
                    # The server is shared: wait for someone else's connections to go.
                    log(f"  {key}: PostgreSQL has no free connection; retrying in 30 s")
                    results.setdefault("retries", []).append(key)
                    time.sleep(30)
                    continue
                log(f"  {key}: ERROR {e}")
                results["errors"][key] = str(e)[-2000:]
                return

    started = time.time()
    code_before = library_fingerprint()
    for rnd in range(a.rounds):
        log(f"== round {rnd + 1}/{a.rounds} ({time.time() - started:.0f}s)")
        if "drain" in workloads:
            for w in worker_counts:
                for s in systems + (variants if w == 2 else []):
                    log(f"  drain {s.key} x{w}")
                    attempt(results["drain"], f"{s.key}|{w}", drain, s, w, a.jobs, a.cap)
        if "enqueue" in workloads:
            for s in systems:
                if s.key == "limit10":
                    continue
                log(f"  enqueue {s.key}")
                attempt(
                    results["enqueue"], s.key, enqueue_rate, s, a.enqueue_single, a.enqueue_bulk
                )
        if "latency" in workloads:
            for s in systems:
                if s.key == "limit10":
                    continue
                log(f"  latency {s.key}")
                attempt(results["latency"], s.key, latency, s, a.latency_samples, a.latency_gap)
        if "recovery" in workloads:
            for s in systems:
                if s.kind == "limit" or s.tuned:
                    continue  # recovery is the lease's: a tuned variant changes nothing of it
                n = a.recovery_samples if s.kind == "leases" else 1
                log(f"  recovery {s.key} x{n}")
                attempt(
                    results["recovery"], s.key, recovery, s, n, a.recovery_timeout, a.recovery_lease
                )
        partial = Path(tempfile.gettempdir()) / f"{DB_PREFIX}results.partial.json"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(results, indent=1, default=str))
        if "heartbeat" in workloads and "leases" in by_kind:
            for held in [0, *[int(h) for h in a.held.split(",")]]:
                log(f"  heartbeat held={held}")
                attempt(
                    results["heartbeat"],
                    str(held),
                    heartbeat,
                    by_kind["leases"],
                    held,
                    a.jobs,
                    a.cap,
                    a.heartbeat_period,
                )

    if a.profile and "leases" in by_kind:
        raw = Path(tempfile.gettempdir()) / "bench-leases-pyspy.txt"
        log("  profile: py-spy on one of 2 django-leases workers")
        try:
            drain(by_kind["leases"], 2, a.jobs, a.cap, profile_to=raw)
            results["profile"] = summarize_profile(raw)
        except Exception as e:  # noqa: BLE001
            results["errors"]["profile"] = str(e)
        try:
            results["enqueue_profile"] = by_kind["leases"].driver(
                "enqueue-profile", "--count", "1000"
            )
        except Exception as e:  # noqa: BLE001
            results["errors"]["enqueue_profile"] = str(e)

    results["meta"] = meta(a, systems + variants, time.time() - started)
    results["meta"]["library"] = code_before
    if library_fingerprint() != code_before:
        results["errors"]["library"] = (
            "django_leases/ changed while the benchmark ran: "
            "its figures mix two versions; run it again"
        )
    report(results, a, systems, variants, worker_counts)


def library_fingerprint() -> str:
    """The git commit plus a hash of django_leases/ (uncommitted edits included)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO / "django_leases").rglob("*.py")):
        digest.update(path.read_bytes())
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return f"{head or '?'}+{digest.hexdigest()[:12]}"


def meta(a: argparse.Namespace, systems: list[System], seconds: float) -> dict:
    cpu = "?"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as cpuinfo:
        cpu = next(ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name"))
    pg = "?"
    for _ in range(10):
        try:
            with admin_conn() as conn:
                pg = conn.execute("SHOW server_version").fetchone()[0]
            break
        except psycopg.OperationalError:
            time.sleep(10)
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "postgres": pg,
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "seconds": round(seconds),
        "versions": {s.key: s.version() for s in systems},
        # Paths relative to the repository, so the results name no machine's folders.
        "args": {
            k: os.path.relpath(v, REPO) if isinstance(v, Path) else str(v)
            for k, v in vars(a).items()
        },
    }


def report(
    results: dict,
    a: argparse.Namespace,
    systems: list[System],
    variants: list[System],
    worker_counts: list[int],
) -> None:
    lines: list[str] = []
    out = lines.append
    drains = results["drain"]

    def rate(key: str) -> tuple:
        return med([r["jobs_per_s"] for r in drains.get(key, [])])

    labels = {s.key: s.label for s in systems + variants}
    if drains:
        out("## Drain (jobs/s; ratio to the one-claim-one-ack limit at the same worker count)")
        out("")
        out(
            "| system | "
            + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in worker_counts)
            + " | peak RSS/worker (2 workers) |"
        )
        out("|---|" + "---|" * (len(worker_counts) + 1))
        for s in systems + variants:
            cells = []
            for w in worker_counts:
                m = rate(f"{s.key}|{w}")
                lim = rate(f"limit|{w}")
                if m[0] is None:
                    cells.append("—")
                    continue
                ratio = f" = {m[0] / lim[0]:.2f}x" if lim[0] else ""
                capped = any(r["capped"] for r in drains[f"{s.key}|{w}"])
                cells.append(fmt(m) + ratio + (" †" if capped else ""))
            rss = med([max(r["rss_peak"]) / 2**20 for r in drains.get(f"{s.key}|2", [])])
            out(f"| {labels[s.key]} | " + " | ".join(cells) + f" | {fmt(rss, ' MiB')} |")
        out("")
        out(
            f"† capped: the drain was stopped after {a.cap:g} s of draining; the rate is over that window."
        )
        out("")
        out("## CPU per job while draining (ms: worker + database = total; ratio to the limit's)")
        out("")
        out(
            "| system | "
            + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in worker_counts)
            + " |"
        )
        out("|---|" + "---|" * len(worker_counts))

        def cpu(key: str) -> tuple:
            runs = [r["cpu_ms_per_job"] for r in drains.get(key, []) if r.get("cpu_ms_per_job")]
            return med([w for w, _ in runs]), med([d for _, d in runs]), med([sum(x) for x in runs])

        for s in systems + variants:
            cells = []
            for w in worker_counts:
                wk, db, total = cpu(f"{s.key}|{w}")
                lim = cpu(f"limit|{w}")[2]
                if total[0] is None:
                    cells.append("—")
                    continue
                ratio = f" = {total[0] / lim[0]:.2f}x" if lim[0] else ""
                cells.append(f"{wk[0]:.2f} + {db[0]:.2f} = {total[0]:.2f}{ratio}")
            out(f"| {labels[s.key]} | " + " | ".join(cells) + " |")
        out("")
    if results["enqueue"]:
        out("## Enqueue from one process (jobs/s)")
        out("")
        out("| system | one job per transaction | bulk, one transaction | bulk API |")
        out("|---|---|---|---|")
        for s in systems:
            rs = results["enqueue"].get(s.key)
            if not rs:
                continue
            out(
                f"| {'raw psycopg (INSERT loop / executemany)' if s.kind == 'limit' else labels[s.key]} "
                f"| {fmt(med([r['single_per_s'] for r in rs]))} | {fmt(med([r['bulk_per_s'] for r in rs]))} "
                f"| {rs[0]['bulk_api']} |"
            )
        out("")
    if results["latency"]:
        out(
            f"## Enqueue-to-start latency, 2 idle workers, warmed up ({a.latency_samples} jobs per round)"
        )
        out("")
        out("| system | p50 | p99 | received |")
        out("|---|---|---|---|")
        for s in systems:
            rs = results["latency"].get(s.key)
            if rs:
                out(
                    f"| {labels[s.key]} | {fmt(med([r['p50_ms'] for r in rs]), ' ms', 1)} | "
                    f"{fmt(med([r['p99_ms'] for r in rs]), ' ms', 1)} | "
                    f"{sum(r['samples'] for r in rs)}/{sum(r['sent'] for r in rs)} |"
                )
        out("")
    if results["recovery"]:
        out(f"## Recovery after kill -9 of the worker holding a job (lease {a.recovery_lease:g} s)")
        out("")
        out("| system | recovered | p50 | p99 | bound |")
        out("|---|---|---|---|---|")
        for s in systems:
            rs = results["recovery"].get(s.key)
            if not rs:
                continue
            pooled = sorted(t for r in rs for t in r["samples"] if t is not None)
            total = sum(len(r["samples"]) for r in rs)
            bound = a.recovery_lease + a.recovery_lease / 3 + 1.0
            out(
                f"| {labels[s.key]} | {len(pooled)}/{total} within {a.recovery_timeout:g} s | "
                f"{fmt((pct(pooled, 50),) * 3, ' s', 2)} | {fmt((pct(pooled, 99),) * 3, ' s', 2)} | "
                f"{bound:.2f} s (lease + lease/3 + poll 1 s) |"
            )
        out("")
    hb = results["heartbeat"]
    if hb:
        out(
            f"## Heartbeat cost: one holder renews N claims every {a.heartbeat_period:g} s while 2 "
            "workers drain"
        )
        out("")
        out(
            "| held | drain jobs/s | vs nothing held | statements per renewal | renewal statement | claim of all N |"
        )
        out("|---|---|---|---|---|---|")
        base = med([r["jobs_per_s"] for r in hb.get("0", [])])
        for held, rs in hb.items():
            m = med([r["jobs_per_s"] for r in rs])
            ratio = f"{m[0] / base[0]:.2f}x" if base[0] and m[0] else "—"
            out(
                f"| {int(held):,} | {fmt(m)} | {ratio} | "
                f"{max((r.get('statements_per_renewal') or 0) for r in rs) or '—'} | "
                f"{fmt(med([r.get('renew_ms') for r in rs]), ' ms', 1)} | "
                f"{fmt(med([r.get('claim_all_s') and r['claim_all_s'] * 1000 for r in rs]), ' ms')} |"
            )
        out("")

    targets = evaluate(results, a, systems, variants)
    results["targets"] = targets
    out("## Targets (ratios measured in this run)")
    out("")
    out("| target | measured | result |")
    out("|---|---|---|")
    for t in targets:
        out(
            f"| {t['target']} | {t['measured']} | {'PASS' if t['pass'] else 'MISS' if t['pass'] is False else 'n/a'} |"
        )
    out("")
    if results.get("profile"):
        out("## Profile: one django-leases worker, main thread, inclusive share of samples")
        out("")
        for name, share in results["profile"]:
            out(f"- {share:5.1f}%  {name}")
        out("")
    ep = results.get("enqueue_profile")
    if ep:
        out(
            f"## Profile: django-leases enqueue, one per transaction (cProfile, "
            f"{ep['per_enqueue_ms']:.2f} ms and {ep['statements_per_enqueue']:g} statements per "
            f"enqueue: {', '.join(ep['statement_kinds'])})"
        )
        out("")
        for name, share in ep["top_cumulative"]:
            out(f"- {share:5.1f}%  {name}")
        out("")
    if results["errors"]:
        out("## Errors")
        out("")
        for key, err in results["errors"].items():
            out(f"- {key}: `{err.strip().splitlines()[-1] if err.strip() else err}`")
        out("")
    text = "\n".join(lines)
    sys.stdout.write(text + "\n")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "images").mkdir(exist_ok=True)
    (a.out / "bench_results.json").write_text(json.dumps(results, indent=1, default=str))
    (a.out / "bench_results.md").write_text(text + "\n")
    try:
        from chart import chart

        chart(results, a.out / "images" / "bench_results.png", labels, worker_counts)
    except ImportError as e:
        log(f"no chart: {e} (pip install matplotlib)")


def evaluate(
    results: dict, a: argparse.Namespace, systems: list[System], variants: list[System]
) -> list[dict]:
    drains = results["drain"]

    def rate(key: str) -> float | None:
        return med([r["jobs_per_s"] for r in drains.get(key, [])])[0]

    targets = []

    def add(
        target: str, value: float | None, limit: float, measured: str, higher: bool = True
    ) -> None:
        ok = None if value is None else (value >= limit if higher else value <= limit)
        targets.append({"target": target, "value": value, "measured": measured, "pass": ok})

    lim, leases = rate("limit|2"), rate("leases|2")
    leases_cma = rate("leases@cma=none|2")
    worst = min([x for x in (leases, leases_cma) if x], default=None)
    if lim and worst:
        add(
            "drain, 2 workers >= 3x the one-claim-one-ack limit",
            worst / lim,
            3.0,
            f"{worst:,.0f} / {lim:,.0f} = {worst / lim:.2f}x (worse of CONN_MAX_AGE 0 and None)",
        )
    four = rate("leases|4")
    if leases and four:
        add(
            "drain, 4 workers no lower than 2 (on this machine's cores)",
            four / leases,
            1.0,
            f"{four:,.0f} / {leases:,.0f} = {four / leases:.2f}x",
        )
    c10 = next(
        (
            k.split("|")[0]
            for k in drains
            if k.startswith("leases@c") and "@cma" not in k and k.endswith("|2")
        ),
        None,
    )
    if lim and c10 and rate(f"{c10}|2"):
        targets.append(
            {
                "target": f"(not a target) {c10}: drain, 2 workers, vs limit",
                "value": rate(f"{c10}|2") / lim,
                "pass": None,
                "measured": f"{rate(f'{c10}|2'):,.0f} / {lim:,.0f} = {rate(f'{c10}|2') / lim:.2f}x",
            }
        )
    peers = {
        k.split("|")[0]: rate(k)
        for k in drains
        if k.endswith("|2") and k.split("|")[0].split("@")[0] in PEERS
    }
    peers = {k: v for k, v in peers.items() if v}
    # The best of each group against the worse django-leases: Django peers, then PgQueuer.
    for target, bound, group in (
        (">= 4x the best Django peer, 2 workers, whatever CONN_MAX_AGE", 4.0, False),
        ("drain, 2 workers ahead of PgQueuer with its faster driver", 1.0, True),
    ):
        rivals = {k: v for k, v in peers.items() if (k.split("@")[0] in NOT_DJANGO) == group}
        if rivals and worst:
            best = max(rivals, key=rivals.get)
            add(
                target,
                worst / rivals[best],
                bound,
                f"{worst:,.0f} / {rivals[best]:,.0f} ({best}) = {worst / rivals[best]:.2f}x",
            )
    enq = results["enqueue"]
    if enq.get("leases") and enq.get("limit"):
        l1 = med([r["single_per_s"] for r in enq["leases"]])[0]
        r1 = med([r["single_per_s"] for r in enq["limit"]])[0]
        add(
            "enqueue one per transaction >= 0.8x raw INSERT loop",
            l1 / r1,
            0.8,
            f"{l1:,.0f} / {r1:,.0f} = {l1 / r1:.2f}x",
        )
        lb = med([r["bulk_per_s"] for r in enq["leases"]])[0]
        rb = med([r["bulk_per_s"] for r in enq["limit"]])[0]
        if "public API" in enq["leases"][0]["bulk_api"]:
            add(
                "bulk enqueue API >= 0.5x raw executemany",
                lb / rb,
                0.5,
                f"{lb:,.0f} / {rb:,.0f} = {lb / rb:.2f}x ({enq['leases'][0]['bulk_api']})",
            )
        else:
            targets.append(
                {
                    "target": "bulk enqueue API >= 0.5x raw executemany",
                    "value": None,
                    "measured": f"no bulk enqueue API; Job.objects.bulk_create reaches "
                    f"{lb:,.0f} / {rb:,.0f} = {lb / rb:.2f}x",
                    "pass": False,
                }
            )
    if results["latency"].get("leases"):
        floor = results["latency"].get("limit")
        for p, bound in (("p50", 3.0), ("p99", 8.0)):
            ms = med([r[f"{p}_ms"] for r in results["latency"]["leases"]])[0]
            lim_ms = med([r[f"{p}_ms"] for r in floor])[0] if floor else None
            add(
                f"enqueue-to-start {p} <= {bound:g} ms (LISTEN/NOTIFY, idle workers)",
                ms,
                bound,
                (f"{ms:.1f} ms" if ms is not None else "no sample")
                + (f" (limit {lim_ms:.1f} ms in this run)" if lim_ms is not None else ""),
                higher=False,
            )
    for peer in ("pgqueuer", "pgqueuer-asyncpg"):
        # Not a target: how django-leases stands against the fastest peer we found.
        if enq.get("leases") and enq.get(peer):
            l1 = med([r["single_per_s"] for r in enq["leases"]])[0]
            p1 = med([r["single_per_s"] for r in enq[peer]])[0]
            lb = med([r["bulk_per_s"] for r in enq["leases"]])[0]
            pb = med([r["bulk_per_s"] for r in enq[peer]])[0]
            targets.append(
                {
                    "target": f"(not a target) enqueue vs {LABELS[peer]}",
                    "value": l1 / p1,
                    "pass": None,
                    "measured": f"one per transaction {l1 / p1:.2f}x, bulk {lb / pb:.2f}x",
                }
            )
    hb = results["heartbeat"]
    if hb.get("0") and hb.get("10000"):
        base = med([r["jobs_per_s"] for r in hb["0"]])[0]
        held = med([r["jobs_per_s"] for r in hb["10000"]])[0]
        stmts = max((r.get("statements_per_renewal") or 0) for r in hb["10000"])
        ok = stmts == 1 and held >= 0.9 * base
        targets.append(
            {
                "target": "10,000 held: 1 statement per renewal, others' drain within 10%",
                "value": held / base,
                "pass": ok,
                "measured": f"{stmts} statement(s); drain {held:,.0f} vs {base:,.0f} = {held / base:.2f}x",
            }
        )
    if results["recovery"].get("leases"):
        pooled = [t for r in results["recovery"]["leases"] for t in r["samples"]]
        got = sorted(t for t in pooled if t is not None)
        bound = a.recovery_lease + a.recovery_lease / 3 + 1.0
        p99 = pct(got, 99) if len(got) == len(pooled) else None
        add(
            "recovery p99 <= lease + heartbeat + poll",
            p99,
            bound,
            f"p99 {p99:.2f} s vs {bound:.2f} s" if p99 is not None else "not every kill recovered",
            higher=False,
        )
        if p99 is None:
            targets[-1]["pass"] = False
    return targets


if __name__ == "__main__":
    main()
