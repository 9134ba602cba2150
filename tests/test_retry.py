"""Retry ladders and the worst-case completion time they imply."""

from __future__ import annotations

import pytest

from django_leases.exceptions import InvalidLeaseOption
from django_leases.retry import Retry, worst_case_completion


def test_an_explicit_ladder_repeats_its_last_step():
    ladder = Retry(delays=[10, 60, 300, 1800])
    assert [ladder.delay(n) for n in range(1, 7)] == [10, 60, 300, 1800, 1800, 1800]


def test_exponential_backoff_is_capped_and_jittered_within_bounds():
    backoff = Retry(base=10, factor=2, cap=100, jitter=0.2)
    assert [backoff.nominal(n) for n in range(1, 6)] == [10, 20, 40, 80, 100]
    assert backoff.delay(1, rand=lambda: 0.0) == pytest.approx(8)
    assert backoff.delay(1, rand=lambda: 1.0) == pytest.approx(12)
    assert backoff.longest(5) == pytest.approx(120)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"delays": [10, -1]}, "retry.delays[1]"),
        ({"factor": 0.5}, "retry.factor"),
        ({"jitter": 1.5}, "retry.jitter"),
        ({"base": "10"}, "retry.base"),
        ({"wait": 3}, "retry"),
        ("often", "retry"),
        ([], "retry"),
        ({"delays": []}, "retry.delays"),
        # Before: each of these was quietly the exponential default, or a dict's keys.
        ({"delays": ""}, "retry.delays"),
        ({"delays": set()}, "retry.delays"),
        ({"delays": range(0)}, "retry.delays"),
        ({"delays": {30: "x", 60: "y"}}, "retry.delays"),
        ({"delays": "30"}, "retry.delays"),
    ],
)
def test_bad_ladders_are_refused_naming_the_field(spec, named):
    with pytest.raises(InvalidLeaseOption) as info:
        Retry.from_json(spec)
    assert info.value.option == named


@pytest.mark.parametrize("delays", [{90, 10, 30}, {30: "x"}, range(3), "30", iter([1]), [], ()])
def test_a_retry_made_in_code_takes_its_delays_as_a_list_only(delays):
    """(6) Retry(delays=...), the documented constructor, refuses what from_json() refuses
    (before: a set's arbitrary order, a dict's keys or a string's characters were taken as
    the ladder, and an empty list, meant as "retry at once" or "never", as the exponential
    default)."""
    with pytest.raises(InvalidLeaseOption) as info:
        Retry(delays=delays)
    assert info.value.option == "retry.delays"


def test_no_ladder_is_the_exponential_default_and_survives_replace():
    """No ladder is delays=None, not an empty one (refused above): so
    dataclasses.replace() of a Retry, which passes its delays again, still works."""
    import dataclasses

    assert Retry().delays is None and Retry().nominal(2) == 20
    assert dataclasses.replace(Retry(), base=5).nominal(2) == 10
    assert dataclasses.replace(Retry(delays=[1, 2]), base=5).nominal(2) == 2


def test_ladders_round_trip_through_json():
    for ladder in (Retry(delays=(1, 2)), Retry(base=5, factor=3, cap=60, jitter=0)):
        assert Retry.from_json(ladder.to_json()) == ladder
    assert Retry.from_json([5, 10]) == Retry(delays=(5, 10))


def test_worst_case_completion_adds_each_failed_attempt_at_its_slowest():
    # 3 attempts, lease 30, handler 5, poll 1, ladder 10 then 60:
    # attempt 1: max(5+30+1, 5+10+1) = 36; attempt 2: max(36, 5+60+1=66) = 66; last: 1 + 5.
    ladder = Retry(delays=[10, 60])
    assert (
        worst_case_completion(ladder, max_attempts=3, lease=30, handler_seconds=5, poll=1)
        == 36 + 66 + 6
    )
    assert worst_case_completion(ladder, max_attempts=1, lease=30, handler_seconds=5, poll=1) == 6
