"""Never imported by a worker: a job row naming this module must not make it run.

If something imports it anyway, it leaves a mark where LEASES_TRAP points.
"""

import os
from pathlib import Path

if os.environ.get("LEASES_TRAP"):
    Path(os.environ["LEASES_TRAP"]).write_text("imported")


def explode() -> None:
    raise SystemExit("a row's dotted path was imported and called")
