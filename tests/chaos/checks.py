"""Check a finished chaos run against the five invariants, from the database and the logs.

The evidence is independent of the code under test: an audit trigger the harness installs
on the job table records every change of state, fence or lease with the database's own
transaction time (``chaos_lease_history``); handlers record each execution (ChaosRun) and
their fenced effect (ChaosLedger, ChaosSlot); the workers' -v 2 logs say what each process
believed (claims, losses, acks, refusals), stamped with its own clock, which the checker
maps onto the database clock with the offset each worker's ChaosRun rows reveal.

``sabotage()`` breaks the data the way a broken queue would (a stale ack applied, a
takeover before expiry, a lease on a worker's clock, a job left behind) and checks that the
checker notices each: a checker that cannot fail proves nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

AUDIT_SQL = """
CREATE TABLE IF NOT EXISTS chaos_lease_history (
    id bigserial PRIMARY KEY, job_id bigint NOT NULL,
    old_state text, new_state text, old_fence bigint, new_fence bigint,
    old_lease timestamptz, new_lease timestamptz, old_token uuid, new_token uuid,
    claimed_by text, tx_now timestamptz NOT NULL, wall timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS chaos_lease_history_job ON chaos_lease_history (job_id, id);
CREATE OR REPLACE FUNCTION chaos_audit() RETURNS trigger AS $$
BEGIN
  IF NEW.state IS DISTINCT FROM OLD.state OR NEW.fence IS DISTINCT FROM OLD.fence
     OR NEW.lease_expires_at IS DISTINCT FROM OLD.lease_expires_at THEN
    INSERT INTO chaos_lease_history (job_id, old_state, new_state, old_fence, new_fence,
        old_lease, new_lease, old_token, new_token, claimed_by, tx_now, wall)
    VALUES (NEW.id, OLD.state, NEW.state, OLD.fence, NEW.fence, OLD.lease_expires_at,
        NEW.lease_expires_at, OLD.claim_token, NEW.claim_token, NEW.claimed_by,
        statement_timestamp(),
        clock_timestamp());
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS chaos_audit ON django_leases_job;
CREATE TRIGGER chaos_audit AFTER UPDATE ON django_leases_job
    FOR EACH ROW EXECUTE FUNCTION chaos_audit();
"""

# The workers' events the checker reads (JSON lines), under the names it files them by; the
# chaos handler's own are chaos_stopped_<stage> and chaos_raised_<stage> (its stage when a
# lost claim stopped it, or when it ended on another exception, e.g. its database
# connection broke: its outcome may then wait in the worker's retry back-off before the
# "discarded" event).
NAMES = {
    # A takeover of an expired claim is a claim too.
    "claimed": "claimed",
    "takeover": "claimed",
    "failed": "failed",
    # An attempt's last failure; or a claim ending a job for good, which runs no more.
    "dead_lettered": "failed",
    "acked": "acked",
    "ack_rejected": "ack_rejected",
    "fail_rejected": "fail_rejected",
    "discarded": "discarded",
    "lost": "lost",
    "process_killed": "killing",
    "orphaned": "orphaned",
}
# How far past the bound a stop may land on a loaded 2-core machine (scheduling, the
# statement that tells the worker, the log write).
SLACK = 1.0
# The events that say a handler's code no longer runs: it stopped on LeaseLost, it raised
# something else, its process was killed (SIGKILL ends it there), its process found its
# worker gone (it ends within the kill grace), its result was discarded.
STOP_MARKS = ("stopped", "raised", "killing", "orphaned", "discarded")
KILL_GRACE = 1.0  # django_leases.worker.child.KILL_GRACE_SECONDS


def install_audit() -> None:
    from django.db import connection

    with connection.cursor() as c:
        c.execute(AUDIT_SQL)


def _rows(sql: str, params: Any = ()) -> list[tuple]:
    from django.db import connection

    with connection.cursor() as c:
        c.execute(sql, params)
        return c.fetchall()


def parse_logs(workers: list[dict[str, Any]]) -> list[tuple[str, str, float, tuple]]:
    """(worker_id, name, local time, (job_id, fence, stage)) for every event the checker
    reads (NAMES, the handler's chaos_*), from the workers' JSON lines."""
    from ..worker_helpers import read_records

    events = []
    for w in workers:
        path = Path(w["log"])
        if not path.exists():
            continue
        for record in read_records(path.read_text(errors="replace")):
            event = str(record.get("event", ""))
            stage = ""
            if event.startswith(("chaos_stopped_", "chaos_raised_")):
                _, name, stage = event.split("_", 2)
            elif event in NAMES:
                name = NAMES[event]
            else:
                continue
            at = datetime.fromisoformat(record["time"]).timestamp()
            events.append((w["worker_id"], name, at, (record["job_id"], record["fence"], stage)))
    return events


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def check(run: dict[str, Any], *, stop_bound_scale: float = 1.0) -> dict[str, Any]:
    """Return {"violations": [...], "figures": {...}} for a finished run."""
    p = run["profile"]
    lease, beat, poll = p["lease"], p["heartbeat"], p["poll"]
    v: list[str] = []
    fig: dict[str, Any] = {}

    # -- (3) nothing is lost: every enqueued job is there and terminal -----------------
    jobs = {
        pk: (state, fence, dead, result)
        for pk, state, fence, dead, result in _rows(
            "SELECT id, state, fence, dead_reason, result FROM django_leases_job"
        )
    }
    expected = set(run["enqueued"])
    lost = sorted(expected - set(jobs))
    if lost:
        v.append(f"{len(lost)} enqueued jobs are missing from the table: {lost[:10]}")
    if set(jobs) - expected:
        v.append(f"jobs nobody enqueued: {sorted(set(jobs) - expected)[:10]}")
    unfinished = sorted(pk for pk, (s, *_) in jobs.items() if s in ("pending", "claimed"))
    if unfinished:
        v.append(f"{len(unfinished)} jobs never reached a terminal state: {unfinished[:10]}")
    not_ok = sorted(
        (pk, s, d)
        for pk, (s, _, d, _) in jobs.items()
        if s not in ("pending", "claimed", "succeeded")
    )
    if not_ok:
        v.append(f"{len(not_ok)} jobs ended other than succeeded: {not_ok[:10]}")
    fig["jobs"] = len(expected)
    fig["succeeded"] = sum(1 for s, *_ in jobs.values() if s == "succeeded")
    fig["lost"] = len(lost) + len(unfinished)

    # -- history ---------------------------------------------------------------------
    history = _rows(
        "SELECT job_id, old_state, new_state, old_fence, new_fence, "
        "extract(epoch FROM old_lease), extract(epoch FROM new_lease), "
        "extract(epoch FROM tx_now), claimed_by, id FROM chaos_lease_history ORDER BY id"
    )
    lease_end: dict[tuple[int, int], float] = {}
    takeover: dict[tuple[int, int], float] = {}
    successes: dict[int, list[int]] = defaultdict(list)
    ended: dict[tuple[int, int], float] = {}
    claims = 0
    own_clock = []
    early = []
    for job, o_state, n_state, o_fence, n_fence, o_lease, n_lease, now, by, _hid in history:
        o_lease = float(o_lease) if o_lease is not None else None
        n_lease = float(n_lease) if n_lease is not None else None
        now = float(now)
        if n_state == "claimed" and n_lease is not None:
            lease_end[(job, n_fence)] = max(lease_end.get((job, n_fence), 0.0), n_lease)
            # (1) one clock: every lease is the database's now() plus the lease.
            if abs(n_lease - now - lease) > 0.05:
                own_clock.append((job, n_fence, by, round(n_lease - now, 3)))
        if n_fence != o_fence:
            claims += 1
            if o_state == "claimed":
                takeover[(job, o_fence)] = now
                # (4) a claim is taken over only once its lease has run out.
                if o_lease is None or not o_lease < now:
                    early.append((job, o_fence, n_fence, by, round((o_lease or 0) - now, 3)))
        if o_state == "claimed" and n_state == "succeeded":
            successes[job].append(o_fence)
        if o_state == "claimed" and n_state != "claimed":
            ended[(job, o_fence)] = now  # its owner acked, failed or released it
    if own_clock:
        v.append(
            f"{len(own_clock)} leases not measured on the database clock "
            f"(lease_expires_at - now() != {lease:g} s): {own_clock[:5]}"
        )
    if early:
        v.append(f"{len(early)} claims taken over before their lease expired: {early[:5]}")
    fig["claims"] = claims
    fig["takeovers"] = len(takeover)

    # -- (5) exactly once: one fenced effect per job, by the claim that acknowledged --
    ledger: dict[int, list[int]] = defaultdict(list)
    for job, fence in _rows("SELECT job_id, fence FROM testapp_chaosledger"):
        ledger[job].append(fence)
    slots = {
        key: (fence, applied)
        for key, fence, applied in _rows("SELECT key, fence, applied FROM testapp_chaosslot")
    }
    key_of = dict(_rows("SELECT id, args->>0 FROM django_leases_job"))
    twice = []
    for pk, (state, fence, _, _result) in jobs.items():
        if state != "succeeded":
            continue
        effects = ledger.get(pk, [])
        slot = slots.get(key_of.get(pk), (None, 0))
        wins = successes.get(pk, [])
        if (
            len(effects) != 1
            or slot[1] != 1
            or len(wins) != 1
            or effects[0] != fence
            or slot[0] != fence
            or wins[0] != fence
        ):
            twice.append({"job": pk, "fence": fence, "ledger": effects, "slot": slot, "acks": wins})
    if twice:
        v.append(
            f"{len(twice)} jobs whose fenced effect was not applied exactly once by the "
            f"acknowledging claim: {twice[:5]}"
        )
    fig["effects_exactly_once"] = fig["succeeded"] - len(twice)

    # -- worker clocks and logs ---------------------------------------------------------
    offset: dict[str, float] = {}
    for worker, off in _rows(
        "SELECT worker_id, min(extract(epoch FROM db_start) - local_start) "
        "FROM testapp_chaosrun GROUP BY worker_id"
    ):
        offset[worker] = float(off)
    fig["worker_clock_offsets"] = {w: round(o, 1) for w, o in sorted(offset.items())}
    events = parse_logs(run["workers"])
    by_kind: dict[str, dict[tuple[int, int], tuple[str, float]]] = defaultdict(dict)
    for worker, name, t, groups in events:
        key = (int(groups[0]), int(groups[1]))
        db_t = t + offset.get(worker, 0.0)
        if name == "orphaned":
            db_t += KILL_GRACE  # it ends at the latest once the grace it gives itself is over
        if name == "stopped" and groups[2] == "fenced":
            by_kind["fenced_refused"].setdefault(key, (worker, db_t))
        by_kind[name].setdefault(key, (worker, db_t))

    # (5) every ack of a stale claim was refused, and every ack a worker saw land is the
    # database's one success of that job.
    refused = set(by_kind["ack_rejected"]) | set(by_kind["fenced_refused"])
    stale_applied = [
        k
        for k in refused | set(by_kind["discarded"]) | set(by_kind["fail_rejected"])
        if k[1] in successes.get(k[0], []) or k[1] in ledger.get(k[0], [])
    ]
    if stale_applied:
        v.append(
            f"{len(stale_applied)} refused or discarded results were applied anyway: "
            f"{stale_applied[:5]}"
        )
    wrong_acks = [k for k in by_kind["acked"] if successes.get(k[0]) != [k[1]]]
    if wrong_acks:
        v.append(
            f"{len(wrong_acks)} acks a worker saw succeed that are not the job's one "
            f"success: {wrong_acks[:5]}"
        )
    fig["stale_acks_refused"] = len(refused)
    fig["results_discarded"] = len(by_kind["discarded"])

    # -- (4) executions that overlapped began only after the earlier lease expired ------
    kills = {e["worker"]: e["at"] for e in run["events"] if e["kind"] == "kill"}
    runs: dict[int, list[tuple]] = defaultdict(list)
    for job, fence, worker, kind, start, end in _rows(
        "SELECT job_id, fence, worker_id, kind, extract(epoch FROM db_start), "
        "extract(epoch FROM db_end) FROM testapp_chaosrun ORDER BY job_id, fence"
    ):
        # When it ended: its fenced ack, its stop, its failure, its claim ending, its kill.
        marks = [float(end)] if end is not None else []
        marks += [
            by_kind[k][(job, fence)][1]
            for k in ("stopped", "discarded", "failed")
            if (job, fence) in by_kind[k]
        ]
        marks += [t for t in (ended.get((job, fence)), kills.get(worker)) if t is not None]
        end = min(marks, default=float("inf"))
        runs[job].append((fence, worker, kind, float(start), end))
    duplicates = []
    for job, execs in runs.items():
        for i, (f1, w1, k1, _s1, e1) in enumerate(execs):
            for f2, w2, _, s2, _ in execs[i + 1 :]:
                if f2 > f1 and s2 < e1:
                    end1 = lease_end.get((job, f1))
                    allowed = end1 is not None and s2 > end1
                    duplicates.append(
                        {
                            "job": job,
                            "first": (f1, w1, k1),
                            "second": (f2, w2),
                            "allowed": allowed,
                            "started_after_expiry_s": None if end1 is None else round(s2 - end1, 3),
                        }
                    )
    bad_dups = [d for d in duplicates if not d["allowed"]]
    if bad_dups:
        v.append(
            f"{len(bad_dups)} overlapping executions began before the first one's lease "
            f"expired: {bad_dups[:5]}"
        )
    fig["duplicate_executions"] = len(duplicates)
    fig["duplicates_allowed"] = len(duplicates) - len(bad_dups)
    fig["duplicates"] = duplicates[:50]

    # -- loss to stop: one heartbeat (cooperative), the kill grace (process) -----------
    frozen = defaultdict(list)
    for e in run["events"]:
        if e["kind"] == "sigstop":
            frozen[e["worker"]].append((e["at"], e["until"]))
    isolation = {w["worker_id"]: w["isolation"] for w in run["workers"]}
    kinds = {(job, f): k for job, execs in runs.items() for f, _, k, _, _ in execs}
    delays: dict[str, list[float]] = defaultdict(list)
    slow = []
    before_loss = 0
    ends = {**by_kind["orphaned"], **by_kind["discarded"], **by_kind["stopped"]}
    for key, (worker, stop_t) in ends.items():
        # The handler's code stopped at the first of: it stopped on LeaseLost, it raised
        # another exception, its process was killed or found its worker gone, the worker
        # discarded its result. (A "Discarded result" line can come long after the handler
        # ended: the main loop logs it once its ack/fail retry back-off ends, while the
        # slot thread kills a deaf child as soon as its grace is over.)
        stop_t, stopped_by = min((by_kind[k].get(key, (0, float("inf")))[1], k) for k in STOP_MARKS)
        marks = [t for t in (takeover.get(key), by_kind["lost"].get(key, (0, None))[1]) if t]
        if not marks:
            continue  # stopped for another reason (e.g. released at shutdown)
        loss = min(marks)
        lost_by = "takeover" if loss == takeover.get(key) else "lost"
        for a, b in frozen[worker]:
            if a <= loss <= b or (loss < a and stop_t > b):
                loss = max(loss, b)
        if stop_t < loss:
            before_loss += 1  # it had already returned: nothing ran on after the loss
            continue
        process = isolation.get(worker) == "process"
        kind = kinds.get(key, "?")
        if kind == "hog":
            delays["thread_ignoring_cancellation"].append(stop_t - loss)
            continue  # a thread cannot be stopped from outside (docs/worker.md)
        bound = (beat + 2 * KILL_GRACE if process else beat) * stop_bound_scale
        delay = stop_t - loss
        delays["process" if process else "cooperative"].append(delay)
        if delay > bound + SLACK * stop_bound_scale:
            slow.append(
                {
                    "job": key[0],
                    "fence": key[1],
                    "worker": worker,
                    "kind": kind,
                    "delay_s": round(delay, 3),
                    "bound_s": bound,
                    "stopped_by": stopped_by,
                    "lost_by": lost_by,
                }
            )
    if slow:
        v.append(
            f"{len(slow)} handlers stopped later than their bound after losing the claim: "
            f"{slow[:5]}"
        )
    fig["loss_to_stop"] = {
        k: {"n": len(d), "p50": pct(d, 0.5), "max": max(d)} for k, d in delays.items() if d
    }
    fig["handlers_ended_before_loss"] = before_loss

    # -- recovery after kill -9 ----------------------------------------------------------
    recovery = []
    for e in run["events"]:
        if e["kind"] == "kill":
            for job, fence in e["orphans"]:
                if (job, fence) in takeover:
                    recovery.append(takeover[(job, fence)] - e["at"])
    fig["recovery_after_kill"] = {
        "n": len(recovery),
        "p50": pct(recovery, 0.5),
        "p99": pct(recovery, 0.99),
        "max": max(recovery, default=None),
        "bound": lease + beat + poll,
    }
    fig["faults"] = dict(Counter(e["kind"] for e in run["events"]))
    fig["skewed_workers"] = sorted({w["skew"] for w in run["workers"] if w["skew"]})
    fig["job_kinds"] = dict(Counter(k for k in kinds.values()))
    fig["drain"] = run.get("drain")
    return {"violations": v, "figures": fig}


def sabotage(run: dict[str, Any]) -> dict[str, list[str]]:
    """Break the run's data four ways, each in a transaction rolled back afterwards, and
    return what the checker said about each (every list must be non-empty)."""
    from django.db import connection, transaction

    class Rollback(Exception):
        pass

    def broken(sql: str) -> list[str]:
        out: list[str] = []
        try:
            with transaction.atomic():
                with connection.cursor() as c:
                    c.execute(sql)
                out = check(run)["violations"]
                raise Rollback
        except Rollback:
            pass
        return out

    job = _rows(
        "SELECT id FROM django_leases_job WHERE state = 'succeeded' ORDER BY fence DESC, id LIMIT 1"
    )[0][0]
    key = f"(SELECT args->>0 FROM django_leases_job WHERE id = {job})"
    return {
        # A stale claim's ack and effect get through (the token check is gone).
        "stale_ack_applied": broken(f"""
            UPDATE django_leases_job SET state = 'claimed', claim_token = gen_random_uuid(),
                   lease_expires_at = now() - interval '1 second' WHERE id = {job};
            UPDATE django_leases_job SET state = 'succeeded', claim_token = NULL,
                   lease_expires_at = NULL WHERE id = {job};
            INSERT INTO testapp_chaosledger (job_id, key, fence, worker_id, db_at)
                SELECT id, args->>0, fence - 1, 'stale', now() FROM django_leases_job WHERE id = {job};
            UPDATE testapp_chaosslot SET applied = applied + 1 WHERE key = {key};"""),
        # A claim that ignores the lease: the job is taken while the lease still runs.
        "takeover_before_expiry": broken(f"""
            UPDATE django_leases_job SET state = 'claimed', claim_token = gen_random_uuid(),
                   lease_expires_at = now() + interval '{run["profile"]["lease"]} seconds' WHERE id = {job};
            UPDATE django_leases_job SET fence = fence + 1, claim_token = gen_random_uuid(),
                   lease_expires_at = now() + interval '{run["profile"]["lease"]} seconds' WHERE id = {job};
            UPDATE django_leases_job SET state = 'succeeded', claim_token = NULL,
                   lease_expires_at = NULL WHERE id = {job};"""),
        # A worker writes a lease from its own clock, five minutes ahead.
        "lease_on_worker_clock": broken(f"""
            UPDATE django_leases_job SET state = 'claimed', claim_token = gen_random_uuid(),
                   lease_expires_at = now() + interval '5 minutes 4 seconds' WHERE id = {job};
            UPDATE django_leases_job SET state = 'succeeded', claim_token = NULL,
                   lease_expires_at = NULL WHERE id = {job};"""),
        # A job left behind: parked forever, never run.
        "job_left_behind": broken(f"""
            UPDATE django_leases_job SET state = 'pending', available_at = NULL WHERE id = {job};"""),
    }
