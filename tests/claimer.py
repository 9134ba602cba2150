"""A claiming process for the concurrency tests: claims, records, acknowledges.

    python -m tests.claimer WORKER_ID LIMIT LEASE IDLE_ROUNDS

Prints one JSON line per claim: job id, token, fence, and whether its ack was applied.
"""

from __future__ import annotations

import json
import sys

import django


def main() -> None:
    django.setup()
    from django_leases.models import Job

    worker_id, limit, lease, idle_rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    idle = 0
    while idle < idle_rounds:
        claims = Job.objects.claim(worker_id, ["default"], limit=limit, lease=lease)
        if not claims:
            idle += 1
            continue
        idle = 0
        for job in claims:
            acked = Job.objects.ack(job, {"by": worker_id})
            print(json.dumps({"job": job.pk, "token": str(job.claim_token), "fence": job.fence,
                              "acked": acked, "worker": worker_id}), flush=True)


if __name__ == "__main__":
    main()
