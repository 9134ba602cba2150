"""Never imported by a worker or a reader: a failure row naming this module must not run it.

Importing it leaves a mark where LEASES_TRAP points, then exits the process.
"""

import os
from pathlib import Path

if os.environ.get("LEASES_TRAP"):
    Path(os.environ["LEASES_TRAP"]).write_text("imported")
raise SystemExit("a failure row's class path was imported")
