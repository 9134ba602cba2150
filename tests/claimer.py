"""A claiming process for the concurrency tests.

python -m tests.claimer WORKER_ID LIMIT LEASE IDLE_ROUNDS
    claims, records, acknowledges until IDLE_ROUNDS claims in a row found nothing.
    Prints one JSON line per claim: job id, token, fence, and whether its ack was applied.

python -m tests.claimer --commands WORKER_ID LIMIT LEASE
    takes its orders from stdin, one per line, so that a test can start several of them
    on the same instant (takeover races). Prints {"ready": true} once connected, then for
    each order its JSON lines and {"done": true}:
      claim          claim until a claim finds nothing; one line per claim (no ack),
                     with the fence the row stores under the claim's token just after
      race SECONDS   claim for SECONDS, whatever each claim finds; lines as for claim
      ack            for every claim made so far (newest first): checkpoint, then ack,
                     each answering whether it touched the row
"""

from __future__ import annotations

import json
import sys
import time

import django


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def drain(worker_id: str, limit: int, lease: float, idle_rounds: int) -> None:
    from django_leases.models import Job

    idle = 0
    while idle < idle_rounds:
        claims = Job.objects.claim(worker_id, ["default"], limit=limit, lease=lease)
        if not claims:
            idle += 1
            continue
        idle = 0
        for job in claims:
            acked = Job.objects.ack(job, {"by": worker_id})
            emit(
                job=job.pk,
                token=str(job.claim_token),
                fence=job.fence,
                acked=acked,
                worker=worker_id,
            )


def commands(worker_id: str, limit: int, lease: float) -> None:
    from django_leases.models import Job

    held: list = []

    def claim_once() -> int:
        claims = Job.objects.claim(worker_id, ["default"], limit=limit, lease=lease)
        for job in claims:
            held.append(job)
            # The fence the row carries while it still carries this claim's token (None once
            # taken over): it must be the fence the claim handed out.
            stored = (
                Job.objects.filter(pk=job.pk, claim_token=job.claim_token)
                .values_list("fence", flat=True)
                .first()
            )
            emit(
                job=job.pk,
                token=str(job.claim_token),
                fence=job.fence,
                stored_fence=stored,
                worker=worker_id,
            )
        return len(claims)

    Job.objects.exists()  # connected before the first order, so that orders start together
    emit(ready=True)
    for line in sys.stdin:
        order = line.split()
        if not order:
            continue
        if order[0] == "claim":
            if len(order) > 1:  # the instant every racer starts at (time.time(), one host)
                time.sleep(max(0.0, float(order[1]) - time.time()))
            while claim_once():
                pass
        elif order[0] == "race":
            until = time.monotonic() + float(order[1])
            while time.monotonic() < until:
                claim_once()
        elif order[0] == "ack":
            for job in reversed(held):
                cursor = {"fence": job.fence, "worker": worker_id}
                checkpointed = Job.objects.checkpoint(job, cursor)
                acked = Job.objects.ack(job, {"fence": job.fence, "worker": worker_id})
                emit(
                    job=job.pk,
                    token=str(job.claim_token),
                    fence=job.fence,
                    worker=worker_id,
                    checkpointed=checkpointed,
                    acked=acked,
                )
        else:
            raise SystemExit(f"unknown order {line!r}")
        emit(done=True)


def main() -> None:
    django.setup()
    args = sys.argv[1:]
    if args[0] == "--commands":
        commands(args[1], int(args[2]), float(args[3]))
    else:
        drain(args[0], int(args[1]), float(args[2]), int(args[3]))


if __name__ == "__main__":
    main()
