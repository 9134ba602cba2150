"""One manager verb run from a process whose clock may be skewed (libfaketime preloaded).

    python -m tests.skewed ACTION JOB_ID_OR_ARG

Prints JSON: what the verb answered, this process's time.time(), and the database's now.
"""

from __future__ import annotations

import json
import sys
import time

import django


def main() -> None:
    django.setup()
    from django.db.models.functions import Now

    from django_leases.models import Job

    action, arg = sys.argv[1], sys.argv[2]
    answer: object
    if action == "claim":
        answer = [j.pk for j in Job.objects.claim("skewed", limit=10, lease=float(arg))]
    elif action == "renew":
        job = Job.objects.get(pk=int(arg))
        answer = sorted(Job.objects.renew([job]))
    elif action == "enqueue":
        answer = Job.objects.enqueue("tests.testapp.tasks.add", [1, 1], delay=float(arg)).pk
    else:
        raise SystemExit(f"unknown action {action!r}")
    db_now = Job.objects.annotate(now=Now()).values_list("now", flat=True).first()
    print(
        json.dumps(
            {"answer": answer, "local": time.time(), "db": db_now.timestamp() if db_now else None}
        )
    )


if __name__ == "__main__":
    main()
