"""manage.py lease_report: handler durations per task against the lease and heartbeat."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ... import advisor, conf
from ...durations import duration_text
from ...enqueue import migrated
from ...exceptions import InvalidLeaseOption
from ...models import Job
from .. import LeasesCommand

# report()'s arguments, by the options that give them.
_FLAGS = {
    "since_days": "--days",
    "headroom": "--headroom",
    "floor": "--min-lease",
    "min_samples": "--min-samples",
    "alias": "--backend",
}


class Command(LeasesCommand):
    help = (
        "Read succeeded jobs and print, per task, handler duration p50/p99/p99.9/max, the "
        "configured lease and heartbeat, and whether the lease is too short, too long or "
        "the heartbeat too slow, with the numbers to use instead. Exits 0 either way "
        "(use --check to exit 1 when a task needs attention)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--days",
            type=float,
            default=7.0,
            metavar="N",
            help="Only jobs that finished in the last N days, database clock "
            "(default 7; 0 for all).",
        )
        parser.add_argument(
            "--backend",
            default=None,
            help="Lease backend alias in settings.TASKS (default: the first).",
        )
        parser.add_argument(
            "--headroom",
            type=float,
            default=advisor.HEADROOM,
            metavar="X",
            help=f"The lease should be at least p99.9 times X (default {advisor.HEADROOM:g}).",
        )
        parser.add_argument(
            "--min-lease",
            type=float,
            default=advisor.MIN_LEASE,
            metavar="SECONDS",
            help="Never recommend a lease below this, so it still outlasts a "
            f"database failover (default {advisor.MIN_LEASE:g}).",
        )
        parser.add_argument(
            "--min-samples",
            type=int,
            default=advisor.MIN_SAMPLES,
            metavar="N",
            help=f"Judge only tasks with N finished jobs (default {advisor.MIN_SAMPLES}).",
        )
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        parser.add_argument(
            "--check", action="store_true", help="Exit with status 1 if any task has a finding."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            database = conf.get_options(conf.lease_backend(options["backend"], "alias")).database
            with migrated(Job, database, CommandError):
                rows = advisor.report(
                    options["days"] or None,
                    alias=options["backend"],
                    headroom=options["headroom"],
                    floor=options["min_lease"],
                    min_samples=options["min_samples"],
                )
        except InvalidLeaseOption as e:
            # advisor.report() checks its arguments: named here as the options that gave them.
            raise CommandError(f"{_FLAGS.get(e.option, e.option)}: {e.reason}") from e
        if options["json"]:
            self.stdout.write(json.dumps([_as_dict(r) for r in rows], indent=2))
        else:
            self._table(rows, options["days"])
        if options["check"] and any(f.code != advisor.FEW for r in rows for f in r.findings):
            raise CommandError("some tasks need a different lease or heartbeat", returncode=1)

    def _table(self, rows: list[advisor.TaskAdvice], days: float) -> None:
        if not rows:
            span = f" in the last {days:g} days" if days else ""
            self.stdout.write(f"No succeeded jobs{span}: nothing to measure yet.")
            return

        def s(seconds: float) -> str:
            return duration_text(seconds, precise=True)

        head = ["task", "jobs", "p50", "p99", "p99.9", "max", "lease", "heartbeat", "advice"]
        body = [
            [
                r.task_path,
                str(r.samples),
                s(r.p50),
                s(r.p99),
                s(r.p999),
                s(r.max),
                s(r.lease),
                "lease/3" if r.heartbeat is None else s(r.heartbeat),
                "ok" if r.ok else ", ".join(f.code for f in r.findings),
            ]
            for r in rows
        ]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        for line in [head, ["-" * w for w in widths], *body]:
            self.stdout.write(
                "  ".join(
                    c.ljust(w) if i in (0, 8) else c.rjust(w)
                    for i, (c, w) in enumerate(zip(line, widths, strict=True))
                ).rstrip()
            )
        self.stdout.write("")
        for r in rows:
            style = self.style.SUCCESS if r.ok else self.style.WARNING
            self.stdout.write(style(f"{r.task_path}: {r.verdict}"))


def _as_dict(r: advisor.TaskAdvice) -> dict[str, Any]:
    return {
        "task": r.task_path,
        "jobs": r.samples,
        "p50": r.p50,
        "p99": r.p99,
        "p99_9": r.p999,
        "max": r.max,
        "lease": r.lease,
        "heartbeat": r.heartbeat,
        "recommended_lease": r.recommended_lease,
        "recommended_heartbeat": r.recommended_heartbeat,
        "findings": [{"code": f.code, "text": f.text} for f in r.findings],
    }
