"""Enqueue side of PgQueuer, run inside its own virtualenv (no Django).

    BENCH_SYSTEM=pgqueuer BENCH_DB=bench_pgqueuer python pgq_driver.py prefill 10000

The same commands and JSON answers as driver.py. BENCH_SYSTEM picks the driver both sides
use: ``pgqueuer`` psycopg (its synchronous SyncQueries for enqueue), ``pgqueuer-asyncpg``
asyncpg (Queries on one connection). Each enqueue is one statement in autocommit: its own
transaction. The harness (run.py) never imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import dsn, url  # noqa: E402

ASYNC = os.environ["BENCH_SYSTEM"].endswith("asyncpg")
Enqueue = Callable[[Any, Any, Any], Awaitable[Any]]


async def connect() -> Enqueue:
    """PgQueuer's enqueue(entrypoint, payload, priority) on the system's own driver."""
    if ASYNC:
        import asyncpg
        from pgqueuer import Queries
        from pgqueuer.db import AsyncpgDriver

        queries = Queries(AsyncpgDriver(await asyncpg.connect(url(os.environ["BENCH_DB"]))))
        return queries.enqueue
    import psycopg
    from pgqueuer.db import SyncPsycopgDriver
    from pgqueuer.queries import SyncQueries

    sync = SyncQueries(
        SyncPsycopgDriver(psycopg.connect(dsn(os.environ["BENCH_DB"]), autocommit=True))
    )

    async def enqueue(*args: Any) -> Any:
        return sync.enqueue(*args)

    return enqueue


async def bulk(enqueue: Enqueue, count: int) -> str:
    await enqueue(["noop"] * count, [None] * count, [0] * count)
    return "Queries.enqueue with lists (public API)"


async def cmd_prefill(a: argparse.Namespace) -> dict:
    enqueue = await connect()
    started = time.perf_counter()
    api = await bulk(enqueue, a.count)
    return {"count": a.count, "seconds": time.perf_counter() - started, "api": api}


async def cmd_enqueue_rate(a: argparse.Namespace) -> dict:
    enqueue = await connect()
    await enqueue("noop", None, 0)
    started = time.perf_counter()
    for _ in range(a.single):
        await enqueue("noop", None, 0)
    single = time.perf_counter() - started
    started = time.perf_counter()
    api = await bulk(enqueue, a.bulk)
    return {
        "single_per_s": a.single / single,
        "bulk_per_s": a.bulk / (time.perf_counter() - started),
        "bulk_api": api,
    }


async def cmd_feed(a: argparse.Namespace) -> dict:
    enqueue = await connect()
    await enqueue("noop", None, 0)
    for _ in range(a.count):
        await asyncio.sleep(random.uniform(a.gap * 0.5, a.gap * 1.5))
        await enqueue("stamp", repr(time.time()).encode(), 0)
    return {"sent": a.count}


async def cmd_submit_sleep(a: argparse.Namespace) -> dict:
    enqueue = await connect()
    await enqueue("sleep_stamp", f"{a.seconds} {a.tag}".encode(), 0)
    return {"submitted": a.tag}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("count", type=int)
    p = sub.add_parser("enqueue-rate")
    p.add_argument("--single", type=int, default=2000)
    p.add_argument("--bulk", type=int, default=10000)
    p = sub.add_parser("feed")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--gap", type=float, default=0.05)
    p = sub.add_parser("submit-sleep")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--tag", required=True)
    a = parser.parse_args()
    command = globals().get("cmd_" + a.cmd.replace("-", "_"))
    if command is None:
        raise SystemExit(f"PgQueuer has no {a.cmd!r} workload in this harness")
    out = asyncio.run(command(a))
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
