"""A narrated walk through one job's life: claim, renew, a lost lease, a takeover, fencing."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand
from django.db.models.functions import Now

from django_leases.models import Job
from shop.tasks import send_receipt


class Command(BaseCommand):
    help = "Enqueue a job and walk it through claim, renew, expiry, takeover and a refused stale ack."

    def add_arguments(self, parser):
        parser.add_argument("--lease", type=float, default=2.0, help="Lease in seconds (default 2).")

    def say(self, step, text):
        self.stdout.write(f"{self.style.MIGRATE_HEADING(f'[{step}]')} {text}")

    def lease_left(self, job_id):
        job = Job.objects.annotate(now=Now()).get(pk=job_id)
        return (job.lease_expires_at - job.now).total_seconds()

    def handle(self, *args, lease, **options):
        result = send_receipt.enqueue(42)
        job_id = int(result.id)
        Job.objects.filter(pk=job_id).update(lease_seconds=lease)
        self.say("enqueue", f"send_receipt(42) is job {job_id}, status {result.status}")

        [first] = Job.objects.claim("worker-a", ["emails"])
        self.say("claim", f"worker-a claims it: token {str(first.claim_token)[:8]}..., "
                          f"fence {first.fence}, lease ends in {self.lease_left(job_id):.2f} s "
                          "(database clock)")
        held = Job.objects.renew([first])
        self.say("renew", f"worker-a's heartbeat renews: {len(held)} row touched, so it still "
                          f"owns the job; lease ends in {self.lease_left(job_id):.2f} s")

        self.say("crash", "worker-a stops renewing (frozen, partitioned or killed)")
        started = time.monotonic()
        while not Job.objects.claimable().filter(pk=job_id).exists():
            self.stdout.write(f"        ... lease ends in {max(self.lease_left(job_id), 0):.1f} s", ending="\r")
            time.sleep(0.2)
        self.stdout.write("")
        self.say("expire", f"the lease ran out after {time.monotonic() - started:.1f} s; "
                           "the job is claimable again")

        [second] = Job.objects.claim("worker-b", ["emails"])
        self.say("reclaim", f"worker-b takes it over: new token {str(second.claim_token)[:8]}..., "
                            f"fence {second.fence}, attempt {second.attempts}")

        renewed = Job.objects.renew([first])
        acked = Job.objects.ack(first, "sent twice?")
        self.say("stale", f"worker-a wakes up: its renewal touches {len(renewed)} rows and its ack "
                          f"is {'applied' if acked else 'refused'}; it must stop")

        acked = Job.objects.ack(second, "receipt for order 42 sent")
        result.refresh()
        self.say("ack", f"worker-b acknowledges: {'applied' if acked else 'refused'}; status "
                        f"{result.status}, return value {result.return_value!r}, "
                        f"workers {result.worker_ids}")
        failure = Job.objects.get(pk=job_id).failures.get()
        self.say("history", f"attempt {failure.attempt} recorded as {failure.kind}: {failure.message}")
