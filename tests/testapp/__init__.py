"""The test project's app. A project's exit hook (an error tracker's flush) is registered
when LEASES_ATEXIT_MARK names a file: a worker that ends at once must still run it, on
the main thread as at any exit; one that hangs (an error tracker whose server does not
answer) when LEASES_ATEXIT_HANG is set: the worker must end all the same
(tests/test_worker_stopping.py)."""

import atexit
import multiprocessing
import os
import signal
import time
from pathlib import Path


def _exit_hook(mark: str) -> None:
    # What a hook may do on the main thread only (ValueError on another).
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    Path(mark).write_text("ran")


# In the worker's own process only: a spawned handler child imports this app too.
if os.environ.get("LEASES_ATEXIT_MARK") and multiprocessing.parent_process() is None:
    atexit.register(_exit_hook, os.environ["LEASES_ATEXIT_MARK"])

if os.environ.get("LEASES_ATEXIT_HANG") and multiprocessing.parent_process() is None:
    atexit.register(time.sleep, 120)
