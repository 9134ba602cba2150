"""The README's demo: leases by hand, then real workers, one killed with SIGKILL mid-job.

Part 1 (``--steps`` alone): one job walked through claim, renewal, expiry, takeover and a
refused stale acknowledgement, in this process. Part 2: ``run_lease_worker`` subprocesses
run jobs that the shop's views enqueue; the worker holding the nightly backfill is killed
with SIGKILL, and the tour waits (polling the database, each wait with a deadline) until a
surviving worker takes the job over after its lease and finishes it from the last committed
cursor. A third worker, serving only the reports queue, is killed too while it holds two
sales reports; nobody else serves that queue, so the tour ends with one claim whose lease
ran out (expired) and one whose hour-long lease nobody renews (stalled), beside the dead
partner sync: what the admin's lease filters are for. Exits non-zero if the takeover or any
expected outcome does not happen in time. Every time shown is read from the database clock.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count, Q
from django.db.models.functions import Now
from django.test import Client

from django_leases.admin_lists import heartbeat_seconds
from django_leases.durations import duration_text
from django_leases.models import Job, JobEffect, JobFailure, WorkerProcess
from django_leases.states import FailureKind, JobState
from shop.models import Order
from shop.tasks import sales_report, send_receipt

DEMO_USER, DEMO_PASSWORD = "admin", "leases-demo"
FINISHED = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)
# The queue of the jobs left claimed for the admin: only the reporting worker serves it.
REPORTS = "reports"
PERIODIC = "periodic"
SCHEDULE = "shop.tally"
STALLED_LEASE = 3600.0
ADMIN_JOBS = "http://127.0.0.1:8000/admin/django_leases/job/"


def lease_left(job_id: int) -> float:
    job = Job.objects.annotate(now=Now()).get(pk=job_id)
    if job.lease_expires_at is None:
        return 0.0
    return (job.lease_expires_at - job.now).total_seconds()


class TourFailed(CommandError):
    pass


class Command(BaseCommand):
    help = (
        "A scripted tour of django-leases: leases by hand, then real worker processes, "
        "one killed mid-job and its job taken over after the lease. Exits 1 if the "
        "takeover does not happen."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--steps",
            action="store_true",
            help="Only part 1: one job walked through claim, renewal, expiry, "
            "takeover and a refused stale ack, in this process.",
        )
        parser.add_argument("--skip-steps", action="store_true", help="Only part 2: the workers.")
        parser.add_argument(
            "--workers",
            type=int,
            default=2,
            help="Worker processes for the shop's queues (default 2); one more "
            "serves the reports queue.",
        )
        parser.add_argument(
            "--lease",
            type=float,
            default=3.0,
            help="Lease the workers claim with, seconds (default 3; a killed "
            "worker's job is free again at most this long after its last renewal).",
        )
        parser.add_argument(
            "--deadline",
            type=float,
            default=40.0,
            help="Give up (exit 1) if part 2 has not finished after this many seconds.",
        )
        parser.add_argument(
            "--kill-all",
            action="store_true",
            help="Kill every worker instead of one: nobody is left to take the "
            "job over, so the tour must fail (tests use it).",
        )

    # -- output ------------------------------------------------------------------------

    def say(self, step: str, text: str) -> None:
        self.clear_progress()
        self.stdout.write(f"{self.style.MIGRATE_HEADING(f'[{step}]')} {text}")

    def heading(self, text: str) -> None:
        self.clear_progress()
        self.stdout.write("")
        self.stdout.write(self.style.MIGRATE_HEADING(text))

    def progress(self, done: int, total: int, note: str, detail: str = "") -> None:
        """A progress bar: redrawn in place on a terminal; in a log, a line each time the
        count or the note changes (``detail``, a countdown, is for terminals only)."""
        width = 30
        filled = round(width * done / total) if total else width
        line = (
            f"  [{'#' * filled}{'-' * (width - filled)}] {done:>2}/{total} jobs finished"
            f"  {time.monotonic() - self.started:5.1f} s  {note}"
        )
        if self.tty:
            line += detail
            self.stdout.write("\r" + line.ljust(self._drawn), ending="")
            self.stdout.flush()
            self._drawn = len(line)
        elif (done, note) != self._last_logged:
            self.stdout.write(line)
            self._last_logged = (done, note)

    def clear_progress(self) -> None:
        if getattr(self, "_drawn", 0):
            self.stdout.write("\r" + " " * self._drawn + "\r", ending="")
            self._drawn = 0

    def wait_for(
        self,
        what: str,
        condition: Callable[[], Any],
        deadline: float,
        tick: Callable[[], None] | None = None,
        every: float = 0.1,
    ) -> Any:
        """Poll ``condition`` until it is truthy; raise TourFailed at ``deadline`` (monotonic)."""
        while True:
            value = condition()
            if value:
                return value
            if tick:
                tick()
            if time.monotonic() > deadline:
                raise TourFailed(f"gave up waiting for {what}")
            time.sleep(every)

    # -- the tour ----------------------------------------------------------------------

    def handle(self, *args: Any, **options: Any) -> None:
        self.started = time.monotonic()
        self.tty = self.stdout.isatty()
        self._drawn, self._last_logged = 0, None
        leftovers = Job.objects.filter(state__in=[JobState.PENDING, JobState.CLAIMED]).cancel()
        if leftovers:
            self.say(
                "clean",
                f"cancelled {leftovers} unfinished jobs of an earlier run "
                "(the claims it left for the admin)",
            )
        if not options["skip_steps"]:
            self.steps()
        if options["steps"]:
            return
        left = self.workers_part(options)
        self.admin_hint(left)

    # -- part 1 ------------------------------------------------------------------------

    def steps(self, lease: float = 2.0) -> None:
        self.heading("1. One job, by hand: claim, renew, expire, take over, refuse the stale ack")
        result = send_receipt.enqueue(42)
        job_id = int(result.id)
        self.say("enqueue", f"send_receipt(42) is job {job_id}, status {result.status}")

        [first] = Job.objects.claim("worker-a", ["emails"], lease=lease)
        self.say(
            "claim",
            f"worker-a claims it: token {str(first.claim_token)[:8]}..., "
            f"fence {first.fence}, lease ends in {lease_left(job_id):.2f} s "
            "(database clock)",
        )
        held = Job.objects.renew([first], lease=lease)
        self.say(
            "renew",
            f"worker-a's heartbeat renews: {len(held)} row touched, so it still "
            f"owns the job; lease ends in {lease_left(job_id):.2f} s",
        )

        self.say("crash", "worker-a stops renewing (frozen, partitioned or killed)")
        started = time.monotonic()
        self.wait_for(
            "the lease to run out",
            lambda: Job.objects.claimable().filter(pk=job_id).exists(),
            time.monotonic() + lease + 10,
            tick=lambda: (
                self.tty
                and self.stdout.write(
                    f"        ... lease ends in {max(lease_left(job_id), 0):.1f} s", ending="\r"
                )
            ),
        )
        self.say(
            "expire",
            f"the lease ran out after {time.monotonic() - started:.1f} s; "
            "the job is claimable again",
        )

        [second] = Job.objects.claim("worker-b", ["emails"], lease=lease)
        self.say(
            "reclaim",
            f"worker-b takes it over: new token {str(second.claim_token)[:8]}..., "
            f"fence {second.fence}, attempt {second.attempts}",
        )
        renewed = Job.objects.renew([first], lease=lease)
        acked = Job.objects.ack(first, "sent twice?")
        self.say(
            "stale",
            f"worker-a wakes up: its renewal touches {len(renewed)} rows and its "
            f"ack is {'applied' if acked else 'refused'}; it must stop",
        )
        if acked or renewed:
            raise TourFailed("a stale claim's write was applied")
        acked = Job.objects.ack(second, "receipt for order 42 sent")
        result.refresh()
        self.say(
            "ack",
            f"worker-b acknowledges: {'applied' if acked else 'refused'}; status "
            f"{result.status}, workers {result.worker_ids}",
        )

    # -- part 2 ------------------------------------------------------------------------

    def workers_part(self, options: dict[str, Any]) -> dict[str, int]:
        lease, count = options["lease"], max(options["workers"], 1)
        deadline = time.monotonic() + options["deadline"]
        self.heading(
            f"2. {count} worker processes (lease {lease:g} s, heartbeat "
            f"{lease / 3:.1f} s) and one for reports; one of each is killed mid-job"
        )
        logs = Path(tempfile.mkdtemp(prefix="lease-tour-"))
        fleet = Fleet(Path(settings.BASE_DIR) / "manage.py", logs, lease=lease)
        try:
            left = self._run(fleet, count, deadline, kill_all=options["kill_all"])
        except TourFailed as e:
            self.clear_progress()
            self.stderr.write(self.style.ERROR(f"The tour failed: {e}"))
            for name, tail in fleet.tails():
                self.stderr.write(f"--- last lines of {name}'s log ---\n{tail}")
            raise
        finally:
            fleet.stop_all()
        shutil.rmtree(logs, ignore_errors=True)
        return left

    def _run(self, fleet: Fleet, count: int, deadline: float, *, kill_all: bool) -> dict[str, int]:
        # The shop's workers serve every queue but the reports queue; one worker serves that
        # alone, with each job's own lease, so that once it is killed nobody takes its jobs.
        shop_queues = [
            q for q in settings.TASKS["default"]["QUEUES"] if q not in (REPORTS, PERIODIC)
        ]
        flags = {}
        for i in range(count):
            flags[f"tour-{chr(ord('a') + i)}"] = [
                "--lease",
                f"{fleet.lease:g}",
                "--heartbeat",
                f"{fleet.lease / 3:.2f}",
                *(f for q in shop_queues for f in ("--queue", q)),
            ]
        reporter = f"tour-{chr(ord('a') + count)}"
        flags[reporter] = ["--queue", REPORTS]
        for name, args in flags.items():
            fleet.start(name, args)
        self.wait_for("the workers to start", fleet.all_registered, deadline)
        for name, proc in fleet.procs.items():
            shown = (
                f"--lease {fleet.lease:g} --queue {' --queue '.join(shop_queues)}"
                if name != reporter
                else f"--queue {REPORTS}"
            )
            self.say(
                "start", f"manage.py run_lease_worker --worker-id {name} {shown}  (pid {proc.pid})"
            )

        client = Client(HTTP_HOST="localhost")

        def post(url: str, **data: Any) -> dict[str, Any]:
            response = client.post(url, data)
            if response.status_code != 201:
                raise TourFailed(f"POST {url} answered {response.status_code}")
            return response.json()

        # Orders from before tax was recorded: the backfill's work.
        orders = [
            o.pk
            for o in Order.objects.bulk_create(
                [Order(email=f"old{i}@example.com", total_cents=1000 + i) for i in range(36)]
            )
        ]
        backfill = int(post("/orders/backfill/", batch_size=4, pause=0.4)["jobs"]["backfill"])
        jobs = [backfill]
        for i in range(6):
            made = post(
                "/orders/checkout/",
                email=f"c{i}@example.com",
                total_cents=2500 + i,
                **({"partner": "1"} if i == 0 else {}),
            )
            jobs += [int(j) for j in made["jobs"].values()]
            orders.append(made["order"])
        for name in ("hero.jpg", "thumb.png", "banner.webp"):
            jobs.append(
                int(post("/orders/photos/", name=name, width=800, seconds=0.6)["jobs"]["resize"])
            )
        partner = int(Job.objects.get(pk__in=jobs, task_path__endswith="sync_to_partner").pk)
        self.say(
            "enqueue",
            f"the shop's views enqueued {len(jobs)} jobs with their orders: "
            f"a nightly backfill (job {backfill}) over every order, 6 receipts, "
            "a partner sync that keeps failing, 3 image resizes",
        )
        left = self.strand_reports(fleet, reporter, deadline)

        def finished() -> int:
            return Job.objects.filter(pk__in=jobs, state__in=FINISHED).count()

        def tick(note: str) -> Callable[[], None]:
            return lambda: self.progress(finished(), len(jobs), note)

        # Wait until the backfill has committed two batches (8 orders), then kill its worker.
        eighth = sorted(orders)[7]

        def backfill_midway() -> Job | None:
            job = Job.objects.filter(pk=backfill, state=JobState.CLAIMED).first()
            if job and (job.cursor or 0) >= eighth and job.claimed_by in fleet.procs:
                return job
            if Job.objects.filter(pk=backfill, state__in=FINISHED).exists():
                raise TourFailed("the backfill finished before a worker could be killed")
            return None

        job = self.wait_for(
            "the backfill to commit two batches",
            backfill_midway,
            deadline,
            tick=tick("backfill running"),
            every=0.05,
        )
        victim, killed_cursor = job.claimed_by, job.cursor
        targets = list(fleet.procs) if kill_all else [victim]
        for name in targets:
            fleet.kill(name)
        remaining = lease_left(backfill)
        self.say(
            "kill -9",
            f"{victim} (pid {fleet.pids[victim]}) killed while it holds job "
            f"{backfill} at cursor {job.cursor} with fence {job.fence}; nobody "
            f"renews that lease now, it ends in {max(remaining, 0):.1f} s (database clock)"
            + ("; every other worker killed too (--kill-all)" if kill_all else ""),
        )
        killed_at = time.monotonic()

        def taken_over() -> Job | None:
            job = Job.objects.filter(pk=backfill, fence__gt=job_fence).first()
            return job if job and job.claimed_by != victim else None

        job_fence = job.fence
        new = self.wait_for(
            f"another worker to take job {backfill} over",
            taken_over,
            deadline,
            tick=lambda: self.progress(
                finished(),
                len(jobs),
                f"waiting for job {backfill}'s lease",
                f": ends in {max(lease_left(backfill), 0):.1f} s",
            ),
        )
        self.say(
            "takeover",
            f"{new.claimed_by} claimed job {backfill} "
            f"{time.monotonic() - killed_at:.1f} s after the kill: fence "
            f"{new.fence}, attempt {new.attempts}, resuming after cursor {new.cursor}",
        )

        self.wait_for(
            "every job to finish",
            lambda: finished() == len(jobs),
            deadline,
            tick=tick("running the rest"),
        )
        self.progress(len(jobs), len(jobs), "done")
        if self.tty:
            self.stdout.write("")
            self._drawn = 0
        stopped = fleet.stop_all(graceful=True)
        self.say(
            "stop",
            "SIGTERM to the survivors: "
            + ", ".join(f"{name} exited {code}" for name, code in stopped.items()),
        )
        self.verify(jobs, orders, backfill, partner, victim, killed_cursor)
        left.update(dead=partner, taken_over=backfill)
        self.wait_for(
            "the reports' claims to show as expired and stalled",
            lambda: self.stranded(left),
            deadline,
        )
        self.summary(jobs, orders, backfill, victim, time.monotonic() - self.started)
        # A deadline of its own: the part before may have used most of the tour's.
        self.periodic_part(fleet, time.monotonic() + 90)
        return left

    def periodic_part(self, fleet: Fleet, deadline: float) -> None:
        """Two workers serve the periodic queue; the "shop.tally" schedule ticks every 2 s
        and each tick becomes one job, whichever of them (or of the workers before them)
        enqueued it."""
        from django_leases.models import Schedule, ScheduleRun

        self.heading(f"3. A periodic job: the {SCHEDULE!r} schedule, every 2 s, two workers")
        for name in ("tour-tick-1", "tour-tick-2"):
            fleet.start(name, ["--queue", PERIODIC])
        self.wait_for("the periodic workers to start", fleet.all_registered, deadline)

        def ticked() -> list[Any]:
            runs = ScheduleRun.objects.filter(
                schedule__name=SCHEDULE, kind="tick", job__state=JobState.SUCCEEDED
            ).select_related("job")
            done = list(runs.order_by("-tick_at")[:3])
            return done if len(done) == 3 else []

        runs = self.wait_for("three ticks of the schedule to run", ticked, deadline)
        fleet.stop_all(graceful=True)
        schedule = Schedule.objects.get(name=SCHEDULE)
        for run in reversed(runs):
            self.say(
                "tick",
                f"{run.tick_at:%H:%M:%S} UTC (database clock): job {run.job.pk}, run by "
                f"{run.job.claimed_by}, result {run.job.result}",
            )
        ticks = list(
            ScheduleRun.objects.filter(schedule=schedule, kind="tick").values_list(
                "tick_at", flat=True
            )
        )
        once = len(ticks) == len(set(ticks))
        self.say(
            "schedule",
            f"{schedule.ticks} ticks decided so far, {len(ticks)} recorded, "
            f"{'each once' if once else 'SOME TWICE'}; misfires {schedule.misfires}, "
            f"skipped while the previous job ran {schedule.skipped}",
        )
        if not once:
            raise TourFailed(f"a tick of {SCHEDULE} was enqueued twice")

    def strand_reports(self, fleet: Fleet, reporter: str, deadline: float) -> dict[str, int]:
        """Enqueue two sales reports, one with the tour's short lease and one with an hour's;
        kill the worker that claimed them once each has checkpointed. Nobody else serves the
        reports queue: the short lease runs out (expired) and the long one goes on unrenewed
        (stalled), and so they stay for the admin."""
        expiring = int(sales_report.using_lease(lease=fleet.lease).enqueue(pause=0.5).id)
        stalling = int(sales_report.using_lease(lease=STALLED_LEASE).enqueue(pause=0.5).id)
        reports = Job.objects.filter(pk__in=[expiring, stalling])

        def both_checkpointed() -> bool:
            return (
                reports.filter(
                    state=JobState.CLAIMED, claimed_by=reporter, cursor__isnull=False
                ).count()
                == 2
            )

        self.wait_for(
            f"{reporter} to checkpoint both reports", both_checkpointed, deadline, every=0.05
        )
        fleet.kill(reporter)
        done = {pk: cursor["orders"] for pk, cursor in reports.values_list("pk", "cursor")}
        self.say(
            "kill -9",
            f"{reporter} (pid {fleet.pids[reporter]}) killed while it holds the "
            f"sales reports {expiring} (lease {fleet.lease:g} s, {done[expiring]} "
            f"orders summed) and {stalling} (lease 1 h, {done[stalling]} "
            f"summed); no other worker serves the {REPORTS!r} queue, so both "
            "stay claimed for the admin",
        )
        return {"expired": expiring, "stalled": stalling}

    @staticmethod
    def stranded(left: dict[str, int]) -> bool:
        """True once the admin's lease filters (the same verbs) show the reports as left."""
        return (
            Job.objects.expired().filter(pk=left["expired"]).exists()
            and Job.objects.stalled_claims(heartbeat_seconds()).filter(pk=left["stalled"]).exists()
        )

    def verify(
        self,
        jobs: list[int],
        orders: list[int],
        backfill: int,
        partner: int,
        victim: str,
        killed_cursor: Any,
    ) -> None:
        """Exit non-zero unless the run shows what the tour claims."""
        problems = []
        job = Job.objects.get(pk=backfill)
        took_over = JobFailure.objects.filter(
            job_id=backfill, kind=FailureKind.LEASE_EXPIRED, worker_id=victim
        ).exists()
        if not (
            job.state == JobState.SUCCEEDED
            and job.fence >= 2
            and took_over
            and job.claimed_by != victim
        ):
            problems.append(
                f"job {backfill} was not taken over from {victim} and finished "
                f"(state {job.state}, fence {job.fence}, by {job.claimed_by})"
            )
        elif (job.result or {}).get("resumed_after") != killed_cursor:
            problems.append(
                f"job {backfill} did not resume after the cursor {killed_cursor} "
                f"its killed worker committed (result {job.result})"
            )
        dead = Job.objects.get(pk=partner)
        if dead.state != JobState.DEAD or dead.attempts != dead.max_attempts:
            problems.append(
                f"the partner sync should be dead after {dead.max_attempts} "
                f"attempts (state {dead.state}, {dead.attempts} attempts)"
            )
        others = (
            Job.objects.filter(pk__in=jobs).exclude(pk=partner).exclude(state=JobState.SUCCEEDED)
        )
        if others.exists():
            problems.append(f"jobs not succeeded: {list(others.values_list('pk', 'state'))}")
        if Order.objects.filter(pk__in=orders, tax_cents__isnull=True).exists():
            problems.append("the backfill left orders without tax")
        twice = (
            JobEffect.objects.filter(job_id__in=jobs)
            .values("job", "key")
            .annotate(n=Count("id"))
            .filter(n__gt=1)
        )
        if twice.exists():
            problems.append("a receipt was marked sent twice")
        if problems:
            raise TourFailed("; ".join(problems))

    def summary(
        self, jobs: list[int], orders: list[int], backfill: int, victim: str, elapsed: float
    ) -> None:
        self.heading("Summary")
        rows = (
            Job.objects.filter(pk__in=jobs)
            .values("task_path")
            .order_by("task_path")
            .annotate(
                n=Count("id", distinct=True),
                ok=Count("id", distinct=True, filter=Q(state=JobState.SUCCEEDED)),
                dead=Count("id", distinct=True, filter=Q(state=JobState.DEAD)),
                tries=Count("failures", filter=Q(failures__kind=FailureKind.EXCEPTION)),
                lost=Count("failures", filter=Q(failures__kind=FailureKind.LEASE_EXPIRED)),
            )
        )
        table = [["task", "jobs", "succeeded", "dead", "failed tries", "taken over", "workers"]]
        for r in rows:
            workers = set(
                Job.objects.filter(pk__in=jobs, task_path=r["task_path"]).values_list(
                    "claimed_by", flat=True
                )
            )
            workers |= set(
                JobFailure.objects.filter(
                    job_id__in=jobs, job__task_path=r["task_path"]
                ).values_list("worker_id", flat=True)
            )
            table.append(
                [
                    r["task_path"].rsplit(".", 1)[-1],
                    str(r["n"]),
                    str(r["ok"]),
                    str(r["dead"]),
                    str(r["tries"]),
                    str(r["lost"]),
                    ", ".join(sorted(w for w in workers if w)),
                ]
            )
        self.stdout.write(render_table(table))
        job = Job.objects.get(pk=backfill)
        self.stdout.write("")
        self.stdout.write(
            f"  job {backfill} (nightly_backfill): claimed by {victim}, killed "
            f"with SIGKILL, taken over by {job.claimed_by} after its lease with "
            f"fence {job.fence}; result {job.result}"
        )
        mine = Order.objects.filter(pk__in=orders)
        sent = mine.filter(receipt_sent_at__isnull=False).count()
        self.stdout.write(
            f"  receipts marked sent: {sent}, each once (fenced + once); "
            f"orders with tax: {mine.filter(tax_cents__isnull=False).count()}"
            f"/{len(orders)}"
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"  Takeover after SIGKILL: yes. Nothing lost. Tour took {elapsed:.1f} s."
            )
        )

    def admin_hint(self, left: dict[str, int]) -> None:
        user = User.objects.filter(username=DEMO_USER).first()
        if user is None:
            User.objects.create_superuser(DEMO_USER, "admin@example.com", DEMO_PASSWORD)
        else:
            user.set_password(DEMO_PASSWORD)
            user.is_staff = user.is_superuser = user.is_active = True
            user.save()
        env = []
        if os.environ.get("DATABASE_URL"):
            url = urlsplit(os.environ["DATABASE_URL"])
            if url.password:  # never print a password; say where it goes
                url = url._replace(netloc=url.netloc.replace(f":{url.password}@", ":PASSWORD@"))
            env.append(f"DATABASE_URL={urlunsplit(url)}")
        elif settings.DATABASES["default"]["NAME"] != str(Path(settings.BASE_DIR) / "shop.sqlite3"):
            env.append(f"SHOP_SQLITE={settings.DATABASES['default']['NAME']}")
        python = os.path.relpath(sys.executable, settings.BASE_DIR)
        self.heading("See it in the admin")
        self.stdout.write(
            f"  cd {settings.BASE_DIR} && {' '.join([*env, python])} manage.py runserver"
        )
        self.stdout.write(
            "  open  http://127.0.0.1:8000/admin/django_leases/job/    "
            f"user {DEMO_USER}, password {DEMO_PASSWORD}"
        )
        self.left_for_the_admin(left, f"{' '.join([*env, python])} manage.py")
        self.stdout.write(
            "  and   the 'Lease advisor' button above the list; "
            f"{' '.join([*env, python])} manage.py lease_report (handler "
            "durations against each task's lease)"
        )

    def left_for_the_admin(self, left: dict[str, int], manage: str) -> None:
        """Say what each job the tour left shows in the admin, and where to look."""
        period = heartbeat_seconds()
        jobs = {j.pk: j for j in Job.objects.with_lease_status(period).filter(pk__in=left.values())}
        expired, stalled, dead = jobs[left["expired"]], jobs[left["stalled"]], jobs[left["dead"]]
        backfill = jobs[left["taken_over"]]
        errors = JobFailure.objects.filter(job=dead).count()
        todo = Order.objects.filter(pk__gt=(expired.cursor or {}).get("after_id", 0)).count()
        rows = [
            (
                "expired",
                f"{ADMIN_JOBS}?lease=expired",
                f"job {expired.pk}, a sales report claimed by {expired.claimed_by}, which was killed "
                f"with SIGKILL. No worker serves the {REPORTS!r} queue now, so its "
                f'{expired.lease_seconds:g} s lease ran out and nobody took the job over: "expired '
                f"{duration_text((expired.db_now - expired.lease_expires_at).total_seconds())} "
                'ago". Any worker serving the queue may claim it.',
            ),
            (
                "stalled",
                f"{ADMIN_JOBS}?lease=stalled",
                f"job {stalled.pk}, the other report {stalled.claimed_by} held, with a 1 h lease: "
                "valid for most of the hour, but no heartbeat since the kill, so after two "
                f'heartbeat periods ({duration_text(2 * period)}) it reads "stalled: no '
                "heartbeat for ...\". The action 'Expire selected stalled claims now' ends the "
                "lease so that a worker can take the job over.",
            ),
            (
                "dead",
                f"{ADMIN_JOBS}{dead.pk}/change/",
                f"job {dead.pk}, the partner sync: {dead.attempts} attempts, each a "
                f"ConnectionError, {errors} rows in its page's error history; then dead "
                f"(state filter 'dead'). The action 'Requeue' would give it {dead.max_attempts} more.",
            ),
            (
                "taken over",
                f"{ADMIN_JOBS}{backfill.pk}/change/",
                f"job {backfill.pk}, the backfill: a 'lease expired' row for the killed worker in "
                f"its error history, then succeeded with fence {backfill.fence}; its result says "
                f"the cursor it resumed after.",
            ),
            (
                "workers",
                ADMIN_JOBS.replace("/job/", "/workerprocess/"),
                f"the killed workers look gone; {expired.claimed_by} still holds 2 claims, "
                "1 of them expired.",
            ),
            (
                "claimed",
                f"{ADMIN_JOBS}?lease=claimed",
                f"the 'claimed (lease valid)' filter lists job {stalled.pk} alone, stalled. No claim "
                "is healthy: that takes a live worker renewing it, and the tour leaves no process "
                f"running. Start one ({manage} run_lease_worker) and it takes job {expired.pk} over "
                '(fence 2), resumes after its cursor, and reads "expires in ..." for the '
                f"~{todo * expired.kwargs['pause']:.0f} s it still needs.",
            ),
            (
                "schedules",
                ADMIN_JOBS.replace("/job/", "/schedule/"),
                f"the {SCHEDULE!r} schedule: its next run, its last run and the job it made; "
                "'Pause', 'Resume' and 'Run now' act on it, and each job it made links back.",
            ),
        ]
        self.stdout.write("  What the tour left there, and where to look:")
        for label, url, text in rows:
            self.stdout.write(f"  {label:<10}  {url}")
            for line in textwrap.wrap(text, width=84):
                self.stdout.write(f"  {'':<10}  {line}")


def render_table(rows: list[list[str]]) -> str:
    """A plain-text table: first row is the header, numbers right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        return (
            "  "
            + "  ".join(
                c.rjust(w) if c.isdigit() else c.ljust(w)
                for c, w in zip(cells, widths, strict=True)
            ).rstrip()
        )

    return "\n".join([line(rows[0]), line(["-" * w for w in widths]), *map(line, rows[1:])])


class Fleet:
    """run_lease_worker subprocesses, each logging to a file."""

    def __init__(self, manage_py: Path, logs: Path, *, lease: float) -> None:
        self.manage_py, self.logs, self.lease = manage_py, logs, lease
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 -- the child writes it
        self.procs[name] = subprocess.Popen(
            [
                sys.executable,
                str(self.manage_py),
                "run_lease_worker",
                "--worker-id",
                name,
                *args,
                "--poll",
                "0.2",
                "--concurrency",
                "2",
                "--grace",
                "5",
                "-v",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.pids[name] = self.procs[name].pid

    def all_registered(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise TourFailed(f"worker {name} exited with status {proc.returncode} at start")
        return WorkerProcess.objects.filter(
            worker_id__in=list(self.procs),
            stopped_at__isnull=True,
            pid__in=list(self.pids.values()),
        ).count() == len(self.procs)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self, graceful: bool = False) -> dict[str, int | None]:
        """SIGTERM each worker (a graceful stop), SIGKILL any still running after 15 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs = {}
        return codes

    def tails(self, lines: int = 15) -> list[tuple[str, str]]:
        out = []
        for log in sorted(self.logs.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()
            out.append((log.stem, "\n".join(text[-lines:])))
        return out
