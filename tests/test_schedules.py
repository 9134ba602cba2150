"""Schedule declarations and their tick arithmetic, without a database (schedules.py).

Hostile declarations get property tests: whatever a field holds, the answer is a working
Periodic or an InvalidSchedule naming that field (invariant 6).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from django_leases.exceptions import InvalidSchedule
from django_leases.schedules import Periodic, checked_settings, plan

PARIS = "Europe/Paris"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# -- DST ------------------------------------------------------------------------------


def test_a_tick_in_the_skipped_hour_fires_once_right_after_the_gap():
    """Invariant 1 (times are instants): 02:30 Paris on 2026-03-29 does not exist; the tick
    fires at 03:00 CEST (01:00 UTC), once, and the next day at 02:30 again."""
    p = Periodic(cron="30 2 * * *", timezone=PARIS)
    first = p.next_after(utc(2026, 3, 28, 12))
    assert first == utc(2026, 3, 29, 1, 0)
    assert p.next_after(first) == utc(2026, 3, 30, 0, 30)


def test_a_daily_tick_in_the_repeated_hour_fires_once():
    """Invariant 1: 02:30 Paris happens twice on 2026-10-25; a daily tick fires at the first
    (00:30 UTC), not again an hour later."""
    p = Periodic(cron="30 2 * * *", timezone=PARIS)
    first = p.next_after(utc(2026, 10, 24, 12))
    assert first == utc(2026, 10, 25, 0, 30)
    assert p.next_after(first) == utc(2026, 10, 26, 1, 30)


def test_a_frequent_cron_fires_in_both_passes_of_the_repeated_hour():
    """Invariant 1: */30 keeps a tick every 30 real minutes through the repeated hour."""
    p = Periodic(cron="*/30 * * * *", timezone=PARIS)
    ticks = [p.next_after(utc(2026, 10, 24, 23, 45))]
    while len(ticks) < 6:
        ticks.append(p.next_after(ticks[-1]))
    assert [t - ticks[0] for t in ticks] == [timedelta(minutes=30 * i) for i in range(6)]


def test_new_york_spring_forward():
    """Invariant 1: the same rule in another zone (02:30 skipped on 2026-03-08)."""
    p = Periodic(cron="30 2 * * *", timezone="America/New_York")
    assert p.next_after(utc(2026, 3, 7, 12)) == utc(2026, 3, 8, 7, 0)


# -- plan(): which due ticks run -------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "limit", "runs", "misfired"),
    [("once", 1, 1, 11), ("each", 3, 3, 9), ("skip", 1, 0, 12)],
)
def test_misfire_policies_on_twelve_missed_ticks(policy, limit, runs, misfired):
    """Invariant 3 (nothing lost silently): 12 ticks all more than the grace late; each
    policy runs what it says and counts the rest as misfired."""
    p = Periodic(every=60, misfire=policy, misfire_limit=limit, grace=10)
    now = utc(2026, 1, 1, 12)
    result = plan(p, now - timedelta(seconds=690), now)  # ticks 11.5 .. 0.5 minutes late
    assert result.due == 12
    assert len(result.run) == runs
    assert result.misfired == misfired
    assert result.latest == now - timedelta(seconds=30)
    assert result.next == now + timedelta(seconds=30)
    if runs:
        assert result.run[-1] == result.latest


@pytest.mark.parametrize("policy", ["once", "each", "skip"])
def test_an_on_time_tick_always_runs(policy):
    """Invariant 3: a tick decided within its grace runs whatever the misfire policy."""
    p = Periodic(every=60, misfire=policy)
    now = utc(2026, 1, 1, 12)
    result = plan(p, now - timedelta(seconds=5), now)
    assert (result.due, result.run, result.misfired) == (1, [now - timedelta(seconds=5)], 0)


@pytest.mark.parametrize("policy", ["once", "each", "skip"])
def test_a_short_interval_decided_at_a_healthy_polls_lateness_misses_nothing(policy):
    """Invariant 3: ticks are decided at a worker's poll (about once a second, jittered),
    so a healthy fleet decides a 1 s tick up to about 2 s late. The default grace was one
    interval: such ticks counted as missed ("skip" dropped them, "once" merged them) with
    every worker up. It is at least 5 s now; a grace given is kept as given."""
    now = utc(2026, 1, 1, 12)
    ticks = [now - timedelta(seconds=2), now - timedelta(seconds=1), now]
    result = plan(Periodic(every=1, misfire=policy), ticks[0], now)
    assert (result.run, result.misfired) == (ticks, 0)
    assert Periodic(every=2).grace_seconds == 5 and Periodic(every=30).grace_seconds == 30
    assert Periodic(every=1, grace=1.5).grace_seconds == 1.5
    assert Periodic(every=3600).grace_seconds == Periodic(cron="0 * * * *").grace_seconds == 60


def test_a_year_down_is_not_walked_tick_by_tick():
    """Invariant 3: a 1 s schedule a year behind is decided in one bounded step."""
    p = Periodic(every=1, misfire="once")
    now = utc(2026, 1, 1)
    result = plan(p, now - timedelta(days=365), now)
    assert result.due == 365 * 86400 + 1
    # The grace (5 s for a 1 s interval, the least default) keeps the last six on time.
    assert result.latest == now
    assert result.run == [now - timedelta(seconds=s) for s in range(5, -1, -1)]
    assert result.misfired == result.due - 6
    cron = Periodic(cron="* * * * *", misfire="skip")
    result = plan(cron, utc(2025, 1, 1), now)
    # As for intervals, the default grace (60 s) keeps the last two minutes on time.
    assert result.latest == now and result.run == [now - timedelta(minutes=1), now]
    assert result.due == 365 * 1440 + 1 and result.misfired == result.due - 2


def test_each_after_a_long_cron_outage_runs_the_newest_missed_ticks():
    """Invariant 3: a minutely cron down 31 days with misfire="each" runs its newest
    missed ticks (not the outage's first week) and counts the rest as misfired."""
    p = Periodic(cron="* * * * *", misfire="each", misfire_limit=3, grace=10)
    now = utc(2026, 2, 1, 0, 0, 30)
    result = plan(p, utc(2026, 1, 1), now)
    minutes = 31 * 24 * 60 + 1  # Jan 1 00:00 .. Feb 1 00:00 inclusive
    newest = [utc(2026, 1, 31, 23, 58), utc(2026, 1, 31, 23, 59), utc(2026, 2, 1)]
    assert result.run == newest and result.latest == newest[-1]
    assert result.due == minutes
    assert result.misfired == minutes - 3


# -- declarations: clear errors naming the field ---------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "cron"),
        ({"cron": "* * * * *", "every": 5}, "cron"),
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * 30 2 *"}, "cron"),
        ({"cron": "@daily"}, "cron"),
        ({"every": 0.5}, "every"),
        ({"every": math.nan}, "every"),
        ({"every": True}, "every"),
        ({"every": 60, "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": 60, "timezone": "../../etc/passwd"}, "timezone"),
        ({"every": 60, "timezone": "localtime"}, "timezone"),
        ({"every": 60, "misfire": "twice"}, "misfire"),
        ({"every": 60, "misfire": "each", "misfire_limit": 0}, "misfire_limit"),
        ({"every": 60, "overlap": "queue"}, "overlap"),
        ({"every": 60, "args": "abc"}, "args"),
        ({"every": 60, "args": [{1, 2}]}, "args[0]"),
        ({"every": 60, "kwargs": {"x": math.inf}}, "kwargs['x']"),
        ({"every": 60, "name": ""}, "name"),
        # The table cannot hold them: every sync of the backend failed, no schedule ticked.
        ({"every": 60, "name": "x\x00y"}, "name"),
        ({"every": 60, "name": "x\udc00"}, "name"),
        ({"every": 60, "grace": -1}, "grace"),
        # A tick is decided after its time: with "skip", a grace of 0 ran no tick ever.
        ({"every": 60, "grace": 0, "misfire": "skip"}, "grace"),
        ({"every": 60, "grace": 0.5}, "grace"),
    ],
)
def test_a_bad_declaration_names_its_field(kwargs, field):
    """Invariant 6: the error says which field is wrong."""
    with pytest.raises(InvalidSchedule) as caught:
        Periodic(**kwargs)
    assert caught.value.field.startswith(field), caught.value


def test_an_interval_out_of_bounds_says_them_as_people_write_them():
    """Invariant 6: the bound read 3.16224e+07 seconds."""
    with pytest.raises(InvalidSchedule) as caught:
        Periodic(every=0)
    assert str(caught.value) == (
        "every: must be between 1 and 31,622,400 (366 days) seconds, got 0"
    ), caught.value


def test_the_settings_form_names_the_schedule_and_field():
    """Invariant 6: OPTIONS["SCHEDULES"] errors read SCHEDULES['name'].field."""
    with pytest.raises(InvalidSchedule, match=r"SCHEDULES\['nightly'\]\.timezone"):
        checked_settings({"nightly": {"task": "a.b", "cron": "0 3 * * *", "timezone": "X/Y"}})
    with pytest.raises(InvalidSchedule, match=r"SCHEDULES\['nightly'\]\.task"):
        checked_settings({"nightly": {"cron": "0 3 * * *"}})
    with pytest.raises(InvalidSchedule, match=r"SCHEDULES\['x\\x00y'\]: contains a NUL"):
        checked_settings({"x\x00y": {"task": "a.b", "every": 60}})
    with pytest.raises(InvalidSchedule, match=r"SCHEDULES\['nightly'\]\.color"):
        checked_settings({"nightly": {"task": "a.b", "every": 60, "color": "red"}})
    # The key names the entry: another "name" inside it was silently dropped.
    with pytest.raises(InvalidSchedule, match=r"SCHEDULES\['nightly'\]\.name: is 'daily'"):
        checked_settings({"nightly": {"task": "a.b", "every": 60, "name": "daily"}})
    specs = checked_settings({"n": {"task": "a.b", "every": 60, "args": [1], "name": "n"}})
    assert specs["n"].task_path == "a.b" and specs["n"].periodic.args == [1]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
anything = json_values | st.sets(st.integers(), max_size=2) | st.binary(max_size=3)


def _answer(**kwargs):
    try:
        return Periodic(**kwargs)
    except InvalidSchedule as e:
        return e


@settings(max_examples=100, deadline=None)
@given(cron=st.text(alphabet="0123456789*/,-LW#? abcdefMONJAN", max_size=30))
def test_any_cron_text_is_a_schedule_or_names_cron(cron):
    """Invariant 6: cron text is read or refused as "cron", never crashes elsewhere."""
    answer = _answer(cron=cron)
    if isinstance(answer, InvalidSchedule):
        assert answer.field == "cron"
    else:
        tick = answer.next_after(utc(2026, 1, 1))
        assert tick > utc(2026, 1, 1)


@settings(max_examples=100, deadline=None)
@given(tz=st.text(max_size=40) | anything)
def test_any_timezone_is_a_zone_or_names_timezone(tz):
    """Invariant 6."""
    answer = _answer(every=60, timezone=tz)
    if isinstance(answer, InvalidSchedule):
        assert answer.field == "timezone"


@settings(max_examples=100, deadline=None)
@given(args=anything, kwargs=anything)
def test_any_arguments_are_json_or_name_the_argument(args, kwargs):
    """Invariant 6: arguments that would not come back from the JSON column are refused,
    naming args or kwargs (and the element)."""
    answer = _answer(every=60, args=args, kwargs=kwargs)
    if isinstance(answer, InvalidSchedule):
        assert answer.field.startswith(("args", "kwargs")), answer
    else:
        assert answer.to_json()["args"] == list(args)


@settings(max_examples=100, deadline=None)
@given(
    every=anything | st.floats(allow_nan=True, allow_infinity=True),
    limit=anything,
    grace=anything,
)
def test_any_numbers_are_checked_by_name(every, limit, grace):
    """Invariant 6: every, misfire_limit and grace refused by name, not with a TypeError."""
    answer = _answer(every=every, misfire="each", misfire_limit=limit, grace=grace)
    if isinstance(answer, InvalidSchedule):
        assert answer.field in {"every", "cron", "misfire_limit", "grace"}
    else:
        assert answer.every >= 1 and answer.misfire_limit >= 1
