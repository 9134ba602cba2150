"""Drive one chaos run: a throwaway cluster, workers behind proxies, a workload, faults.

Everything here is real: ``manage.py run_lease_worker`` processes, SIGKILL/SIGSTOP/SIGCONT,
TCP connections dropped by the proxy, ``pg_ctl restart``, connections held until the server
refuses more, and clocks skewed by libfaketime. The harness waits on conditions (with
deadlines), never on bare sleeps, except for the random moment a kill lands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..worker_helpers import descendants, read_records, wait_for
from .cluster import Cluster
from .proxy import Proxy

ROOT = Path(__file__).resolve().parent.parent.parent
FAKETIME_LIB = os.environ.get(
    "LEASES_CHAOS_FAKETIME_LIB", "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
)
FAULTS = ("kill", "sigstop", "partition", "pg_restart", "pressure")

log = logging.getLogger("tests.chaos")


@dataclass
class Profile:
    name: str
    jobs: int
    feed_seconds: float
    # Faults: a fixed script (seconds from the start, kind) and/or one every N seconds.
    script: list[tuple[float, str]] = field(default_factory=list)
    fault_every: float = 0.0
    lease: float = 4.0
    heartbeat: float = 1.0
    poll: float = 0.5
    max_connections: int = 40
    # After the feed, wait for the queue to empty while it makes progress: give up once no
    # job reached a terminal state for drain_stall seconds, or after drain_timeout in all.
    # (A profile that feeds faster than its workers can run leaves a backlog; the check
    # must measure the queue, not how long the harness happened to wait.)
    drain_stall: float = 60.0
    drain_timeout: float = 900.0
    seed: int = 7


PROFILES = {
    "short": Profile(
        "short",
        jobs=300,
        feed_seconds=75,
        script=[
            (6, "kill"),
            (14, "sigstop"),
            (26, "partition"),
            (40, "pg_restart"),
            (48, "pressure"),
            (60, "kill"),
            (68, "partition"),
        ],
    ),
    "medium": Profile(
        "medium",
        jobs=2000,
        feed_seconds=300,
        fault_every=8,
        script=[
            (5, "kill"),
            (13, "sigstop"),
            (21, "partition"),
            (29, "pg_restart"),
            (37, "pressure"),
        ],
    ),
    "soak": Profile(
        "soak",
        jobs=20_000,
        feed_seconds=1500,
        fault_every=6,
        script=[
            (5, "kill"),
            (11, "sigstop"),
            (17, "partition"),
            (23, "pg_restart"),
            (29, "pressure"),
        ],
        drain_timeout=3600.0,
    ),
}


@dataclass
class WorkerSpec:
    name: str
    isolation: str
    concurrency: int
    queues: list[str]
    skew: str = ""  # a libfaketime offset such as "+5m"


ROSTER = [
    WorkerSpec("w1", "thread", 4, ["default"]),
    WorkerSpec("w2", "thread", 4, ["default"], skew="+5m"),
    WorkerSpec("w3", "process", 2, ["isolated"], skew="-5m"),
    WorkerSpec("w4", "process", 2, ["isolated"]),
]


class Worker:
    """One incarnation of a roster slot: a run_lease_worker process behind the slot's proxy."""

    def __init__(self, spec: WorkerSpec, n: int, proxy: Proxy, profile: Profile, logs: Path):
        self.spec, self.n = spec, n
        self.worker_id = f"{spec.name}.{n}"
        self.log_path = logs / f"{self.worker_id}.log"
        env = dict(os.environ)
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": "tests.chaos.settings",
                "LEASES_CHAOS_PORT": str(proxy.port),
                "LEASES_CHAOS_APP": self.worker_id,
                "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if spec.skew:
            # What `faketime -f +5m` does, without its wrapper process in between (so that
            # our signals reach the worker itself). Monotonic time must stay real: faked
            # CLOCK_MONOTONIC makes every timed wait in Python hang or spin.
            env.update(
                {
                    "LD_PRELOAD": FAKETIME_LIB,
                    "FAKETIME": spec.skew,
                    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                }
            )
        queues = [a for q in spec.queues for a in ("--queue", q)]
        cmd = [
            sys.executable,
            "-m",
            "django",
            "run_lease_worker",
            "--worker-id",
            self.worker_id,
            "--isolation",
            spec.isolation,
            "--concurrency",
            str(spec.concurrency),
            *queues,
            "--lease",
            f"{profile.lease:g}",
            "--heartbeat",
            f"{profile.heartbeat:g}",
            "--poll",
            f"{profile.poll:g}",
            "--grace",
            "3",
            "--log-format",
            "json",
            "-v",
            "2",
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in reap()
        # Its own session, so that the harness can end the worker and any child it left.
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def reap(self) -> None:
        under = descendants(self.pid)  # a handler child leads its own group (child.py)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        for pid in under:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


class Harness:
    def __init__(self, profile: Profile, out: Path, *, pooler: bool = False) -> None:
        self.p = profile
        # pooler: everything (workers, feed, checks) through PgBouncer in transaction
        # pooling in front of the cluster; the workers LISTEN on a direct connection.
        self.pooler = pooler
        self.bouncer: Any = None
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(profile.seed)
        self.events: list[dict[str, Any]] = []
        self.workers: dict[str, Worker] = {}
        self.all_workers: list[Worker] = []
        self.proxies: dict[str, Proxy] = {}
        self.enqueued: list[int] = []
        self.feed_errors = 0
        self.started = 0.0
        self._feed_done = threading.Event()

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        self.cluster = Cluster(max_connections=self.p.max_connections)
        self.cluster.start()
        entry = self.cluster.port
        if self.pooler:
            from ..pooler import PgBouncer

            self.bouncer = PgBouncer(self.cluster.port, pool_size=12, query_wait_timeout=3)
            entry = self.bouncer.start()
            # The workers' LISTEN_DATABASE (tests/chaos/settings.py), not through a proxy.
            os.environ["LEASES_CHAOS_DIRECT_PORT"] = str(self.cluster.port)
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.chaos.settings"
        os.environ["LEASES_CHAOS_PORT"] = str(entry)
        os.environ["LEASES_CHAOS_APP"] = "chaos-harness"
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from .checks import install_audit

        install_audit()
        for spec in ROSTER:
            self.proxies[spec.name] = Proxy(entry)
            self._spawn(spec)
        for w in self.workers.values():
            self._wait_started(w)

    def _wait_started(self, w: Worker) -> None:
        def started() -> bool:
            if not w.alive():
                raise RuntimeError(f"{w.worker_id} exited at start:\n{w.text()[-3000:]}")
            return any(r.get("event") == "started" for r in read_records(w.text()))

        wait_for(started, 60, f"{w.worker_id} to start")

    def _spawn(self, spec: WorkerSpec) -> Worker:
        n = sum(1 for w in self.all_workers if w.spec is spec) + 1
        worker = Worker(spec, n, self.proxies[spec.name], self.p, self.logs)
        self.workers[spec.name] = worker
        self.all_workers.append(worker)
        return worker

    def now(self) -> float:
        """The database clock, from the harness's clock (same host: the offset is measured
        once at the start, since the database may be down when a fault needs a time)."""
        return time.time() + self.offset

    def _measure_offset(self) -> None:
        from django.db import connection

        with connection.cursor() as c:
            before = time.time()
            c.execute("SELECT extract(epoch FROM clock_timestamp())")
            after = time.time()
            self.offset = float(c.fetchone()[0]) - (before + after) / 2

    # -- workload ----------------------------------------------------------------------

    def _job(self, i: int) -> tuple[str, str, float, str]:
        r = self.rng.random()
        lease = self.p.lease
        if r < 0.06:
            return "isolated", "quick", round(self.rng.uniform(0.1, 0.5), 2), f"k{i}"
        if r < 0.09:
            return "isolated", "deaf", 3 * lease, f"k{i}"
        if r < 0.12:
            return "default", "hog", 2 * lease, f"k{i}"
        if r < 0.27:
            return "default", "long", round(self.rng.uniform(2, 2 * lease), 2), f"k{i}"
        return "default", "quick", round(self.rng.uniform(0.05, 0.6), 2), f"k{i}"

    def _enqueue_one(self, i: int) -> None:
        from django.db import DatabaseError, connection, transaction

        from django_leases.models import Job
        from tests.testapp.models import ChaosSlot

        queue, kind, seconds, key = self._job(i)
        for _ in range(200):
            try:
                with transaction.atomic():
                    ChaosSlot.objects.create(key=key)
                    job = Job.objects.enqueue(
                        "tests.testapp.tasks.chaos_job",
                        [key, kind, seconds],
                        queue_name=queue,
                        max_attempts=50,
                        retry=[0.2],
                    )
                self.enqueued.append(job.pk)
                return
            except DatabaseError:
                self.feed_errors += 1
                with contextlib.suppress(DatabaseError):
                    connection.close()
                time.sleep(0.2)  # back-off while the database is away
                # The commit may have landed before the connection broke.
                with contextlib.suppress(DatabaseError):
                    if ChaosSlot.objects.filter(key=key).exists():
                        self.enqueued.append(Job.objects.get(args__0=key).pk)
                        return
        raise RuntimeError(f"could not enqueue job {key}")

    def _feed(self) -> None:
        from django.db import connection

        try:
            per_tick = max(1, round(self.p.jobs / (self.p.feed_seconds / 0.25)))
            i = 0
            while i < self.p.jobs:
                tick = time.monotonic()
                for _ in range(min(per_tick, self.p.jobs - i)):
                    self._enqueue_one(i)
                    i += 1
                time.sleep(max(0.0, 0.25 - (time.monotonic() - tick)))
        finally:
            connection.close()
            self._feed_done.set()

    # -- faults ------------------------------------------------------------------------

    def _claims_of(self, worker_id: str) -> list[tuple[int, int]]:
        from django_leases.models import Job

        return self._retry(
            lambda: list(
                Job.objects.filter(state="claimed", claimed_by=worker_id).values_list("pk", "fence")
            )
        )

    def _busy_worker(self, names: list[str]) -> Worker:
        """A worker that holds claims right now (so that the fault lands mid-job)."""

        def pick():
            busy = [self.workers[n] for n in names if self._claims_of(self.workers[n].worker_id)]
            return self.rng.choice(busy) if busy else None

        try:
            return wait_for(pick, 20, "a busy worker", error=TimeoutError)
        except TimeoutError:
            return self.workers[self.rng.choice(names)]

    def fault(self, kind: str) -> None:
        getattr(self, f"_fault_{kind}")()

    def _fault_kill(self) -> None:
        w = self._busy_worker([s.name for s in ROSTER])
        time.sleep(self.rng.uniform(0, 1.0))  # a random moment of its jobs
        os.kill(w.pid, signal.SIGKILL)
        at = self.now()
        w.proc.wait(10)
        orphans = self._retry(lambda: self._claims_of(w.worker_id))
        self.events.append({"kind": "kill", "worker": w.worker_id, "at": at, "orphans": orphans})
        log.info("kill -9 %s (%d claims held)", w.worker_id, len(orphans))
        self._wait_started(self._spawn(w.spec))

    def _fault_sigstop(self) -> None:
        w = self._busy_worker([s.name for s in ROSTER if s.isolation == "thread"])
        held = self._claims_of(w.worker_id)
        os.kill(w.pid, signal.SIGSTOP)
        at = self.now()
        # Frozen until every claim it held was taken over or ran out (and at least a lease).
        floor = time.monotonic() + 1.5 * self.p.lease
        wait_for(
            lambda: time.monotonic() > floor and not self._valid_leases(held),
            60,
            "the frozen worker's leases to run out",
        )
        os.kill(w.pid, signal.SIGCONT)
        self.events.append(
            {"kind": "sigstop", "worker": w.worker_id, "at": at, "until": self.now(), "held": held}
        )
        log.info("SIGSTOP %s for %.1f s (%d claims held)", w.worker_id, self.now() - at, len(held))

    def _hold_until_given_up(
        self, w: Worker, held: list[tuple[int, int]], floor: float, what: str
    ) -> None:
        """Until each claim it held is given up (its log says so) or settled elsewhere."""
        from django_leases.models import Job

        def done() -> bool:
            if time.monotonic() < floor:
                return False
            given_up = {
                (r["job_id"], r["fence"])
                for r in read_records(w.text())
                if r.get("event") == "lost" and r.get("worker") == w.worker_id
            }
            left = [(pk, f) for pk, f in held if (pk, f) not in given_up]
            return not left or not self._retry(
                lambda: Job.objects.filter(
                    pk__in=[pk for pk, _ in left], fence__in=[f for _, f in left], state="claimed"
                ).exists()
            )

        try:
            wait_for(done, 60, what, error=TimeoutError)
        except TimeoutError as e:
            log.warning("%s", e)

    def _valid_leases(self, held: list[tuple[int, int]]) -> int:
        from django.db.models.functions import Now

        from django_leases.models import Job

        return self._retry(
            lambda: Job.objects.filter(
                pk__in=[pk for pk, _ in held],
                fence__in=[f for _, f in held],
                state="claimed",
                lease_expires_at__gte=Now(),
            ).count()
        )

    def _fault_partition(self) -> None:
        names = [s.name for s in ROSTER]
        # Alternate between a process-isolated worker (kills deaf children) and a thread one.
        n_before = sum(1 for e in self.events if e["kind"] == "partition")
        pool = [s.name for s in ROSTER if (s.isolation == "process") == (n_before % 2 == 0)]
        w = self._busy_worker(pool or names)
        held = self._claims_of(w.worker_id)
        proxy = self.proxies[w.spec.name]
        proxy.cut()
        at = self.now()
        floor = time.monotonic() + 1.5 * self.p.lease
        self._hold_until_given_up(w, held, floor, "the partitioned worker to give up its claims")
        proxy.heal()
        self.events.append(
            {
                "kind": "partition",
                "worker": w.worker_id,
                "at": at,
                "until": self.now(),
                "held": held,
            }
        )
        log.info(
            "partition %s for %.1f s (%d claims held)", w.worker_id, self.now() - at, len(held)
        )

    def _fault_pg_restart(self) -> None:
        at = self.now()
        away = self.cluster.restart(
            self.rng.choice(["fast", "immediate"]) if self.p.name != "short" else "fast"
        )
        self.events.append({"kind": "pg_restart", "at": at, "until": self.now(), "away": away})
        from django.db import connection

        connection.close()  # the server dropped it
        log.info("pg_ctl restart: %.1f s", away)

    def _fault_pressure(self) -> None:
        """Fill every free connection slot, then cut one worker's connections: it cannot
        reconnect until the filler lets go, longer than a lease."""
        import psycopg
        from django.db import connection

        self._retry(lambda: connection.cursor().execute("SELECT 1"))
        filler: list[Any] = []
        refused = ""
        while len(filler) < 500:
            try:
                filler.append(
                    psycopg.connect(
                        self.cluster.dsn(), autocommit=True, application_name="chaos-filler"
                    )
                )
            except psycopg.OperationalError as e:
                refused = str(e).strip().splitlines()[-1]
                break
        w = self._busy_worker([s.name for s in ROSTER if s.isolation == "thread"])
        held = self._claims_of(w.worker_id)
        with connection.cursor() as c:
            c.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s",
                [w.worker_id],
            )
            cut = c.fetchone()[0]
        at = self.now()
        floor = time.monotonic() + 1.5 * self.p.lease
        try:
            self._hold_until_given_up(w, held, floor, "the starved worker to give up its claims")
        finally:
            for conn in filler:
                conn.close()
        self.events.append(
            {
                "kind": "pressure",
                "worker": w.worker_id,
                "at": at,
                "until": self.now(),
                "held": held,
                "filler": len(filler),
                "backends_cut": cut,
                "refused": refused,
            }
        )
        log.info(
            "pressure: %d filler connections (then %r), %d backends of %s cut",
            len(filler),
            refused,
            cut,
            w.worker_id,
        )

    def _retry(self, call, tries: int = 100):
        from django.db import DatabaseError, connection

        for _ in range(tries):
            try:
                return call()
            except DatabaseError:
                with contextlib.suppress(DatabaseError):
                    connection.close()
                time.sleep(0.2)
        return call()

    # -- the run -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.setup()
        self._measure_offset()
        self.started = time.monotonic()
        self.db_started = self.now()
        feeder = threading.Thread(target=self._feed, name="chaos-feeder", daemon=True)
        feeder.start()
        script = sorted(self.p.script)
        kinds = list(FAULTS)
        next_periodic = (script[-1][0] if script else 0) + self.p.fault_every
        while True:
            elapsed = time.monotonic() - self.started
            if script and elapsed >= script[0][0]:
                self.fault(script.pop(0)[1])
                continue
            if (
                self.p.fault_every
                and not script
                and not self._feed_done.is_set()
                and elapsed >= next_periodic
            ):
                self.fault(self.rng.choice(kinds))
                next_periodic = time.monotonic() - self.started + self.p.fault_every
                continue
            if not script and self._feed_done.is_set():
                break
            time.sleep(0.1)
        feeder.join()
        self.fed_at = time.monotonic() - self.started
        drain = self._drain()
        self.duration = time.monotonic() - self.started
        return {
            "profile": asdict(self.p),
            "events": self.events,
            "enqueued": self.enqueued,
            "feed_errors": self.feed_errors,
            "duration": self.duration,
            "fed_at": self.fed_at,
            "drain": drain,
            "db_started": self.db_started,
            "pooler": "pgbouncer" if self.pooler else None,
            "workers": [self._describe(w) for w in self.all_workers],
        }

    def _describe(self, w: Worker) -> dict[str, Any]:
        return {
            "worker_id": w.worker_id,
            "isolation": w.spec.isolation,
            "skew": w.spec.skew,
            "log": str(w.log_path),
            "exit": w.proc.returncode,
        }

    def _drain(self) -> dict[str, Any]:
        """Wait until every job is terminal, for as long as jobs keep finishing: stop early
        only after drain_stall seconds without one more terminal job (or drain_timeout in
        all). Then SIGTERM the workers. What is left is the checker's to report."""
        from django_leases.models import Job

        start = last_progress = time.monotonic()
        best = None
        left_at_start = None
        ended = "empty"
        while True:
            left = self._retry(lambda: Job.objects.filter(state__in=["pending", "claimed"]).count())
            now = time.monotonic()
            if left_at_start is None:
                left_at_start = left
            if left == 0:
                break
            if best is None or left < best:
                best, last_progress = left, now
            if now - last_progress > self.p.drain_stall:
                ended = "stalled"
                log.error(
                    "no job reached a terminal state for %g s; %d left", self.p.drain_stall, left
                )
                break
            if now - start > self.p.drain_timeout:
                ended = "timeout"
                log.error("the drain still had %d jobs after %g s", left, self.p.drain_timeout)
                break
            time.sleep(0.5)
        drain = {
            "seconds": round(time.monotonic() - start, 1),
            "left_at_start": left_at_start,
            "left": left,
            "ended": ended,
        }
        log.info(
            "drain: %(left_at_start)s jobs left when the feed ended, %(left)s after "
            "%(seconds)s s (%(ended)s)",
            drain,
        )
        for w in self.workers.values():
            if w.alive():
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(30)
        return drain

    def teardown(self) -> None:
        for w in self.all_workers:
            w.reap()
        for proxy in self.proxies.values():
            proxy.close()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if self.bouncer is not None:
            self.bouncer.stop()
        if hasattr(self, "cluster"):
            self.cluster.stop_and_remove()


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
