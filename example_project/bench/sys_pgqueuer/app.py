"""PgQueuer's worker for the benchmark: ``python sys_pgqueuer/app.py`` runs what ``pgq run
sys_pgqueuer.app:psycopg_worker`` (BENCH_SYSTEM=pgqueuer) or ``asyncpg_worker``
(BENCH_SYSTEM=pgqueuer-asyncpg) would, with PgQueuer's own defaults: batches of 10, acks
buffered in memory. (``pgq run`` itself fails in 1.6 with the typer it installs: its log
level arrives as a string.)

The entrypoints are the harness's tasks: ``noop``, ``stamp`` (latency: the payload is the
moment before enqueue) and ``sleep_stamp`` (recovery: payload "seconds tag").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import dsn, record, stamp_body, url  # noqa: E402
from pgqueuer import Job, PgQueuer  # noqa: E402


def _entrypoints(pgq: PgQueuer) -> PgQueuer:
    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        pass

    @pgq.entrypoint("stamp")
    async def stamp(job: Job) -> None:
        stamp_body(float(job.payload or b"0"))

    @pgq.entrypoint("sleep_stamp")
    async def sleep_stamp(job: Job) -> None:
        import time

        seconds, tag = (job.payload or b"0 ?").decode().split()
        record("attempt", tag, repr(time.time()), os.getpid())
        await asyncio.sleep(float(seconds))

    return pgq


@contextlib.asynccontextmanager
async def psycopg_worker() -> AsyncIterator[PgQueuer]:
    import psycopg
    from pgqueuer.db import PsycopgDriver

    conn = await psycopg.AsyncConnection.connect(dsn(os.environ["BENCH_DB"]), autocommit=True)
    async with conn:
        yield _entrypoints(PgQueuer(PsycopgDriver(conn)))


@contextlib.asynccontextmanager
async def asyncpg_worker() -> AsyncIterator[PgQueuer]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(url(os.environ["BENCH_DB"]))
    try:
        yield _entrypoints(PgQueuer(AsyncpgDriver(conn)))
    finally:
        await conn.close()


if __name__ == "__main__":
    import pgqueuer

    factory = asyncpg_worker if os.environ["BENCH_SYSTEM"].endswith("asyncpg") else psycopg_worker
    asyncio.run(pgqueuer.run(factory))
