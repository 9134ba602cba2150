"""Stopping run_lease_worker with real signals: what happens to the jobs still running.

Invariants (design.md): (3) nothing is lost, (4) duplicates only after expiry: a released
job may run elsewhere at once, so its handler must be stopped (or the process gone) first.
"""

from __future__ import annotations

import os
import signal

import pytest

from django_leases.models import Job, JobFailure, WorkerProcess
from django_leases.states import JobState
from tests.testapp.models import Effect
from tests.testapp.tasks import add, astubborn, mortal, record, returns_when_told, stubborn
from tests.worker_helpers import FAST, job_of, process_ended, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def phases(key: str) -> list[str]:
    return list(Effect.objects.filter(key=key).order_by("id").values_list("phase", flat=True))


def test_sigterm_to_the_whole_process_group_finishes_or_releases_process_isolated_jobs(workers):
    """systemd's default KillMode=control-group sends SIGTERM to every process of the unit,
    handler children included. The children ignore it: the job that finishes within
    --grace is acknowledged with one attempt, the one that would not is released (pending,
    attempt not counted). A child whose handler re-enabled SIGTERM dies of it; its job is
    released too, not failed (3)."""
    short = record.enqueue("group-short", first_seconds=10)
    long = record.enqueue("group-long", first_seconds=60)
    dies = mortal.enqueue("group-mortal", 60)
    a = workers.start(
        "group-a",
        "--isolation",
        "process",
        "--concurrency",
        "3",
        "--grace",
        "20",
        *FAST,
        own_group=True,
    )
    wait_for(
        lambda: all(phases(k) for k in ("group-short", "group-long", "group-mortal")),
        60,
        "the three handler processes to start",
    )
    a.signal_group(signal.SIGTERM)
    assert a.wait_exit(60) == 0
    log = a.log()
    done = job_of(short)
    assert (done.state, done.attempts, done.fence) == (JobState.SUCCEEDED, 1, 1), log[-3000:]
    assert done.result == {"fence": 1, "worker": "group-a"}
    # It was still running when the signal came, and finished in the grace period.
    stopping, acked = a.order(("stopping", {"signal": "SIGTERM"}), ("acked", {"job_id": done.pk}))
    assert 0 <= stopping < acked, log[-3000:]
    for result in (long, dies):
        job = job_of(result)
        assert (job.state, job.attempts, job.fence, job.claim_token) == (
            JobState.PENDING,
            0,
            1,
            None,
        ), log[-3000:]
        assert a.events("released", job_id=job.pk, fence=1, worker="group-a"), log[-3000:]
    assert not JobFailure.objects.exists(), list(
        JobFailure.objects.values_list("message", flat=True)
    )
    assert phases("group-short") == ["start", "done"]
    assert phases("group-long") == ["start"] and phases("group-mortal") == ["start"]


@pytest.mark.parametrize("nohup", [False, True], ids=["hangup", "nohup"])
def test_sighup_stops_and_releases_as_sigterm_does_unless_started_under_nohup(workers, nohup):
    """A closed terminal (SIGHUP) stops the worker as SIGTERM does: the process-isolated
    job is released at once, not left claimed until its lease runs out (3); before,
    SIGHUP killed the worker outright. Under nohup, which ignores SIGHUP, the worker
    ignores it too and runs on."""
    long = record.enqueue("hup-long", first_seconds=60)
    a = workers.start(
        "hup-a",
        "--isolation",
        "process",
        "--grace",
        "1",
        *FAST,
        prefix=("nohup",) if nohup else (),
    )
    wait_for(lambda: phases("hup-long"), 30, "the handler to start")
    a.signal(signal.SIGHUP)
    if nohup:
        renewed = len(a.events("renewed"))
        wait_for(lambda: len(a.events("renewed")) >= renewed + 2, 10, "two more renewals")
        assert a.proc.poll() is None and not a.events("stopping"), a.log()[-3000:]
        assert job_of(long).state == JobState.CLAIMED
        a.signal(signal.SIGTERM)
    assert a.wait_exit(30) == 0, a.log()[-3000:]
    if not nohup:
        assert a.events("stopping", signal="SIGHUP"), a.log()[-3000:]
    job = job_of(long)
    assert (job.state, job.attempts, job.claim_token) == (JobState.PENDING, 0, None)
    assert a.events("released", job_id=job.pk, fence=1, worker="hup-a"), a.log()[-3000:]


def test_sighup_is_taken_only_where_nothing_else_handles_it():
    """The worker takes SIGHUP only from the default disposition: nohup's SIG_IGN and the
    handler of a program that runs a Worker itself (reopening its logs, say) stay as they
    were, while SIGTERM and SIGINT are taken and given back afterwards."""
    from django_leases.worker.shutdown import StopRequest
    from django_leases.worker.waker import Waker

    def programs_own(signum, frame):
        pass

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)}
    waker = Waker()
    try:
        for disposition, taken in (
            (signal.SIG_DFL, True),
            (signal.SIG_IGN, False),
            (programs_own, False),
        ):
            signal.signal(signal.SIGHUP, disposition)
            stop = StopRequest(waker)
            stop.install()
            try:
                assert (signal.getsignal(signal.SIGHUP) == stop._handle) is taken, disposition
                assert signal.getsignal(signal.SIGTERM) == stop._handle
            finally:
                stop.restore()
            assert signal.getsignal(signal.SIGHUP) == disposition
            assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        waker.close()


@pytest.mark.parametrize("deaf_task", [stubborn, astubborn], ids=["sync", "async"])
def test_thread_isolation_releases_last_after_telling_handlers_and_marking_the_worker_stopped(
    workers, deaf_task
):
    """At the end of --grace, thread-isolated handlers are told to stop as on a lost claim,
    the worker row is marked stopped, and only then are the jobs released, right before the
    process exits: a handler that ignores the notice runs on after its release only until
    the exit (4), an async one blocking its event loop too (before, the process waited
    for its loop's thread, asgiref's, and ran the released job on). Both jobs are back to
    pending with the attempt not counted (3)."""
    coop = record.enqueue("order-coop", first_seconds=60)
    deaf = deaf_task.enqueue("order-deaf", seconds=30)
    a = workers.start("order-a", "--concurrency", "2", "--grace", "1", *FAST)
    wait_for(lambda: phases("order-coop") and phases("order-deaf"), 20, "both handlers")
    a.signal(signal.SIGTERM)
    # Long before the deaf handler's 30 s are up.
    assert a.wait_exit(15) == 0
    log = a.log()
    stopped_at = WorkerProcess.objects.get(worker_id="order-a").stopped_at
    for result in (coop, deaf):
        job = job_of(result)
        assert (job.state, job.attempts, job.fence, job.claim_token) == (
            JobState.PENDING,
            0,
            1,
            None,
        ), log[-3000:]
        # Database clock: the worker row was marked stopped before the job was released.
        assert stopped_at <= job.available_at, (stopped_at, job.available_at)
    # The cooperative handler stopped when told, before its job was released; the deaf one
    # was still running and was released anyway.
    told, coop_released, deaf_released, stopped = a.order(
        ("handler_stopped", {"job_id": coop.id, "fence": 1, "worker": "order-a"}),
        ("released", {"job_id": coop.id, "fence": 1}),
        ("released", {"job_id": deaf.id, "fence": 1}),
        ("stopped", {"worker": "order-a"}),
    )
    assert 0 <= told < coop_released, log[-3000:]
    assert 0 <= deaf_released < stopped, log[-3000:]
    [running] = a.events("handlers_running", worker="order-a")
    assert running["jobs"] == [int(deaf.id)]
    # The deaf handler ended with the process: wait_exit(15) above, long before its 30 s.
    assert not JobFailure.objects.exists()


def test_a_handler_that_returns_when_told_to_stop_is_acknowledged_not_run_again(workers):
    """(3, 4) A thread-isolated handler told to stop at the end of --grace that returns a
    result (it finished its batch) before the release is sent has its job acknowledged
    under its claim (the ack's rowcount decides, as any ack's), not released to run again
    (before: its result was discarded and the job went back to pending, attempts 0)."""
    result = returns_when_told.enqueue("told-ok")
    other = record.enqueue("told-coop", first_seconds=60)
    a = workers.start("told-a", "--concurrency", "2", "--grace", "0", *FAST)
    wait_for(lambda: phases("told-ok") and phases("told-coop"), 20, "both handlers")
    a.signal(signal.SIGTERM)
    assert a.wait_exit(15) == 0
    log = a.log()
    job = job_of(result)
    assert (job.state, job.result, job.claim_token) == (JobState.SUCCEEDED, {"told": True}, None), (
        log[-4000:]
    )
    assert phases("told-ok") == ["start", "done"], log[-3000:]
    assert not a.events("released", job_id=result.id), log[-3000:]
    # The cooperative one raised LeaseLost when told, and was released as before.
    assert (job_of(other).state, job_of(other).attempts) == (JobState.PENDING, 0)
    assert a.events("released", job_id=other.id), log[-3000:]


def test_a_handler_whose_claim_was_lost_before_the_stop_ends_with_the_process(workers, tmp_path):
    """(4) An async handler deaf to cancellation (it blocks its own event loop) whose job
    an operator cancelled runs on, its claim lost, when SIGTERM comes: the worker waits
    out its grace and ends, the handler with it, as for one told to stop at the end of
    the grace. Before, Python waited at exit for the handler's event-loop thread
    (asgiref's), 30 s here. The project's exit hooks still run (an error tracker's
    flush; before: skipped by the immediate exit)."""
    mark = tmp_path / "atexit"
    deaf = astubborn.enqueue("lost-deaf", seconds=30)
    a = workers.start("lost-a", "--grace", "1", *FAST, env_extra={"LEASES_ATEXIT_MARK": str(mark)})
    wait_for(lambda: phases("lost-deaf"), 20, "the handler to start")
    assert Job.objects.filter(pk=int(deaf.id)).cancel() == 1
    wait_for(lambda: a.events("lost", worker="lost-a"), 20, "the claim to be seen lost")
    a.signal(signal.SIGTERM)
    assert a.wait_exit(15) == 0  # long before the handler's 30 s are up
    assert job_of(deaf).state == JobState.CANCELLED
    assert mark.read_text() == "ran", a.log()[-2000:]


# How an ack sets the result column: quoted as the database quotes names (the ORM's ack),
# or in the PostgreSQL statement that acks and claims at once.
RESULT_SET = (
    "`result` =" if os.environ.get("DATABASE_URL", "").startswith("mysql") else '"result" ='
) + "|result = v.result"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_job_that_stops_every_worker_running_it_ends_dead_not_released_forever(
    workers, isolation
):
    """A handler that sends its own worker SIGTERM (or whose memory gets its pod evicted)
    was released at that stop, its attempt not counted, and so at the next worker's stop,
    forever: it never ended, and every worker that took it stopped (3). Past
    UNCOUNTED_RELEASES releases with no checkpoint between, the stop fails the attempt
    (ReleasedTooOften), and out of attempts the job ends dead. The job beside it, released
    at the same stop, is released as before, its attempt not counted."""
    from django_leases import conf
    from tests.testapp.tasks import hold, stop_own_worker

    key = f"poison-{isolation}"
    beside = hold.enqueue(30)
    poison = stop_own_worker.enqueue(key)
    Job.objects.filter(pk=poison.id).update(releases=conf.UNCOUNTED_RELEASES, max_attempts=1)
    w = workers.start(
        f"poisoned-{isolation}",
        *FAST,
        "--grace",
        "1",
        "--concurrency",
        "2",
        "--isolation",
        isolation,
    )
    assert w.wait_exit(60) == 0, w.log()[-3000:]
    job = job_of(poison)
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, "attempts", 1), w.log()[
        -3000:
    ]
    [failure] = JobFailure.objects.filter(job_id=poison.id)
    assert failure.exception_class_path == "django_leases.exceptions.ReleasedTooOften"
    assert f"{conf.UNCOUNTED_RELEASES} times" in failure.message
    [dead] = w.events("dead_lettered", job_id=int(poison.id))
    assert dead["error"] == "django_leases.exceptions.ReleasedTooOften"
    other = job_of(beside)
    assert (other.state, other.attempts, other.releases) == (JobState.PENDING, 0, 1)
    assert not JobFailure.objects.filter(job_id=beside.id).exists()
    assert w.events("released", job_id=int(beside.id)), w.log()[-3000:]


def test_a_handler_process_killed_by_each_stop_also_ends_dead_past_the_releases(workers):
    """The other way a stop gives a job back: its handler process died of the stop's
    signal (the whole process group's SIGTERM, as systemd sends it). It goes through the
    same bound (3): past UNCOUNTED_RELEASES the stop fails the attempt (ReleasedTooOften),
    and out of attempts the job ends dead, not released to kill the next worker's child."""
    from django_leases import conf

    dies = mortal.enqueue("group-poison", 60)
    Job.objects.filter(pk=dies.id).update(releases=conf.UNCOUNTED_RELEASES, max_attempts=1)
    w = workers.start(
        "group-poison", "--isolation", "process", "--grace", "20", *FAST, own_group=True
    )
    wait_for(lambda: phases("group-poison"), 60, "the handler process to start")
    w.signal_group(signal.SIGTERM)
    assert w.wait_exit(60) == 0, w.log()[-3000:]
    job = job_of(dies)
    assert (job.state, job.dead_reason, job.attempts) == (JobState.DEAD, "attempts", 1), w.log()[
        -3000:
    ]
    [failure] = JobFailure.objects.filter(job_id=dies.id)
    assert failure.exception_class_path == "django_leases.exceptions.ReleasedTooOften"
    assert "its handler process died while the worker was stopping" in failure.message
    assert w.events("dead_lettered", job_id=int(dies.id)), w.log()[-3000:]
    assert not w.events("released", job_id=int(dies.id)), w.log()[-3000:]


@pytest.mark.parametrize("moved", [True, False])
def test_a_checkpoint_that_moves_the_cursor_starts_the_count_of_releases_again(workers, moved):
    """A handler that checkpoints its progress, then has its worker stop, is released as
    ever however often it happens: the count starts again at each checkpoint that moves the
    cursor. One that saves the cursor it was given (a keepalive, no progress) does not
    start it again: past the limit the stop fails its attempt (ReleasedTooOften)."""
    from django_leases import conf
    from tests.testapp.tasks import stop_own_worker

    result = stop_own_worker.enqueue(f"checkpointed-{moved}", [2] if moved else [1])
    Job.objects.filter(pk=result.id).update(
        releases=conf.UNCOUNTED_RELEASES, max_attempts=1, cursor=[1]
    )
    w = workers.start(f"checkpointed-{moved}", *FAST, "--grace", "1")
    assert w.wait_exit(60) == 0, w.log()[-3000:]
    job = job_of(result)
    if moved:
        assert (job.state, job.attempts, job.releases, job.cursor) == (
            JobState.PENDING,
            0,
            1,
            [2],
        ), w.log()[-3000:]
        assert not JobFailure.objects.filter(job_id=result.id).exists()
    else:
        assert (job.state, job.attempts, job.releases) == (
            JobState.DEAD,
            1,
            conf.UNCOUNTED_RELEASES,
        ), w.log()[-3000:]
        [failure] = JobFailure.objects.filter(job_id=result.id)
        assert failure.exception_class_path == "django_leases.exceptions.ReleasedTooOften"


def test_an_outcome_the_database_never_took_is_not_released_at_a_stop(workers):
    """Invariants 3 and 4: the handler succeeded but its ack met a database outage; a stop
    before the database answers must not release the job to run again before its lease
    ends: the worker keeps trying the ack, then leaves the claim to expire, and exits 1 for
    the process manager to see a job left claimed."""
    result = add.enqueue(2, 3)
    a = workers.start(
        "unsent-a",
        "--grace",
        "0",
        *FAST,
        # Every ack from the worker's main thread meets a dropped connection (the ack sets the
        # result column, quoted as the database quotes names).
        env_extra={"LEASES_WORKER_FAULT": f"MainThread:InterfaceError:100000:{RESULT_SET}"},
    )
    a.wait_event("db_trouble", timeout=20, worker="unsent-a")
    a.signal(signal.SIGTERM)
    assert a.wait_exit(60) == 1
    log = a.log()
    job = job_of(result)
    assert (job.state, job.attempts, job.claimed_by) == (JobState.CLAIMED, 1, "unsent-a"), log[
        -3000:
    ]
    assert not a.events("released"), log[-3000:]
    [unsent] = a.events("outcome_unsent", job_id=int(result.id))
    assert unsent["worker"] == "unsent-a"


def test_a_handler_waking_the_loop_after_it_closed_writes_into_no_file_opened_since(tmp_path):
    """A handler's thread may finish, and wake the main loop, after run() closed the
    loop's pipe (while the process ends: the project's exit hooks run then). Its byte must
    not land in whatever file or socket took the pipe's descriptor numbers since (before:
    both were closed, and the next files opened got them), nor may a second close() close
    one of them; the loop cannot wait on a closed pipe."""
    from django_leases.worker.waker import Waker

    waker = Waker()
    waker.close()
    with pytest.raises(RuntimeError):
        waker.wait(0)
    paths = [tmp_path / "log-a", tmp_path / "log-b"]
    files = [p.open("wb", buffering=0) for p in paths]
    try:
        waker.wake()
        waker.close()  # twice: the second closes nothing of anyone else's
        files[0].write(b"x")
    finally:
        for f in files:
            f.close()
    assert [p.read_bytes() for p in paths] == [b"x", b""]


def test_a_worker_ending_at_once_after_an_error_ends_as_python_would(capsys):
    """When run() raises with handlers still running, run_lease_worker ends at once with
    the status, and the output, Python's own exit would have given the error."""
    from django_leases.worker.shutdown import exit_status as _exit_status

    assert [_exit_status(SystemExit(code)) for code in (None, 0, 3)] == [0, 0, 3]
    assert _exit_status(SystemExit("no database")) == 1
    assert capsys.readouterr().err == "no database\n"
    assert _exit_status(KeyboardInterrupt()) == 130
    assert capsys.readouterr().err.strip().endswith("KeyboardInterrupt")
    try:
        raise RuntimeError("the loop broke")
    except RuntimeError as e:
        assert _exit_status(e) == 1
    printed = capsys.readouterr().err
    assert printed.startswith("Traceback") and "RuntimeError: the loop broke" in printed


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_worker_whose_loop_raises_with_a_handler_running_ends_at_once(
    workers, tmp_path, isolation
):
    """(3, 4) The main loop raises (SystemExit from a statement, past any except
    Exception) while a handler deaf to stopping runs: the worker ends at once with
    Python's status and message, its handler child killed by the executor that started
    it (were it left, it would notice its worker gone and end itself a second later,
    logging `orphaned`), and the project's exit hooks run on the main thread as at any
    exit (before: on another, where signal.signal() raises). The job stays claimed until
    its lease runs out."""
    key = f"raise-{isolation}"
    mark, armed = tmp_path / "atexit", tmp_path / "armed"
    result = stubborn.enqueue(key, seconds=60)
    a = workers.start(
        key,
        "--isolation",
        isolation,
        *FAST,
        env_extra={
            "LEASES_ATEXIT_MARK": str(mark),
            "LEASES_WORKER_FAULT": "MainThread:SystemExit:1:django_leases_job",
            "LEASES_WORKER_FAULT_FROM": str(armed),
        },
    )
    wait_for(lambda: phases(key), 20, "the handler to start")
    children = [e["pid"] for e in a.events("process_started", job_id=int(result.id))]
    assert len(children) == (isolation == "process"), a.log()[-3000:]
    armed.touch()
    assert a.wait_exit(15) == 1, a.log()[-3000:]  # long before the handler's 60 s
    log = a.log()
    assert "injected by tests/worker_faults.py" in log, log[-3000:]
    assert mark.read_text() == "ran", log[-3000:]
    wait_for(
        lambda: all(process_ended(child) for child in children), 10, "the handler child to end"
    )
    assert not a.events("orphaned"), log[-3000:]
    job = job_of(result)
    assert (job.state, job.claimed_by, phases(key)) == (JobState.CLAIMED, key, ["start"])


def test_an_exit_hook_that_hangs_does_not_keep_a_failed_worker_alive(workers, tmp_path):
    """(3) The main loop raises with a handler deaf to stopping running, and one of the
    project's exit hooks hangs (an error tracker whose server does not answer): the
    process still ends, within a few seconds rather than the hook's 120, with the
    status of the failure."""
    armed = tmp_path / "armed"
    stubborn.enqueue("hang-hook", seconds=60)
    a = workers.start(
        "hang-hook",
        *FAST,
        env_extra={
            "LEASES_ATEXIT_HANG": "1",
            "LEASES_WORKER_FAULT": "MainThread:SystemExit:1:django_leases_job",
            "LEASES_WORKER_FAULT_FROM": str(armed),
        },
    )
    wait_for(lambda: phases("hang-hook"), 20, "the handler to start")
    armed.touch()
    assert a.wait_exit(30) == 1, a.log()[-3000:]
