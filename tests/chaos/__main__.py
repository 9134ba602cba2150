"""python -m tests.chaos --profile short|medium|soak [--out DIR] [--sabotage] [--markdown FILE]
                       [--pooler]

Exit status 0 when every invariant held (and, with --sabotage, every injected breakage was
caught); 1 otherwise. Writes DIR/report.json, DIR/report.md and the workers' logs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from .harness import PROFILES, Harness, dump
from .report import markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--out", type=Path, default=None, help="where logs and reports go")
    parser.add_argument(
        "--sabotage",
        action="store_true",
        help="after the checks, break the data four ways and make sure the checker catches each",
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="also write the figures table to this file"
    )
    parser.add_argument(
        "--pooler",
        action="store_true",
        help="run everything through PgBouncer in transaction pooling (tests/pooler.py)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="override the profile's job count")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s chaos %(message)s")
    out = args.out or Path(tempfile.mkdtemp(prefix="leases-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    profile = PROFILES[args.profile]
    if args.jobs:
        profile.jobs = args.jobs
    harness = Harness(profile, out, pooler=args.pooler)
    report: dict = {"command": "python -m tests.chaos " + " ".join(argv or sys.argv[1:])}
    started = time.monotonic()
    try:
        run = harness.run()
        dump(out / "run.json", run)
        from .checks import check, sabotage

        report.update(check(run))
        report["figures"]["pooler"] = run["pooler"]
        if args.sabotage:
            report["sabotage"] = sabotage(run)
    finally:
        harness.teardown()
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["figures"]["wall_seconds"] = report["wall_seconds"]
    dump(out / "report.json", report)
    table = markdown(report, profile.name)
    (out / "report.md").write_text(table)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    failed = list(report["violations"])
    for name, caught in report.get("sabotage", {}).items():
        if not caught:
            failed.append(f"sabotage {name!r} went unnoticed")
    for line in failed:
        print("VIOLATION:", line, file=sys.stderr)
    print(f"report: {out / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
