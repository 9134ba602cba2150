"""The hand-written limit: raw psycopg, autocommit, on a table shaped like django-leases'.

    python limit.py worker --batch 1      # one claim + one token-checked ack per job
    python limit.py worker --batch 10     # claims and acks 10 at a time
    python limit.py enqueue-rate          # raw INSERT loop and raw executemany

limit_job has limit_job's claim columns and its five indexes (pending, claimed,
token, finished, census), so the distance to django-leases is mostly the cost of the
library's code path; django-leases' table has more columns (and a unique-key column) still.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import dsn, sleep_body, stamp_body  # noqa: E402

DB = os.environ.get("BENCH_DB", "bench_limit")

CLAIM = """
UPDATE limit_job SET
    state = 'claimed', claim_token = gen_random_uuid(), fence = fence + 1,
    attempts = attempts + 1, claimed_by = %(worker)s,
    lease_expires_at = now() + make_interval(secs => lease_seconds),
    heartbeat_at = now(), last_attempted_at = now(), started_at = coalesce(started_at, now())
WHERE id {op} (
    SELECT id FROM limit_job
    WHERE state = 'pending' AND queue_name = 'default' AND available_at <= now()
    ORDER BY priority DESC, available_at, id
    FOR UPDATE SKIP LOCKED LIMIT %(limit)s)
RETURNING id, claim_token, task_path, args
"""
ACK_ONE = """
UPDATE limit_job SET state = 'succeeded', result = 'null'::jsonb, finished_at = now(),
    claim_token = NULL, lease_expires_at = NULL
WHERE id = %s AND claim_token = %s AND state = 'claimed'
"""
ACK_MANY = """
UPDATE limit_job AS j SET state = 'succeeded', result = 'null'::jsonb,
    finished_at = now(), claim_token = NULL, lease_expires_at = NULL
FROM unnest(%s::bigint[], %s::uuid[]) AS a(id, token)
WHERE j.id = a.id AND j.claim_token = a.token AND j.state = 'claimed'
"""
INSERT = """
INSERT INTO limit_job (queue_name, task_path, args, kwargs, priority, state,
    lease_seconds, fence, attempts, max_attempts, leases_lost, claimed_by)
VALUES ('default', %s, %s, '{}'::jsonb, 0, 'pending', 30, 0, 0, 5, 0, '')
"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS limit_job (
    id bigserial PRIMARY KEY,
    queue_name varchar(100) NOT NULL,
    task_path varchar(255) NOT NULL,
    args jsonb NOT NULL,
    kwargs jsonb NOT NULL,
    priority smallint NOT NULL,
    state varchar(10) NOT NULL,
    available_at timestamptz NOT NULL DEFAULT now(),
    lease_seconds double precision NOT NULL,
    lease_expires_at timestamptz,
    claim_token uuid,
    fence bigint NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    leases_lost integer NOT NULL,
    claimed_by varchar(200) NOT NULL,
    heartbeat_at timestamptz,
    cursor jsonb,
    result jsonb,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    last_attempted_at timestamptz,
    finished_at timestamptz
);
CREATE INDEX IF NOT EXISTS limit_job_pending_idx ON limit_job
    (queue_name, priority DESC, available_at, id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS limit_job_claimed_idx ON limit_job (lease_expires_at)
    WHERE state = 'claimed';
CREATE INDEX IF NOT EXISTS limit_job_token_idx ON limit_job (claim_token)
    WHERE claim_token IS NOT NULL;
CREATE INDEX IF NOT EXISTS limit_job_finished_idx ON limit_job (state, finished_at);
CREATE INDEX IF NOT EXISTS limit_job_census_idx ON limit_job (queue_name, task_path, state);
"""


def cmd_setup(a) -> dict:
    with psycopg.connect(dsn(DB), autocommit=True) as conn:
        conn.execute(SCHEMA)
    return {"ok": True}


def run(task_path: str, args: list) -> None:
    if task_path.endswith(".stamp"):
        stamp_body(*args)
    elif task_path.endswith(".sleep_stamp"):
        sleep_body(*args)


def cmd_worker(a) -> dict:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    conn = psycopg.connect(dsn(DB), autocommit=True)
    if a.listen:
        conn.execute("LISTEN bench_limit")
    claim = CLAIM.format(op="=" if a.batch == 1 else "IN")
    worker = f"limit-{os.getpid()}"
    done = 0
    while not stop:
        rows = conn.execute(claim, {"worker": worker, "limit": a.batch}).fetchall()
        if not rows:
            if a.burst:
                break
            if a.listen:
                for _ in conn.notifies(timeout=a.poll, stop_after=1):
                    pass
            else:
                time.sleep(a.poll)
            continue
        for _, _, task_path, args in rows:
            run(task_path, args)
        if len(rows) == 1:
            conn.execute(ACK_ONE, (rows[0][0], rows[0][1]))
        else:
            conn.execute(ACK_MANY, ([r[0] for r in rows], [r[1] for r in rows]))
        done += len(rows)
    return {"done": done}


def cmd_enqueue_rate(a) -> dict:
    conn = psycopg.connect(dsn(DB), autocommit=True)
    noop = "sys_leases.tasks.noop"
    conn.execute(INSERT, (noop, Jsonb([])))
    started = time.perf_counter()
    for _ in range(a.single):
        conn.execute(INSERT, (noop, Jsonb([])))
    single = time.perf_counter() - started
    started = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(INSERT, [(noop, Jsonb([]))] * a.bulk)
    bulk = time.perf_counter() - started
    return {
        "single_per_s": a.single / single,
        "bulk_per_s": a.bulk / bulk,
        "bulk_api": "cursor.executemany in one transaction",
    }


def cmd_prefill(a) -> dict:
    conn = psycopg.connect(dsn(DB), autocommit=True)
    started = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(INSERT, [("sys_leases.tasks.noop", Jsonb([]))] * a.count)
    return {"count": a.count, "seconds": time.perf_counter() - started}


def cmd_feed(a) -> dict:
    import random

    conn = psycopg.connect(dsn(DB), autocommit=True)
    for _ in range(a.count):
        time.sleep(random.uniform(a.gap * 0.5, a.gap * 1.5))
        sent = time.time()
        conn.execute(INSERT, ("sys_leases.tasks.stamp", Jsonb([sent])))
        conn.execute("NOTIFY bench_limit")
    return {"sent": a.count}


def cmd_submit_sleep(a) -> dict:
    conn = psycopg.connect(dsn(DB), autocommit=True)
    conn.execute(INSERT, ("sys_leases.tasks.sleep_stamp", Jsonb([a.seconds, a.tag])))
    return {"submitted": a.tag}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    p = sub.add_parser("worker")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--listen", action="store_true")
    p.add_argument("--burst", action="store_true")
    p = sub.add_parser("enqueue-rate")
    p.add_argument("--single", type=int, default=2000)
    p.add_argument("--bulk", type=int, default=10000)
    p = sub.add_parser("prefill")
    p.add_argument("count", type=int)
    p = sub.add_parser("feed")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--gap", type=float, default=0.05)
    p = sub.add_parser("submit-sleep")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--tag", required=True)
    a = parser.parse_args()
    out = globals()["cmd_" + a.cmd.replace("-", "_")](a)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
