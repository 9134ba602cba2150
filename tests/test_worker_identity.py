"""One live process per worker id (worker/identity.py, WorkerQuerySet.register()).

Two processes sharing an id would share one worker row: the first to stop marks it
stopped, and the other's healthy claims then read as a gone worker's, which the admin's
"Expire stalled claims now" ends: a second execution while the first still runs
(invariant 4). So a second process waits for the id, and a stale one never writes the row.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_leases.models import Job, WorkerProcess
from django_leases.states import JobState
from django_leases.worker.identity import silent_for
from tests.testapp.models import Effect
from tests.testapp.tasks import add, record
from tests.worker_helpers import BEAT, FAST, job_of, wait_for


def register(
    worker_id: str, instance: str, pid: int = 1, heartbeat: float = 10
) -> WorkerProcess | None:
    return WorkerProcess.objects.register(
        worker_id,
        instance=instance,
        hostname="h",
        pid=pid,
        queues=["*"],
        heartbeat_seconds=heartbeat,
    )


def silence(worker_id: str, seconds: float) -> None:
    WorkerProcess.objects.filter(worker_id=worker_id).update(
        last_seen_at=Now() - timedelta(seconds=seconds)
    )


@pytest.mark.django_db
def test_a_live_holder_keeps_its_id_and_its_row_from_a_second_process():
    """(4) The second process takes nothing, and its heartbeat and its stop touch none of
    the first's row: the first's claims never read as a gone worker's."""
    assert register("twin", "first", pid=1) is None
    holder = register("twin", "second", pid=2)
    assert holder is not None
    assert (holder.instance, holder.pid) == ("first", 1)
    assert 0 <= silent_for(holder) < 10
    assert WorkerProcess.objects.seen("twin", "second") == 0
    assert WorkerProcess.objects.stopped("twin", "second") == 0
    row = WorkerProcess.objects.get(worker_id="twin")
    assert (row.instance, row.pid, row.stopped_at) == ("first", 1, None)
    assert not WorkerProcess.objects.gone().exists()
    # Silent for less than two periods (20 s of 10 s beats): still live.
    silence("twin", 19)
    assert register("twin", "second", pid=2) is not None
    # Nor within a second past them: a beat's statement and a busy GIL delay it that much.
    silence("twin", 20.5)
    assert register("twin", "second", pid=2) is not None
    # Gone or not by the holder's own period, not the newcomer's: a holder beating every
    # 60 s is live for 120 s whatever the newcomer's heartbeat.
    assert register("slow", "first", heartbeat=60) is None
    silence("slow", 30)
    assert register("slow", "second", pid=2, heartbeat=1) is not None
    silence("slow", 122)
    assert register("slow", "second", pid=2, heartbeat=1) is None
    # The holder itself registering again (a retry whose first answer was lost) keeps it.
    assert register("twin", "first", pid=1) is None
    assert WorkerProcess.objects.seen("twin", "first") == 1


@pytest.mark.django_db
def test_an_id_is_taken_from_a_stopped_or_silent_holder_which_then_writes_nothing():
    """A restart after a clean stop takes its id at once; after a crash, once the dead
    holder has been silent for two heartbeat periods. The old holder, should it come
    back, finds its row gone to the new process (seen() touches nothing, 2)."""
    register("stopped", "old")
    assert WorkerProcess.objects.stopped("stopped", "old") == 1
    register("crashed", "old")
    silence("crashed", 22)
    for worker_id in ("stopped", "crashed"):
        assert register(worker_id, "new", pid=2) is None
        row = WorkerProcess.objects.get(worker_id=worker_id)
        assert (row.instance, row.pid, row.stopped_at) == ("new", 2, None)
        assert WorkerProcess.objects.seen(worker_id, "old") == 0
        assert WorkerProcess.objects.stopped(worker_id, "old") == 0
        assert WorkerProcess.objects.get(worker_id=worker_id).stopped_at is None


@pytest.mark.django_db
def test_a_row_a_worker_of_0_1_0_inserts_gets_the_databases_defaults():
    """Workers of 0.1.0 keep running during an upgrade, and insert rows naming neither
    new column: the database fills them (a Python-side default would leave them NULL and
    the insert refused, so a restarted old worker never started)."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(WorkerProcess._meta.db_table)} "
            "(worker_id, hostname, pid, queues) VALUES (%s, %s, %s, %s)",
            ["old-release", "h", 1, "[]"],
        )
    row = WorkerProcess.objects.get(worker_id="old-release")
    assert (row.instance, row.heartbeat_seconds) == ("", 10.0)
    holder = register("old-release", "new")
    assert holder is not None and holder.instance == ""  # live: not taken


def effects(key: str) -> list[str]:
    return list(Effect.objects.filter(key=key).values_list("phase", flat=True))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("end", ["SIGTERM", "SIGKILL"])
def test_a_worker_started_under_a_live_id_waits_for_it_and_then_serves(workers, end):
    """The second run_lease_worker under one --worker-id logs id_held and claims nothing
    while the first is alive; once the first stops (SIGTERM) or has been silent for two
    heartbeat periods (SIGKILL), it takes the id, logs id_taken and serves (3)."""
    first = workers.start("twin", *FAST, log_name="twin-first")
    second = workers.start("twin", *FAST, ready=False, log_name="twin-second")
    held = second.wait_event("id_held", timeout=60, worker="twin")
    assert held["pid"] == first.pid, held
    if end == "SIGTERM":
        # A stop while waiting ends the wait: exit 0, nothing claimed, the row untouched.
        third = workers.start("twin", *FAST, ready=False, log_name="twin-third")
        third.wait_event("id_held", timeout=60, worker="twin")
        third.signal(signal.SIGTERM)
        assert third.wait_exit(30) == 0, third.log()[-3000:]
        assert third.events("stopped", signal="SIGTERM"), third.log()[-3000:]
        assert not third.events("started") and not third.events("claimed")
        row = WorkerProcess.objects.get(worker_id="twin")
        assert (row.pid, row.stopped_at) == (first.pid, None)
    running = record.enqueue("twin-running", first_seconds=60)
    wait_for(lambda: effects("twin-running"), 20, "the first worker's handler to start")
    assert job_of(running).claimed_by == "twin"
    assert not second.events("started") and not second.events("claimed"), second.log()[-3000:]
    first.signal(getattr(signal, end))
    if end == "SIGTERM":
        assert first.wait_exit(30) == 0
    second.wait_event("id_taken", timeout=30, worker="twin")
    second.wait_event("started", timeout=30, worker="twin")
    row = WorkerProcess.objects.get(worker_id="twin")
    assert (row.pid, row.stopped_at) == (second.pid, None)
    done = add.enqueue(2, 3)
    wait_for(lambda: job_of(done).state == JobState.SUCCEEDED, 30, "the second worker's ack")
    # The line follows the commit that the state above shows.
    wait_for(lambda: second.events("acked", job_id=job_of(done).pk), 10, "the acked line")
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) == 0


@pytest.mark.django_db(transaction=True)
def test_a_restart_after_kill_9_on_the_same_machine_takes_the_id_at_once(workers):
    """A worker killed with SIGKILL and started again under its --worker-id (a supervisor's
    restart): its predecessor's process is gone from this machine's /proc, so the id is
    taken at once, not after two heartbeat periods and a second of silence (41 s with
    these 20 s heartbeats; 21 s at the defaults). The id stays one live process's (3)."""
    slow_beat = ["--lease", "60", "--heartbeat", "20", "--poll", "0.2"]
    first = workers.start("phoenix", *slow_beat, log_name="phoenix-first")
    assert WorkerProcess.objects.get(worker_id="phoenix").process_key.split(" ")[2] == str(
        first.pid
    )
    first.signal(signal.SIGKILL)
    first.wait_exit(30)
    killed_at = time.monotonic()
    second = workers.start("phoenix", *slow_beat, ready=False, log_name="phoenix-second")
    second.wait_event("started", timeout=60, worker="phoenix")
    assert time.monotonic() - killed_at < 20, second.log()[-3000:]
    assert second.events("id_taken") and not second.events("id_held"), second.log()[-3000:]
    row = WorkerProcess.objects.get(worker_id="phoenix")
    assert (row.pid, row.stopped_at) == (second.pid, None)
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) == 0


def test_a_holder_is_known_dead_only_in_this_boot_pid_namespace_and_user():
    """identity.died(): a holder of this boot, pid namespace and user whose process exited
    (or is a zombie, or whose pid now names a process started later) is dead. Not known
    dead, so its silence decides as before: a live process; the same pid in another pid
    namespace (a container started with the same hostname, pid 1) or another boot; another
    user's process (hidden under hidepid); a key its row kept from an earlier holder (a
    worker of the release before took the row over without writing one); no key."""
    import socket
    import subprocess
    from types import SimpleNamespace

    from django_leases.worker.identity import died, process_key

    mine = process_key()
    if not mine:
        pytest.skip("no /proc to read here")
    boot, namespace, pid, start, user = mine.split(" ")

    def holder(key: str, pid: int | str | None = None, host: str | None = None) -> Any:
        named = key.split(" ")[2] if pid is None else pid
        return SimpleNamespace(
            process_key=key, pid=int(named), hostname=host or socket.gethostname()
        )

    assert not died(holder(mine))
    assert died(holder(f"{boot} {namespace} {pid} {int(start) - 1} {user}"))  # pid reused
    exited = subprocess.Popen(["true"])
    exited.wait()
    gone = f"{boot} {namespace} {exited.pid} {start} {user}"
    assert died(holder(gone))
    zombie = subprocess.Popen(["true"])
    stat = Path(f"/proc/{zombie.pid}/stat")
    wait_for(lambda: stat.read_text().rpartition(") ")[2][0] == "Z", 10, "the child a zombie")
    assert died(holder(f"{boot} {namespace} {zombie.pid} {start} {user}"))
    zombie.wait()
    for elsewhere in (
        f"{boot} pid:[1] {exited.pid} 1 {user}",
        f"other-boot {namespace} {exited.pid} 1 {user}",
        f"{boot} {namespace} {exited.pid} 1 {int(user) + 1}",
    ):
        assert not died(holder(elsewhere))
    assert not died(holder(gone, pid=exited.pid + 1))  # the key of an earlier holder
    assert not died(holder(gone, host="another-host"))
    assert not died(holder("", pid=1)) and not died(holder("not a key", pid=1))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_id_was_taken_over_stops_and_leaves_the_row_to_the_new_holder(workers):
    """A worker that finds its row naming another process (taken over while it could not
    reach the database) logs id_replaced and stops as on SIGTERM: its running job is
    released (3), and its stop does not mark the new holder's row stopped."""
    job = record.enqueue("replaced-running", first_seconds=60)
    worker = workers.start("replaced", "--grace", "1", *FAST)
    wait_for(lambda: effects("replaced-running"), 20, "the handler to start")
    WorkerProcess.objects.filter(worker_id="replaced").update(
        instance="newcomer", hostname="web-9", pid=4242
    )
    replaced = worker.wait_event("id_replaced", timeout=10 * BEAT + 10, worker="replaced")
    assert (replaced["host"], replaced["pid"]) == ("web-9", 4242), replaced
    worker.wait_event("stopping", signal="worker id taken over")
    assert worker.wait_exit(30) == 0
    row = WorkerProcess.objects.get(worker_id="replaced")
    assert (row.instance, row.stopped_at) == ("newcomer", None)
    released = Job.objects.get(pk=job_of(job).pk)
    assert (released.state, released.attempts) == (JobState.PENDING, 0), worker.log()[-3000:]
