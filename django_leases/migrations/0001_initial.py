"""The schema of django-leases 0.1.0: jobs, their failed attempts and recorded effects, and
the worker processes.

Index and constraint names are part of the schema (docs/releases.md): the claim's plans and
the tests name them. What only one database can build is in 0002.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="WorkerProcess",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "worker_id",
                    models.CharField(max_length=200, unique=True, verbose_name="worker id"),
                ),
                ("hostname", models.CharField(max_length=255, verbose_name="host")),
                ("pid", models.PositiveIntegerField(verbose_name="pid")),
                ("queues", models.JSONField(default=list, verbose_name="queues")),
                (
                    "started_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="started at",
                    ),
                ),
                (
                    "last_seen_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="last seen",
                    ),
                ),
                (
                    "stopped_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="stopped at"),
                ),
            ],
            options={
                "verbose_name": "worker process",
                "verbose_name_plural": "worker processes",
            },
        ),
        migrations.CreateModel(
            name="Job",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "queue_name",
                    models.CharField(default="default", max_length=100, verbose_name="queue"),
                ),
                ("task_path", models.CharField(max_length=255, verbose_name="task")),
                ("args", models.JSONField(blank=True, default=list, verbose_name="args")),
                ("kwargs", models.JSONField(blank=True, default=dict, verbose_name="kwargs")),
                ("priority", models.SmallIntegerField(default=0, verbose_name="priority")),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "Pending"),
                            ("claimed", "Claimed"),
                            ("succeeded", "Succeeded"),
                            ("dead", "Dead"),
                            ("cancelled", "Cancelled"),
                        ],
                        default="pending",
                        max_length=10,
                        verbose_name="state",
                    ),
                ),
                (
                    "available_at",
                    models.DateTimeField(
                        blank=True,
                        db_default=django.db.models.functions.datetime.Now(),
                        null=True,
                        verbose_name="available at",
                    ),
                ),
                (
                    "run_after",
                    models.DateTimeField(blank=True, null=True, verbose_name="run after"),
                ),
                ("lease_seconds", models.FloatField(default=30.0, verbose_name="lease (s)")),
                (
                    "lease_expires_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="lease expires at"),
                ),
                (
                    "claim_token",
                    models.UUIDField(blank=True, null=True, verbose_name="claim token"),
                ),
                ("fence", models.BigIntegerField(default=0, verbose_name="fence")),
                ("attempts", models.PositiveIntegerField(default=0, verbose_name="attempts")),
                (
                    "max_attempts",
                    models.PositiveIntegerField(default=5, verbose_name="max attempts"),
                ),
                ("leases_lost", models.PositiveIntegerField(default=0, verbose_name="leases lost")),
                (
                    "claimed_by",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="claimed by"
                    ),
                ),
                (
                    "heartbeat_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="last heartbeat"),
                ),
                ("deadline", models.DateTimeField(blank=True, null=True, verbose_name="deadline")),
                ("retry", models.JSONField(blank=True, null=True, verbose_name="retry ladder")),
                (
                    "on_lease_lost",
                    models.CharField(
                        choices=[
                            ("retry", "Retry"),
                            ("dead", "Dead-letter"),
                            ("park", "Park for a person"),
                        ],
                        default="retry",
                        max_length=10,
                        verbose_name="when a lease is lost",
                    ),
                ),
                (
                    "dead_reason",
                    models.CharField(
                        blank=True,
                        choices=[
                            ("attempts", "Out of attempts"),
                            ("deadline", "Past its deadline"),
                            ("non_retryable", "Non-retryable error"),
                            ("lease_lost", "Lease lost (not idempotent)"),
                            ("unrunnable", "Unrunnable"),
                        ],
                        default="",
                        max_length=20,
                        verbose_name="dead because",
                    ),
                ),
                (
                    "unique_key",
                    models.CharField(
                        blank=True, max_length=200, null=True, verbose_name="unique key"
                    ),
                ),
                (
                    "active_key",
                    models.GeneratedField(
                        db_persist=True,
                        expression=models.Case(
                            models.When(
                                state__in=["pending", "claimed"], then=models.F("unique_key")
                            )
                        ),
                        output_field=models.CharField(max_length=200, null=True),
                        unique=True,
                    ),
                ),
                (
                    "cursor",
                    models.JSONField(blank=True, null=True, verbose_name="checkpoint cursor"),
                ),
                ("result", models.JSONField(blank=True, null=True, verbose_name="result")),
                (
                    "enqueued_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="enqueued at",
                    ),
                ),
                (
                    "started_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="first claimed at"),
                ),
                (
                    "last_attempted_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="last claimed at"),
                ),
                (
                    "finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
                ),
            ],
            options={
                "verbose_name": "job",
                "verbose_name_plural": "jobs",
                "indexes": [
                    models.Index(
                        condition=models.Q(("state", "pending")),
                        fields=["-priority", "available_at", "id"],
                        name="leases_job_due_idx",
                    ),
                    models.Index(
                        condition=models.Q(("state", "claimed")),
                        fields=["lease_expires_at"],
                        name="leases_job_claimed_idx",
                    ),
                    models.Index(
                        condition=models.Q(("claim_token__isnull", False)),
                        fields=["claim_token"],
                        name="leases_job_token_idx",
                    ),
                    models.Index(fields=["state", "finished_at"], name="leases_job_finished_idx"),
                    models.Index(
                        fields=["queue_name", "task_path", "state"], name="leases_job_census_idx"
                    ),
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("state", "claimed"), _negated=True),
                            models.Q(
                                ("lease_expires_at__isnull", False), ("claim_token__isnull", False)
                            ),
                            _connector="OR",
                        ),
                        name="leases_job_claimed_has_lease",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("priority__gte", -100), ("priority__lte", 100)),
                        name="leases_job_priority_range",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("lease_seconds__gte", 1.0), ("lease_seconds__lte", 43200)
                        ),
                        name="leases_job_lease_range",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="JobFailure",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("attempt", models.PositiveIntegerField(verbose_name="attempt")),
                ("fence", models.BigIntegerField(verbose_name="fence")),
                (
                    "worker_id",
                    models.CharField(blank=True, default="", max_length=200, verbose_name="worker"),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("exception", "Exception"),
                            ("lease_expired", "Lease expired"),
                            ("unrunnable", "Unrunnable"),
                        ],
                        max_length=20,
                        verbose_name="kind",
                    ),
                ),
                (
                    "exception_class_path",
                    models.CharField(
                        blank=True, default="", max_length=255, verbose_name="exception"
                    ),
                ),
                ("message", models.TextField(blank=True, default="", verbose_name="message")),
                ("traceback", models.TextField(blank=True, default="", verbose_name="traceback")),
                (
                    "recorded_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="recorded at",
                    ),
                ),
                (
                    "job",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="failures",
                        to="django_leases.job",
                    ),
                ),
            ],
            options={
                "verbose_name": "job failure",
                "verbose_name_plural": "job failures",
                "ordering": ["job", "attempt", "id"],
            },
        ),
        migrations.CreateModel(
            name="JobEffect",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=200, verbose_name="effect")),
                ("fence", models.BigIntegerField(verbose_name="fence")),
                (
                    "recorded_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="recorded at",
                    ),
                ),
                (
                    "job",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="effects",
                        to="django_leases.job",
                    ),
                ),
            ],
            options={
                "verbose_name": "job effect",
                "verbose_name_plural": "job effects",
                "constraints": [
                    models.UniqueConstraint(fields=("job", "key"), name="leases_effect_once")
                ],
            },
        ),
    ]
