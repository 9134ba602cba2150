"""Exceptions raised by django_leases."""

from __future__ import annotations

from django.tasks.exceptions import InvalidTask


class LeasesError(Exception):
    """Base class for django_leases errors. Do not raise directly."""


class InvalidJobArgument(LeasesError, ValueError):
    """An argument does not round-trip through JSON; nothing was written."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class InvalidTaskArguments(InvalidTask, TypeError, ValueError):
    """The lease backend's enqueue refused a call's arguments (from InvalidJobArgument,
    its ``__cause__``): Django's InvalidTask, as for every refused enqueue here, and the
    TypeError (ValueError for bytes that are not UTF-8) Django's own backends raise for
    arguments JSON cannot hold, so an ``except`` written for either catches it."""


class InvalidLeaseOption(LeasesError, ValueError):
    """A lease, heartbeat or attempt setting is out of range; names the option."""

    def __init__(self, option: str, reason: str) -> None:
        self.option = option
        self.reason = reason
        super().__init__(f"{option}: {reason}")


class InvalidSchedule(LeasesError, ValueError):
    """A periodic schedule's declaration cannot work; names the field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class LeaseLost(LeasesError):
    """The claim was lost (renewal touched no row): stop, and discard the result."""


class DuplicateJob(LeasesError):
    """A pending or claimed job already holds this unique key; nothing was written."""

    def __init__(self, unique_key: str, job_id: object) -> None:
        self.unique_key = unique_key
        self.job_id = job_id
        super().__init__(f"unique_key {unique_key!r} is held by active job {job_id}")


class NonRetryable(LeasesError):
    """Raise (or subclass) in a handler to dead-letter the job at once instead of retrying."""


class UnknownTask(LeasesError):
    """A job names a dotted path that is not a task declared for the worker's backend."""


class TransactionLeftOpen(LeasesError):
    """A handler returned inside a transaction (an atomic block it never left, autocommit
    turned off, a BEGIN of its own): what it wrote there is rolled back, so its job did not
    do its work and fails like a handler that raised."""


class HandlerDied(LeasesError):
    """A process-isolated handler exited without reporting a result (killed, crashed)."""


class ReleasedTooOften(LeasesError):
    """The failure recorded for a job given back at a worker's stop more than
    conf.UNCOUNTED_RELEASES times with no checkpoint between that moved its cursor: that
    release counts its attempt."""


class HandlerTimeout(LeasesError):
    """A handler ran past its timeout (the task's ``timeout``, else TIMEOUT_SECONDS): told
    to stop, its process killed (process isolation), its attempt failed."""
