"""Retry ladders: how long a failed job waits before its next attempt.

A ladder is an interval, never a timestamp: the database adds it to its own Now() when the
failure is recorded, so worker clocks play no part.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .exceptions import InvalidLeaseOption

# A step longer than this is a typo (seconds meant as minutes, or a stray exponent).
MAX_DELAY_SECONDS = 30 * 86400
# The most delays a ladder given as an option lists (the last one repeats): more than any
# schedule a person writes, and each job row stores its ladder (enqueue.ROW_SIZE counts it).
MAX_STEPS = 50


@dataclass(frozen=True)
class Retry:
    """Either an explicit ladder of delays (the last step repeats) or exponential backoff.

    ``Retry(delays=[10, 60, 300, 1800])`` waits 10 s after the first failure, 60 s after the
    second, and so on. ``Retry(base=10, factor=2, cap=3600, jitter=0.1)`` waits
    base * factor**(n-1), capped, then spread by +-jitter so failures of many jobs at once do
    not come back at once.
    """

    # None: exponential backoff. An empty ladder is refused rather than read as None: it
    # may have been meant as "retry at once" or "do not retry".
    delays: tuple[float, ...] | None = None
    base: float = 10.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", _ladder("retry.delays", self.delays))
            for i, d in enumerate(self.delays):
                _non_negative(f"retry.delays[{i}]", d)
        _non_negative("retry.base", self.base)
        _non_negative("retry.cap", self.cap)
        if (
            isinstance(self.factor, bool)
            or not isinstance(self.factor, int | float)
            or not 1 <= self.factor < math.inf
        ):
            raise InvalidLeaseOption("retry.factor", f"must be a number >= 1, got {self.factor!r}")
        if (
            isinstance(self.jitter, bool)
            or not isinstance(self.jitter, int | float)
            or not 0 <= self.jitter < 1
        ):
            raise InvalidLeaseOption(
                "retry.jitter", f"must be from 0 to below 1, got {self.jitter!r}"
            )

    def nominal(self, failures: int) -> float:
        """The delay after the ``failures``-th failure, before jitter."""
        if failures < 1:
            return 0.0
        if self.delays:
            return float(self.delays[min(failures, len(self.delays)) - 1])
        return float(min(self.cap, self.base * self.factor ** (failures - 1)))

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """The delay to wait after the ``failures``-th failure, jitter included."""
        nominal = self.nominal(failures)
        if self.delays or not self.jitter:
            return nominal
        return max(0.0, nominal * (1 + self.jitter * (2 * rand() - 1)))

    def longest(self, failures: int) -> float:
        """The most ``delay(failures)`` can be."""
        return self.nominal(failures) * (1 if self.delays else 1 + self.jitter)

    def to_json(self) -> dict[str, Any]:
        if self.delays:
            return {"delays": list(self.delays)}
        return {"base": self.base, "factor": self.factor, "cap": self.cap, "jitter": self.jitter}

    @classmethod
    def from_json(cls, data: Any) -> Retry:
        if isinstance(data, Retry):
            return data
        if isinstance(data, list | tuple):
            return cls(delays=_ladder("retry", data))
        if not isinstance(data, dict):
            raise InvalidLeaseOption(
                "retry", f"must be a Retry, a list of delays or a dict, got {data!r}"
            )
        unknown = set(data) - {"delays", "base", "factor", "cap", "jitter"}
        if unknown:
            raise InvalidLeaseOption("retry", f"unknown keys {sorted(unknown)}")
        options: dict[str, Any] = dict(data)
        if "delays" in data:
            # Here too: the constructor reads None as "no ladder", a stored null is not.
            options["delays"] = _ladder("retry.delays", data["delays"])
        return cls(**options)


def _ladder(name: str, delays: Any) -> tuple[Any, ...]:
    """``delays`` as a tuple, if it is a list or tuple of at least one: an empty one read
    as "no ladder" was the exponential default, neither "retry at once" nor "do not
    retry", which is what it may have meant; a string, set or dict has no order to
    follow or is no list at all. Retry() and from_json() both refuse through here."""
    if not isinstance(delays, list | tuple):
        raise InvalidLeaseOption(name, f"must be a list of delays in seconds, got {delays!r}")
    if not delays:
        raise InvalidLeaseOption(
            name,
            "is an empty list of delays: give at least one ([0] retries at once; "
            "the last one repeats), or MAX_ATTEMPTS = 1 for no retry",
        )
    return tuple(delays)


def checked_ladder(retry: Retry) -> Retry:
    """``retry``, given as an option, if it lists at most MAX_STEPS delays. (Not checked
    where a job's stored ladder is read: a row written before the limit still runs.)"""
    if retry.delays is not None and len(retry.delays) > MAX_STEPS:
        raise InvalidLeaseOption(
            "retry.delays",
            f"lists at most {MAX_STEPS} delays (the last one repeats), got {len(retry.delays)}",
        )
    return retry


def _non_negative(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_DELAY_SECONDS
    ):
        raise InvalidLeaseOption(
            name, f"must be seconds from 0 to {MAX_DELAY_SECONDS:g}, got {value!r}"
        )


DEFAULT_RETRY = Retry()


def worst_case_completion(
    retry: Retry,
    *,
    max_attempts: int,
    lease: float,
    handler_seconds: float,
    poll: float = 1.0,
) -> float:
    """Seconds from enqueue until a job that fails every attempt but the last is done.

    Each failed attempt is taken at its slowest: a worker that dies just after a renewal at
    the end of its handler leaves the job claimed for a whole lease, then a poll interval
    passes before another worker looks; a handler that raises instead waits the ladder's
    longest delay. The last attempt runs to completion.
    """
    total = 0.0
    for failures in range(1, max_attempts):
        crashed = handler_seconds + lease + poll
        raised = handler_seconds + retry.longest(failures) + poll
        total += max(crashed, raised)
    return total + poll + handler_seconds
