"""The test project's app. A project's exit hook (an error tracker's flush) is registered
when LEASES_ATEXIT_MARK names a file: a worker that ends at once must still run it
(tests/test_worker_stopping.py)."""

import atexit
import multiprocessing
import os
from pathlib import Path

# In the worker's own process only: a spawned handler child imports this app too.
if os.environ.get("LEASES_ATEXIT_MARK") and multiprocessing.parent_process() is None:
    atexit.register(Path(os.environ["LEASES_ATEXIT_MARK"]).write_text, "ran")
