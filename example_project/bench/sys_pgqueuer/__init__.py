"""PgQueuer under the benchmark: a plain asyncio queue, not Django (see app.py)."""
