"""The figures table of docs/reliability.md, from a chaos report."""

from __future__ import annotations

from typing import Any


def _s(x: Any) -> str:
    return "–" if x is None else f"{x:.2f} s"


def markdown(report: dict[str, Any], profile: str) -> str:
    f = report["figures"]
    faults = f.get("faults", {})
    rec = f.get("recovery_after_kill", {})
    stop = f.get("loss_to_stop", {})
    kinds = f.get("job_kinds", {})
    rows = [
        ("profile", f"`{profile}`, {f.get('wall_seconds', '?')} s wall clock"),
        ("jobs enqueued / succeeded", f"{f['jobs']} / {f['succeeded']}"),
        (
            "claims (incl. retakes) / takeovers of expired claims",
            f"{f['claims']} / {f['takeovers']}",
        ),
        ("kill -9 of a worker mid-job", faults.get("kill", 0)),
        ("SIGSTOP past the lease, then SIGCONT", faults.get("sigstop", 0)),
        ("network partition (proxy cut, then healed)", faults.get("partition", 0)),
        ("PostgreSQL restart (pg_ctl restart)", faults.get("pg_restart", 0)),
        ("max_connections exhausted + a worker's connections cut", faults.get("pressure", 0)),
        (
            "workers with skewed clocks (libfaketime)",
            ", ".join(f.get("skewed_workers", [])) or "none",
        ),
        (
            "handlers blocking their thread past the lease (hog) / ignoring cancellation in a "
            "child process (deaf)",
            f"{kinds.get('hog', 0)} / {kinds.get('deaf', 0)} executions",
        ),
        ("**jobs lost**", f"**{f['lost']}**"),
        ("fenced effects applied exactly once", f"{f['effects_exactly_once']} of {f['succeeded']}"),
        ("stale acks refused (ack rejected or fenced commit refused)", f["stale_acks_refused"]),
        ("results discarded after a lost claim", f["results_discarded"]),
        (
            "duplicate executions (overlapping) / allowed (began after the lease expired)",
            f"{f['duplicate_executions']} / {f['duplicates_allowed']}",
        ),
        (
            "recovery after kill -9: p50 / p99 / max (n)",
            f"{_s(rec.get('p50'))} / {_s(rec.get('p99'))} / {_s(rec.get('max'))} ({rec.get('n', 0)}); "
            f"lease + heartbeat + poll = {rec.get('bound', 0):g} s",
        ),
    ]
    for name, label in (
        ("cooperative", "loss → stop, cooperative handlers: p50 / max (n)"),
        ("process", "loss → stop, process isolation (killed): p50 / max (n)"),
        (
            "thread_ignoring_cancellation",
            "loss → stop, thread handler ignoring cancellation: p50 / max (n)",
        ),
    ):
        d = stop.get(name)
        if d:
            rows.append((label, f"{_s(d['p50'])} / {_s(d['max'])} ({d['n']})"))
    if f.get("handlers_ended_before_loss"):
        rows.append(
            (
                "handlers that had already ended (database error) when their claim was lost",
                f["handlers_ended_before_loss"],
            )
        )
    drain = f.get("drain")
    if drain:
        rows.append(
            (
                "jobs left when the feed ended / drained in",
                f"{drain['left_at_start']} / {drain['seconds']:g} s ({drain['ended']})",
            )
        )
    rows.append(("invariant violations", len(report["violations"])))
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines.append("")
    lines.append(f"Command: `{report.get('command', 'python -m tests.chaos')}`")
    return "\n".join(lines) + "\n"
