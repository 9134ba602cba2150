"""Hostile input to enqueue (issues 14.4 and 13.4): every argument and option is checked
before the INSERT. A refused call raises the documented exception naming what it refused,
writes no row and leaves the caller's transaction usable; an accepted call stores a row
that reads back exactly as it was given.

Invariants (design.md): (3) a call that raises wrote nothing, (6) whatever a caller passes
to enqueue is untrusted input.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum

import pytest
from asgiref.sync import async_to_sync
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.tasks.exceptions import InvalidTask
from django.test import override_settings
from django.utils import timezone as dj_timezone
from hypothesis import HealthCheck, event, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_leases import conf
from django_leases import enqueue as inserts
from django_leases.exceptions import InvalidJobArgument, InvalidLeaseOption
from django_leases.jsonsafe import MAX_DEPTH, ensure_json
from django_leases.models import Job
from tests.testapp.models import Effect
from tests.testapp.tasks import _ItemsRaise, add, echo, with_context

pytestmark = pytest.mark.django_db

TASK = "tests.testapp.tasks.add"
# The test settings' "any_queue" backend lets the manager take any queue name on "default";
# here the QUEUES of the one backend on "default" decide, as in a project.
STRICT_TASKS = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails", "reports"],
        "OPTIONS": {"LEASE_SECONDS": 30},
    }
}
EXAMPLES = int(os.environ.get("LEASES_HYPOTHESIS_EXAMPLES", "40"))
PROPERTY = hypothesis_settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def nested(depth: int, kind: str = "list") -> object:
    """A value whose lists (or dicts) nest ``depth`` deep around a 1."""
    value: object = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


class _UnreadableList(list):
    def __iter__(self):
        raise RuntimeError("a caller's list that cannot be read")


def mark(key: str) -> Effect:
    return Effect.objects.create(key=key, job_id=0, fence=0, worker_id="test", pid=0, phase="x")


def refused(call, exception, named: str):
    """Run ``call`` between two writes of one transaction: it must raise ``exception``
    naming ``named``, add no job, and leave the transaction usable for the second write."""
    jobs = Job.objects.count()
    with transaction.atomic():
        mark("before")
        with pytest.raises(exception) as info:
            call()
        mark("after")  # PostgreSQL refuses any statement once an error aborted the transaction
    assert named in str(info.value), str(info.value)
    assert Job.objects.count() == jobs
    return info.value


def same(expected, got) -> bool:
    """Equal and of the same JSON types all the way down (a float that came back an int, or
    a tuple that came back a list where a list was not expected, is not the same)."""
    if isinstance(expected, tuple):
        expected = list(expected)
    if isinstance(expected, bytes):  # the Tasks API's enqueue() stores it as Django does
        expected = expected.decode()
    if type(expected) is not type(got):
        return False
    if isinstance(got, list):
        return len(got) == len(expected) and all(
            same(e, g) for e, g in zip(expected, got, strict=True)
        )
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(same(expected[k], got[k]) for k in got)
    return expected == got


# -- concrete cases, one per bullet of issue 14.4 -----------------------------------------


@pytest.mark.parametrize(
    ("call", "named"),
    [
        # argument types: a string or a dict is iterable, and used to be stored as its items
        ({"args": "abc"}, "args"),
        ({"args": {"a": 1}}, "args"),
        ({"args": 5}, "args"),
        ({"kwargs": [("a", 1)]}, "kwargs"),
        ({"kwargs": {1: "one"}}, "kwargs[1]"),
        # nesting: past MAX_DEPTH, and far past it (a RecursionError before)
        ({"args": [nested(MAX_DEPTH)]}, "args[0]"),
        ({"kwargs": {"k": nested(MAX_DEPTH, "dict")}}, "kwargs['k']"),
        ({"args": [nested(1200)]}, "args[0]"),
        # int size: past 64 bits, and 4,300+ digits (a ValueError from json before)
        ({"args": [2**63]}, "args[0]"),
        ({"args": [-(2**63) - 1]}, "args[0]"),
        ({"args": [10**5000]}, "args[0]"),
        # floats PostgreSQL's jsonb would give back as ints, and floats with no JSON form
        ({"args": [1e16]}, "args[0]"),
        ({"args": [float("nan")]}, "args[0]"),
        ({"kwargs": {"x": [float("-inf")]}}, "kwargs['x'][0]"),
        # text no database stores
        ({"args": ["a\x00b"]}, "args[0]"),
        ({"args": ["\ud800"]}, "args[0]"),
        ({"args": [Decimal("1.5")]}, "args[0]"),
    ],
)
def test_arguments_that_would_not_round_trip_are_refused_naming_them(call, named):
    """(3, 6) InvalidJobArgument names the argument; no row, the transaction usable."""
    error = refused(
        lambda: Job.objects.enqueue(TASK, call.get("args", []), call.get("kwargs")),
        InvalidJobArgument,
        named,
    )
    assert error.path.startswith(named)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        # durations: finite, from 0 to MAX_INTERVAL_SECONDS (a DataError after the row was
        # committed, or an OverflowError, before)
        ({"max_age": 1e12}, "max_age"),
        ({"delay": 3e11}, "delay"),
        ({"delay": 1e300}, "delay"),
        ({"delay": float("inf")}, "delay"),
        ({"delay": -1}, "delay"),
        ({"delay": timedelta(days=conf.MAX_INTERVAL_DAYS + 1)}, "delay"),
        ({"max_age": float("nan")}, "max_age"),
        # times: aware, within MySQL's DATETIME range in UTC
        ({"run_after": datetime(999, 12, 31, tzinfo=UTC)}, "run_after"),
        ({"run_after": datetime(1000, 1, 1, tzinfo=timezone(timedelta(hours=1)))}, "run_after"),
        (
            {"run_after": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))},
            "run_after",
        ),
        ({"run_after": datetime(2030, 1, 1)}, "run_after"),
        ({"deadline": datetime(999, 1, 1, tzinfo=UTC)}, "deadline"),
        ({"deadline": "2030-01-01"}, "deadline"),
        # names stored in character columns
        ({"task_path": "x" * 300}, "task_path"),
        ({"task_path": "a.b\x00"}, "task_path"),
        ({"task_path": ""}, "task_path"),
        ({"queue_name": "q\x00"}, "queue_name"),
        ({"queue_name": "x" * 101}, "queue_name"),
        ({"unique_key": "k\x00"}, "unique_key"),
        ({"unique_key": "\udc80"}, "unique_key"),
        # choices and ladders
        ({"priority": 101}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": 2.5}, "priority"),
        ({"priority": float("nan")}, "priority"),
        ({"priority": float("inf")}, "priority"),
        ({"priority": "5"}, "priority"),
        ({"retry": {"delays": 5}}, "retry"),
        ({"retry": []}, "retry"),  # before: the exponential default, without a word
        ({"retry": {"delays": ()}}, "retry"),
        ({"retry": [1] * 51}, "retry"),  # each row stores its ladder
        ({"retry": [1e12]}, "retry"),
    ],
)
def test_options_out_of_range_are_refused_naming_them(options, named):
    """(3, 6) InvalidLeaseOption names the option; no row, the transaction usable."""
    options = dict(options)
    task_path = options.pop("task_path", TASK)
    error = refused(
        lambda: Job.objects.enqueue(task_path, [1, 2], **options), InvalidLeaseOption, named
    )
    assert error.option.startswith(named)


def test_a_whole_number_priority_given_as_a_float_is_taken_as_django_takes_it():
    """(6) Django's validate_task accepts a priority of 5.0 (a whole number); so do the
    manager and the backend, which store it as the int 5 (before: "must be a whole
    number ..., got 5.0" at enqueue, after Task.using() had accepted it)."""
    job = Job.objects.enqueue(TASK, [1, 2], priority=5.0)
    assert Job.objects.values_list("priority", flat=True).get(pk=job.pk) == 5
    result = echo.using(priority=-7.0).enqueue()
    stored = Job.objects.values_list("priority", flat=True).get(pk=int(result.id))
    assert stored == -7 and type(stored) is int
    assert echo.get_result(result.id).task.priority == -7
    # The enqueue's own result says what get_result() will (before: -7.0).
    assert type(result.task.priority) is int and result.task.priority == -7


class _Colour(IntEnum):
    RED = 1


class _Named(str):
    pass


class _Ratio(float):
    def __repr__(self) -> str:
        return "a ratio"


def test_the_enqueued_result_holds_the_plain_values_get_result_reads_back():
    """(6) A caller's subclass of int, str or float is stored as its plain value; the
    result enqueue() hands back, and what task_enqueued receivers see, hold that value
    too (before: the IntEnum member itself, while get_result() and the handler got 1)."""
    result = echo.enqueue(_Colour.RED, _Named("n"), _Ratio(0.5), key={_Named("k"): _Colour.RED})
    back = echo.get_result(result.id)
    assert result.args == back.args == [1, "n", 0.5]
    assert result.kwargs == back.kwargs == {"key": {"k": 1}}
    plain = [*result.args, *result.kwargs, *result.kwargs["key"], result.kwargs["key"]["k"]]
    assert [type(v) for v in plain] == [int, str, float, str, str, int]
    # Keys unequal as given and equal as stored would lose a value without a word; a key
    # whose repr raises is still named.
    jobs = Job.objects.count()
    with pytest.raises(InvalidJobArgument, match=r"^kwargs\['k'\]: is a key given twice"):
        Job.objects.enqueue(TASK, [1, 2], kwargs={_Unequal("k"): 1, _Unequal("k"): 2})
    with pytest.raises(InvalidJobArgument, match=r"^args\[0\]\['k'\]\[0\]: is of type"):
        Job.objects.enqueue(TASK, [{_Unreadable("k"): [object()]}, 2])
    assert Job.objects.count() == jobs


class _Unequal(str):
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class _Unreadable(str):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __hash__ = str.__hash__


@pytest.mark.parametrize(
    ("using", "named"),
    [
        ({"priority": "5"}, "priority"),
        ({"priority": float("nan")}, "priority"),
        ({"priority": [5]}, "priority"),
        ({"run_after": "2030-01-01"}, "run_after"),
        ({"run_after": timedelta(minutes=5)}, "run_after"),
        ({"run_after": 1_900_000_000}, "run_after"),
        ({"queue_name": ["x"]}, "queue_name"),  # before: TypeError, unhashable type: 'list'
        ({"queue_name": {"q": 1}}, "queue_name"),
    ],
)
def test_task_using_values_django_cannot_compare_are_invalid_task_naming_them(using, named):
    """(6) Task.using() with a priority or run_after of a type Django's validate_task
    compares or asks for an offset raises InvalidTask naming the field (before: Django's
    own TypeError, ValueError or AttributeError, where priority=True, say, got
    InvalidTask); nothing is written."""
    jobs = Job.objects.count()
    with pytest.raises(InvalidTask, match=rf"{named}: must be"):
        echo.using(**using).enqueue()
    assert Job.objects.count() == jobs


@override_settings(TASKS=STRICT_TASKS)
def test_a_queue_no_backend_on_the_database_accepts_is_refused():
    """(3) No worker serves a queue outside QUEUES (run_lease_worker refuses it), so the
    manager refuses such a job instead of letting it wait forever."""
    refused(
        lambda: Job.objects.enqueue(TASK, [1, 2], queue_name="nope"), InvalidLeaseOption, "'nope'"
    )
    refused(
        lambda: Job.objects.enqueue_many(TASK, [([1, 2], {})], queue_name="nope"),
        InvalidLeaseOption,
        "queue_name",
    )
    assert Job.objects.enqueue(TASK, [1, 2], queue_name="reports").queue_name == "reports"


@override_settings(TASKS={"default": {**STRICT_TASKS["default"], "QUEUES": []}})
def test_empty_queues_allow_any_queue_name():
    """Django's docs: QUEUES = [] allows any queue name; through the backend too."""
    assert Job.objects.enqueue(TASK, [1, 2], queue_name="anything").queue_name == "anything"
    result = add.using(queue_name="elsewhere").enqueue(1, 2)
    assert Job.objects.get(pk=int(result.id)).queue_name == "elsewhere"


def test_limits_themselves_are_accepted_and_read_back_exactly():
    """The edges of each documented limit are stored and come back unchanged."""
    args = [nested(MAX_DEPTH - 1), 2**63 - 1, -(2**63), float(2**53), 9999999999999998.0, "é😀"]
    kwargs = {"deep": nested(MAX_DEPTH - 1, "dict")}
    far = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    job = Job.objects.enqueue(
        "t." + "x" * (255 - 2),
        args,
        kwargs,
        run_after=datetime(1000, 1, 1, tzinfo=UTC),
        deadline=far,
    )
    back = Job.objects.get(pk=job.pk)
    assert same(args, back.args) and same(kwargs, back.kwargs)
    assert (back.run_after, back.available_at, back.deadline) == (
        datetime(1000, 1, 1, tzinfo=UTC),
        datetime(1000, 1, 1, tzinfo=UTC),
        far,
    )
    assert Job.objects.get(pk=Job.objects.enqueue(TASK, [1, 2], run_after=far).pk).deadline == far
    longest = Job.objects.enqueue(
        TASK,
        [1, 2],
        delay=conf.MAX_INTERVAL_SECONDS,
        max_age=timedelta(days=conf.MAX_INTERVAL_DAYS),
    )
    longest = Job.objects.get(pk=longest.pk)
    assert longest.available_at - longest.enqueued_at == timedelta(days=conf.MAX_INTERVAL_DAYS)
    assert longest.deadline - longest.available_at == timedelta(days=conf.MAX_INTERVAL_DAYS)


def test_negative_zero_is_stored_as_zero_on_every_database():
    """PostgreSQL's jsonb gives -0.0 back as 0.0, SQLite and MariaDB as -0.0: a value
    accepted on one database reads back the same on every other, so it goes in as 0.0."""
    import math

    job = Job.objects.enqueue(TASK, [-0.0, [-0.0]], {"x": -0.0})
    back = Job.objects.get(pk=job.pk)
    zeros = [back.args[0], back.args[1][0], back.kwargs["x"]]
    assert zeros == [0.0] * 3 and all(type(z) is float for z in zeros)
    assert [math.copysign(1.0, z) for z in zeros] == [1.0] * 3


class _ShortSpoken(str):
    """A caller's str that says it is empty and holds nothing a database refuses: its
    content is what is stored."""

    def __len__(self) -> int:
        return 0

    def __contains__(self, part: object) -> bool:
        return False

    def encode(self, *args: object, **kwargs: object) -> bytes:
        return b""


def test_a_str_subclass_cannot_hide_what_a_database_refuses():
    """(6) The NUL and lone-surrogate checks read the string's content with str's own
    methods (before: a subclass answering `in` and encode() for itself was accepted, and
    PostgreSQL's jsonb refused the INSERT, aborting the caller's transaction)."""
    for bad, said in ((_ShortSpoken("a\x00"), "NUL"), (_ShortSpoken("a\ud800"), "Unicode")):
        with pytest.raises(InvalidJobArgument, match=said):
            Job.objects.enqueue(TASK, [bad, 1])
    # The names stored in character columns too (before: all three passed, and the
    # database refused the row or, on SQLite, stored a key past its 200 characters).
    jobs = Job.objects.count()
    for option, bad, said in (
        ("unique_key", _ShortSpoken("a\x00"), "unique_key: contains a NUL"),
        ("unique_key", _ShortSpoken("k" * 201), "unique_key: must be 1-200 characters"),
        ("queue_name", _ShortSpoken("a\ud800"), "queue_name: is not valid Unicode"),
    ):
        with pytest.raises(InvalidLeaseOption, match=said):
            Job.objects.enqueue(TASK, [1, 2], **{option: bad})
    assert Job.objects.count() == jobs
    # One that passes is stored as its plain value, not as what its methods say.
    job = Job.objects.enqueue(
        TASK, [1, 2], unique_key=_ShortSpoken("key-1"), queue_name=_ShortSpoken("default")
    )
    assert Job.objects.values_list("unique_key", "queue_name").get(pk=job.pk) == (
        "key-1",
        "default",
    )


def test_arguments_past_the_size_every_database_stores_are_refused_naming_them():
    """(3, 6) A call's args and kwargs whose JSON form passes SENT_LIMIT (8 MiB, the
    result's limit: MariaDB's default max_allowed_packet is 16 MiB) are refused before
    the INSERT, naming args/kwargs and the size (before: accepted on PostgreSQL and
    SQLite, and on MariaDB the server dropped the connection). The JSON form as sent is
    what counts: a non-ASCII character is six or twelve, and MySQL's client escapes each
    backslash and quote once more. The limit itself is stored and read back."""
    from django_leases.jsonsafe import SENT_LIMIT as ARGUMENTS_LIMIT

    jobs = Job.objects.count()
    over = [
        (["x" * ARGUMENTS_LIMIT], {}),
        (["x" * (ARGUMENTS_LIMIT // 2)], {"more": "y" * (ARGUMENTS_LIMIT // 2)}),
        (["é" * (ARGUMENTS_LIMIT // 6 + 1)], {}),
        ([[0.5] * (ARGUMENTS_LIMIT // 5 + 1)], {}),
        (["\\" * (ARGUMENTS_LIMIT // 4)], {}),  # 2 characters of JSON each, 4 as sent
        (["'" * (ARGUMENTS_LIMIT // 2)], {}),  # 1 character of JSON each, 2 as sent
        ([{"k": 'a"b'}] * (ARGUMENTS_LIMIT // 20), {}),  # 16 of JSON each, 22 as sent
        ([_ShortSpoken("x" * ARGUMENTS_LIMIT)], {}),
    ]
    for args, kwargs in over:
        with pytest.raises(InvalidJobArgument, match=r"args/kwargs: their JSON form is .* over"):
            Job.objects.enqueue(TASK, args, kwargs)
        with pytest.raises(InvalidTask, match=r"args/kwargs: their JSON form is"):
            echo.enqueue(*args, **kwargs)
    assert Job.objects.count() == jobs
    # ["..."] and {} take eight besides the string, its quotes counting twice.
    longest = "x" * (ARGUMENTS_LIMIT - 8)
    result = echo.enqueue(longest)
    assert Job.objects.get(pk=int(result.id)).args == [longest]


def test_enqueue_many_of_large_calls_goes_in_statements_every_database_takes():
    """(3) enqueue_many() of calls each within the limit but past MariaDB's packet
    together (16 MiB by default) stores them all, in order (before: the server dropped
    the connection, "Got a packet bigger than 'max_allowed_packet'"); all or nothing
    still: a refused call among them writes none."""
    from django_leases.lease_statements import on_postgresql

    big = ["x" * (6 * 2**20)]  # 18 MiB together
    inserts: list[int] = []

    def counted(execute, sql, params, many, context):
        inserts.append(sql.lstrip().upper().startswith("INSERT"))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(counted):
        jobs = Job.objects.enqueue_many(TASK, [(big, {}), (big, {"n": 1}), (big, {"n": 2})])
    if not on_postgresql("default"):  # PostgreSQL's one statement takes them all
        assert sum(inserts) == 3, inserts
    assert [Job.objects.get(pk=j.pk).kwargs for j in jobs] == [{}, {"n": 1}, {"n": 2}]
    assert all(Job.objects.get(pk=j.pk).args == big for j in jobs)
    before = Job.objects.count()
    with pytest.raises(InvalidJobArgument, match=r"calls\[2\]"):
        Job.objects.enqueue_many(TASK, [(big, {}), (big, {}), ([object()], {})])
    assert Job.objects.count() == before


# Text a database stores, leaning on what JSON or MySQL's client escapes and what JSON
# writes as one or two \uXXXX.
stored_text = st.text(
    alphabet=st.sampled_from(['"', "\\", "'", "\x01", "\n", "\u00e9", "\U0001f600"])
    | st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(-1e15, 1e15, allow_nan=False)
    | stored_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(stored_text, inner, max_size=4),
    max_leaves=12,
)


@PROPERTY
@given(value=json_values)
@example(value="\U0001f600" * 3)  # 14 as sent each: two \uXXXX, backslashes counted twice
@example(value=["\"'\\", {"\x01": 0.1}])
def test_property_the_size_read_while_checking_is_never_below_the_size_as_sent(value):
    """(3) The upper bound ensure_json() reads on the way decides alone whether a call is
    measured against SENT_LIMIT and how enqueue_many() groups rows into statements: it
    must never be below what is sent (quotes, backslashes, control characters and astral
    characters included), or an oversized call would pass."""
    from django_leases.jsonsafe import sent_length

    bound = [0]
    checked = ensure_json(value, "value", bound)
    assert bound[0] >= sent_length(json.dumps(checked)), (bound, json.dumps(checked))


# What Django's own backends store too (normalize_json): tuples, ranges, UTF-8 bytes.
stored_as_django_does = st.recursive(
    json_values | st.builds(range, st.integers(0, 4)) | st.text(max_size=4).map(str.encode),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3),
    max_leaves=10,
)


@PROPERTY
@given(value=stored_as_django_does, lenient=st.booleans())
@example(value=[[range(1)]] * 3, lenient=True)  # a range read as a list, counted once
def test_property_the_lower_bound_the_check_stops_at_is_never_above_the_size_as_sent(
    value, lenient
):
    """(3, 6) The check stops reading a value once a lower bound of its size as sent
    passes twice SENT_LIMIT (a list held twice at each of 23 levels was read whole: 40 s
    and 2.5 GB). That bound must never be above what is sent, or a value within the
    limit could be refused; and a list met again (here: the value beside itself) counts
    as much again without being read again."""
    from django_leases.jsonsafe import _checked, _Tally, sent_length

    tally = _Tally()
    try:
        checked = _checked(value, "value", 1, tally, lenient)
    except InvalidJobArgument:
        return  # bytes or a range where the strict check takes none
    sent = sent_length(json.dumps(checked))
    assert tally.least <= sent <= tally.most, (tally.least, sent, tally.most)
    twice = _Tally()
    _checked([checked, checked], "value", 1, twice)
    assert twice.least == 2 * tally.least + 2 + 2  # its brackets and ", "


def test_enqueue_many_groups_large_calls_by_their_size_not_the_bound():
    """(3) A call whose bound passes MEASURED_PAST counts for its size as sent, so
    enqueue_many() puts as many 10 KB calls in one INSERT as fit (before: each counted as
    the bound, 14 times a character, some 10 times fewer a statement); a small call counts
    its bound, never below its size."""
    from django_leases.enqueue_options import checked_calls
    from django_leases.jsonsafe import sent_length

    def sent_size(args, kwargs):
        return sent_length(json.dumps(args)) + sent_length(json.dumps(kwargs))

    bounds: list[int] = []
    calls = checked_calls([(["x" * 10_000], {}), ([1, "ab"], {"k": None})], bounds=bounds)
    assert bounds[0] == sent_size(*calls[0]) == 10_008
    assert bounds[1] >= sent_size(*calls[1])


def test_a_large_result_or_cursor_counts_for_its_size_as_sent():
    """(3) stored_json() reports a result's size as sent, measured like a call's past
    MEASURED_PAST (before: the bound, up to 14 times it), which ack_many() groups acks by
    (statement_runs()); a small one counts its bound, never below its size."""
    from django_leases.jsonsafe import sent_length, stored_json

    for value, measured in ((["x" * 10_000], True), ({"k": [1, "ab"]}, False)):
        size = [0]
        checked = stored_json(value, "result", size)
        length = sent_length(json.dumps(checked))
        assert size[0] == length if measured else size[0] >= length, (size, length)


@PROPERTY
@given(sizes=st.lists(st.integers(0, 2 * 2**23), max_size=12))
def test_property_statement_runs_keep_order_and_stay_within_the_limit(sizes):
    """(3) Rows or results split into statements: every item once, in order; a run past
    SENT_LIMIT only of one item; a run closed only when the next item would pass it."""
    from django_leases.jsonsafe import SENT_LIMIT, statement_runs

    items = list(range(len(sizes)))
    runs = list(statement_runs(items, sizes))
    assert [i for run in runs for i in run] == items
    for n, run in enumerate(runs):
        total = sum(sizes[i] for i in run)
        assert run and (total <= SENT_LIMIT or len(run) == 1)
        if n + 1 < len(runs):
            assert total + sizes[runs[n + 1][0]] > SENT_LIMIT


def test_enqueue_many_names_the_call_it_refuses_and_writes_none():
    """(3) One bad call among many: nothing is written, the call and argument are named."""
    refused(
        lambda: Job.objects.enqueue_many(TASK, [([1, 2], {}), "ab"]), InvalidJobArgument, "calls[1]"
    )
    refused(
        lambda: Job.objects.enqueue_many(TASK, [([1, 2], {}), ([1e16], None)]),
        InvalidJobArgument,
        "calls[1].args[0]",
    )
    refused(
        lambda: Job.objects.enqueue_many(TASK, [([1, 2], {}), ({"a": 1}, None)]),
        InvalidJobArgument,
        "calls[1].args",
    )
    refused(
        lambda: Job.objects.enqueue_many(TASK, [([1], {})], delay=3e11), InvalidLeaseOption, "delay"
    )
    refused(lambda: Job.objects.enqueue_many(TASK, "ab"), InvalidJobArgument, "calls")
    refused(lambda: Job.objects.enqueue_many(TASK, {"args": [1]}), InvalidJobArgument, "calls")
    refused(
        lambda: add.enqueue_many([((1, 2), {}), ((1,), {"b": 2}, "extra")]), InvalidTask, "calls[1]"
    )


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="colour"):
        Job.objects.enqueue(TASK, [1], colour="red")


# -- the same through Django Tasks: InvalidTask naming what was refused -----------------


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: add.using_lease(max_age=1e12).enqueue(1, 2), "max_age"),
        (
            lambda: add.using_lease(deadline=datetime(999, 1, 1, tzinfo=UTC)).enqueue(1, 2),
            "deadline",
        ),
        (
            lambda: add.using(
                run_after=datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))
            ).enqueue(1, 2),
            "run_after",
        ),
        (lambda: add.enqueue(10**5000, 1), "args[0]"),
        (lambda: add.enqueue(1, b=nested(1200)), "kwargs['b']"),
        (lambda: add.enqueue(1, b="\x00"), "kwargs['b']"),
        # a caller's subclass that raises when read (its RuntimeError escaped before)
        (lambda: add.enqueue(1, b={"k": _ItemsRaise(x=1)}), "kwargs['b']['k']"),
        (lambda: add.enqueue(_UnreadableList([1]), 2), "args[0]"),
        (lambda: add.enqueue_many([((1, 2), {}), ((1, 1e300), {})]), "calls[1].args[1]"),
        (lambda: add.using(queue_name="nope").enqueue(1, 2), "Queue 'nope'"),
        (lambda: async_to_sync(add.aenqueue)(1, [1.5, 2**64]), "args[1][1]"),
        # arguments the task's function cannot take: the worker would dead-letter the job
        (lambda: add.enqueue(1), "args/kwargs"),
        (lambda: add.enqueue(1, 2, c=3), "args/kwargs"),
        (lambda: with_context.enqueue(), "args/kwargs"),
        (lambda: add.enqueue_many([((1, 2), {}), ((1,), {})]), "calls[1].args/kwargs"),
    ],
)
def test_the_backend_refuses_with_invalid_task_naming_the_argument(call, named):
    """(3, 6) Through @task: InvalidTask naming the argument or option, nothing written."""
    refused(call, InvalidTask, named)


def test_arguments_that_fit_the_signature_are_accepted():
    """Defaults, keywords and a context task's own arguments pass the signature check."""
    assert add.enqueue(1, b=2).args == [1] and with_context.enqueue(key="k").kwargs == {"key": "k"}
    assert len(add.enqueue_many([((1, 2), {}), ((), {"a": 1, "b": 2})])) == 2


def test_a_task_declared_where_workers_do_not_look_is_refused_with_the_fix():
    """(3) A @task in tests/testapp/jobs.py, a module no worker imports: enqueue() refuses
    it (the worker would dead-letter it as UnknownTask) and says how to fix it."""
    from tests.testapp.jobs import shipped

    error = refused(lambda: shipped.enqueue(1), InvalidTask, "TASK_MODULES")
    assert "'tests.testapp.jobs'" in str(error)
    with override_settings(
        TASKS={
            **STRICT_TASKS,
            "default": {
                **STRICT_TASKS["default"],
                "OPTIONS": {"TASK_MODULES": ["tests.testapp.jobs"]},
            },
        }
    ):
        result = shipped.enqueue(1)
    assert Job.objects.get(pk=int(result.id)).task_path == "tests.testapp.jobs.shipped"


@pytest.mark.django_db(transaction=True)
def test_a_refused_enqueue_leaves_the_callers_transaction_to_commit():
    """(3) Refusals of every kind inside one transaction: the writes before and after them
    commit, and no job exists. On PostgreSQL a statement error would have aborted the whole
    transaction; none reaches the database."""
    with transaction.atomic():
        mark("first")
        for call in (
            lambda: Job.objects.enqueue("x" * 300, []),
            lambda: Job.objects.enqueue(TASK, [1], max_age=1e12),
            lambda: Job.objects.enqueue(TASK, [1], delay=3e11),
            lambda: Job.objects.enqueue(TASK, ["\x00"]),
            lambda: add.using_lease(max_age=1e12).enqueue(1, 2),
            lambda: add.enqueue(1, nested(40)),
        ):
            with pytest.raises((InvalidLeaseOption, InvalidJobArgument, InvalidTask)):
                call()
        mark("last")
    assert sorted(Effect.objects.values_list("key", flat=True)) == ["first", "last"]
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_enqueue_before_migrate_says_to_run_migrate():
    """(13.4) No job table: the database's own error, saying which command fixes it; for
    reading a result too, and the report and prune commands end with a CommandError that
    says it (they printed the database's bare "relation does not exist" traceback)."""
    fix = r"run `python manage\.py migrate django_leases --database default`"
    call_command("migrate", "django_leases", "zero", verbosity=0)
    try:
        with pytest.raises(DatabaseError, match=fix):
            add.enqueue(1, 2)
        with pytest.raises(DatabaseError, match=fix):
            Job.objects.enqueue_many(TASK, [([1, 2], {})])
        with pytest.raises(DatabaseError, match=fix):
            add.get_backend().get_result("1")
        # The prune checks the migrations before it writes: their names, and the command.
        for command in (["lease_report"], ["leases_prune", "--dry-run"], ["leases_prune"]):
            with pytest.raises(CommandError, match=r"migrate django_leases --database default"):
                call_command(*command, verbosity=0)
    finally:
        call_command("migrate", verbosity=0)  # with the test apps' models that need it
    assert add.enqueue(1, 2).id


# -- the property: hostile calls either round-trip or are refused cleanly ---------------

# Each strategy mixes what a careful caller passes (most draws) with what a hostile or
# careless one does, so that both outcomes are exercised in every run.
_offsets = st.integers(-23 * 60, 23 * 60).map(lambda m: timezone(timedelta(minutes=m)))
_good_times = st.datetimes(
    min_value=datetime(1001, 1, 2), max_value=datetime(9998, 12, 30), timezones=st.just(UTC)
) | st.builds(
    lambda d, tz: d.replace(tzinfo=tz),
    st.datetimes(datetime(1001, 1, 2), datetime(9998, 12, 30)),
    _offsets,
)
times = st.one_of(
    _good_times,
    _good_times,
    st.builds(lambda d, tz: d.replace(tzinfo=tz), st.datetimes(), _offsets),  # years 1-9999
    st.datetimes(),  # naive
    st.sampled_from([datetime(1000, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, tzinfo=UTC)]),
)
_good_seconds = st.floats(0, conf.MAX_INTERVAL_SECONDS) | st.integers(0, 10**6)
seconds = st.one_of(
    _good_seconds,
    _good_seconds,
    st.floats(),
    st.integers(-5, 10**14),
    st.timedeltas(min_value=timedelta(0)),
    st.builds(pow, st.just(10), st.just(5000)),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=6).filter(lambda t: "\x00" not in t),
    st.floats(-1e15, 1e15),
)
hostile_scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["\x00", "a\ud800", "é😀", 1e16, -1e300, 2**63 - 1, -(2**63)]),
    st.builds(pow, st.just(10), st.sampled_from([19, 5000])),  # the repr of 10**5000 raises
    st.sampled_from([Decimal("1"), b"bytes", {1, 2}, datetime(2030, 1, 1, tzinfo=UTC), object()]),
)
_json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
_hostile_values = st.recursive(
    hostile_scalars | json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner),
        st.dictionaries(
            st.one_of(st.text(max_size=3), st.integers(0, 2), st.just("\x00")), inner, max_size=3
        ),
    ),
    max_leaves=8,
) | st.builds(nested, st.integers(MAX_DEPTH - 3, MAX_DEPTH + 2), st.sampled_from(["list", "dict"]))
values = st.one_of(*[_json_values] * 8, _hostile_values)
_good_args = st.lists(values, max_size=3) | st.tuples(values, values)
manager_args = st.one_of(
    _good_args,
    _good_args,
    _good_args,
    st.text(max_size=3),
    st.dictionaries(st.text(max_size=2), values, max_size=2),
    st.integers(),
)
_good_kwargs = st.none() | st.dictionaries(st.text(max_size=3), values, max_size=3)
manager_kwargs = st.one_of(
    _good_kwargs,
    _good_kwargs,
    _good_kwargs,
    st.dictionaries(st.integers(0, 2), values, min_size=1, max_size=2),
    st.lists(values, max_size=2),
)
manager_options = st.fixed_dictionaries(
    {},
    optional={
        "delay": seconds,
        "max_age": seconds,
        "run_after": times,
        "deadline": times,
        "priority": st.one_of(
            st.integers(-100, 100), st.integers(-150, 150), st.booleans(), st.floats(-5, 5)
        ),
        "queue_name": st.sampled_from(
            ["default", "emails", "reports", "nope", "", "q\x00", "x" * 101]
        ),
        "lease_seconds": st.one_of(st.floats(1, 43200), st.floats(), st.integers(-1, 10**6)),
        "max_attempts": st.one_of(st.integers(1, 1000), st.integers(-1, 2000), st.floats(0, 10)),
        "retry": st.one_of(
            st.lists(st.floats(0, 30 * 86400), max_size=2),
            st.lists(seconds, max_size=2),
            st.dictionaries(
                st.sampled_from(["base", "factor", "cap", "jitter", "delays", "bogus"]),
                seconds,
                max_size=2,
            ),
        ),
    },
)
task_paths = st.one_of(
    st.just(TASK),
    st.just(TASK),
    st.text(max_size=4),
    st.sampled_from(["x" * 256, "a\x00", "ok.path", "x" * 255]),
)


def _named(error: Exception) -> str:
    if isinstance(error, InvalidJobArgument):
        return error.path
    return error.option


def _root(name: str) -> str:
    """``args[1]['k']`` -> ``args``; ``retry.delays[0]`` -> ``retry``; ``calls[0]...``
    -> ``calls``."""
    if name.startswith("calls["):
        return "calls"
    return name.split("[", 1)[0].split(".", 1)[0]


def _assert_stored_as_given(job, args, kwargs, options) -> None:
    back = Job.objects.get(pk=job.pk)
    assert same(args, back.args) and same(kwargs or {}, back.kwargs), (
        args,
        back.args,
        kwargs,
        back.kwargs,
    )
    assert (back.priority, back.queue_name) == (
        options.get("priority", 0),
        options.get("queue_name", "default"),
    )
    if "run_after" in options:
        assert back.run_after == back.available_at == options["run_after"]
    if "delay" in options:
        delay = options["delay"]
        delay = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
        assert abs(back.available_at - back.enqueued_at - delay) < timedelta(milliseconds=1)
    if "deadline" in options:
        assert back.deadline == options["deadline"]


@override_settings(TASKS=STRICT_TASKS)
@PROPERTY
@given(task_path=task_paths, args=manager_args, kwargs=manager_kwargs, options=manager_options)
def test_property_manager_enqueue_round_trips_or_refuses_cleanly(task_path, args, kwargs, options):
    """(3, 6) Job.objects.enqueue() with hostile arguments and options: a row that reads back
    exactly as given, or InvalidJobArgument/InvalidLeaseOption naming one of the things the
    call passed, no row, and a transaction still usable."""
    given_names = {"args", "kwargs", "task_path", *options}
    jobs = Job.objects.count()
    with transaction.atomic():
        mark("before")
        try:
            job = Job.objects.enqueue(task_path, args, kwargs, **options)
        except (InvalidJobArgument, InvalidLeaseOption) as e:
            assert _root(_named(e)) in given_names, (e, given_names)
            event(f"refused: {_root(_named(e))}")
            job = None
        mark("after")
    if job is None:
        assert Job.objects.count() == jobs
    else:
        event("stored")
        assert Job.objects.count() == jobs + 1
        _assert_stored_as_given(job, args, kwargs, options)


@override_settings(TASKS=STRICT_TASKS)
@PROPERTY
@given(
    calls=st.lists(st.tuples(manager_args, manager_kwargs) | values, max_size=4),
    options=manager_options,
)
def test_property_enqueue_many_is_all_or_nothing(calls, options):
    """(3) enqueue_many() with hostile calls: every job, each as given, or none and the
    refusal names the call (``calls[i]...``) or the option."""
    jobs = Job.objects.count()
    with transaction.atomic():
        mark("before")
        try:
            created = Job.objects.enqueue_many(TASK, calls, **options)
        except (InvalidJobArgument, InvalidLeaseOption) as e:
            name = _named(e)
            assert _root(name) in {"calls", *options}, (e, options)
            event(f"refused: {_root(name)}")
            created = None
        mark("after")
    if created is None:
        assert Job.objects.count() == jobs
    else:
        event(f"stored {min(len(calls), 2)}+ jobs")
        assert Job.objects.count() == jobs + len(calls)
        for job, (args, kwargs) in zip(created, calls, strict=True):
            _assert_stored_as_given(job, args, kwargs, options)


backend_options = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.one_of(st.integers(-150, 150), st.integers(-150, 150).map(float)),
        "queue_name": st.sampled_from(["default", "emails", "nope"]),
        "run_after": times,
    },
)
lease_options = st.fixed_dictionaries({}, optional={"max_age": seconds, "deadline": times})
# What Django's own messages call the options it checks.
_SPOKEN = {"queue_name": "queue", "run_after": "run_after", "priority": "priority"}


@PROPERTY
@given(
    args=st.lists(values, max_size=2),
    kwargs=st.dictionaries(st.sampled_from(["a", "b"]), values, max_size=2),
    using=backend_options,
    lease=lease_options,
)
def test_property_backend_enqueue_round_trips_or_refuses_cleanly(args, kwargs, using, lease):
    """(3, 6) @task enqueue with hostile arguments and options: a result whose row and
    get_result() give back what was passed, or InvalidTask naming what was refused."""
    jobs = Job.objects.count()
    with transaction.atomic():
        mark("before")
        try:
            result = echo.using(**using).using_lease(**lease).enqueue(*args, **kwargs)
        except InvalidTask as e:
            text = str(e).lower()
            named = {"args", "kwargs", *(_SPOKEN.get(k, k) for k in (*using, *lease))}
            assert any(n in text for n in named), (e, named)
            event("refused")
            result = None
        mark("after")
    if result is None:
        assert Job.objects.count() == jobs
        return
    event("stored")
    job = Job.objects.get(pk=int(result.id))
    _assert_stored_as_given(job, args, kwargs, using)
    again = echo.get_result(result.id)
    assert same(args, again.args) and same(kwargs, again.kwargs)
    assert (again.task.priority, again.task.queue_name, again.task.run_after) == (
        result.task.priority,
        result.task.queue_name,
        result.task.run_after,
    )


@pytest.mark.parametrize(
    "offset", [timedelta(hours=-7, minutes=-30), timedelta(hours=16), timedelta(hours=-23)]
)
def test_times_compare_on_the_database_after_a_round_trip(offset):
    """A run_after given in any offset Python allows (PostgreSQL refuses offsets past 15:59)
    is the same instant when read back."""
    when = datetime(2031, 6, 1, 12, tzinfo=timezone(offset))
    job = Job.objects.enqueue(TASK, [1, 2], run_after=when)
    back = Job.objects.get(pk=job.pk)
    assert back.run_after == when and back.available_at == when
    assert dj_timezone.is_aware(back.run_after)


# -- PostgreSQL: a task's shared options bound into the statement once ---------------------

# Text the driver's quoting must carry through, and a % that a second binding (the args and
# kwargs) must not take for a placeholder.
_bound_text = st.lists(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")
    | st.sampled_from(["%", "%s", "%(args)s", "'", '"', "\\", "$1", "::", ")"]),
    min_size=1,
    max_size=6,
).map("".join)


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="only PostgreSQL binds a task's options once"
)
@PROPERTY
@given(
    queue_name=_bound_text,
    task_path=_bound_text,
    args=_good_args,
    retry=st.lists(seconds, max_size=2),
)
def test_property_options_bound_into_the_insert_are_stored_as_given(
    queue_name, task_path, args, retry
):
    """(6) The one-row INSERT with a task's options bound in once (quoted by the driver)
    stores any text they hold exactly, whatever quotes, backslashes or % it holds, and the
    args bound per call beside them; the cached statement serves the next call the same."""
    try:
        fields = inserts.EnqueueOptions(queue_name=queue_name, retry=retry).check(task_path)
        checked = ensure_json(args, "args")
    except (InvalidLeaseOption, InvalidJobArgument):
        return
    assert inserts._pg_bound_sql(Job, "default", fields, inserts._RETURNED) is not None
    for _ in range(2):
        with transaction.atomic():
            job = inserts._pg_insert_one(Job, "default", fields, checked, {"q": queue_name})
        back = Job.objects.get(pk=job.pk)
        assert (back.queue_name, back.task_path) == (queue_name, task_path)
        assert same(checked, back.args) and back.kwargs == {"q": queue_name}
        assert back.retry == fields.retry_json()


def _spellings(pk: int) -> list[object]:
    """Other ways to write job ``pk``'s id, none of them the id the backend handed out."""
    arabic_indic = str(pk).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    return [f" {pk} ", f"+{pk}", f"0{pk}", f"{pk}\n", f"{pk}.0", arabic_indic, float(pk), True]


@PROPERTY
@given(
    asked=st.one_of(
        st.text(max_size=25),
        st.integers(),
        st.sampled_from(["9" * 23, str(2**63), str(2**63 - 1), "-1", "0", ""]),
        st.integers(0, 7),  # an index into _spellings() of the job's own id
    ),
    spelled=st.booleans(),
)
def test_property_a_result_id_reads_its_own_job_or_does_not_exist(asked, spelled):
    """(6) Whatever id a caller passes to get_result() (a polling view passing a user's
    text on): the TaskResult of the job the backend handed that very id out for, or
    TaskResultDoesNotExist; never the driver's OverflowError or DataError (before: a
    23-digit id raised OverflowError on SQLite), nor another spelling's job (before:
    " 2 ", "+2" and "٢" read job 2)."""
    from django.tasks.exceptions import TaskResultDoesNotExist

    result = add.enqueue(1, 2)
    pk = int(result.id)
    if spelled and isinstance(asked, int) and 0 <= asked < 8:
        asked = _spellings(pk)[asked]
    try:
        again = add.get_result(asked)
    except TaskResultDoesNotExist:
        event("does not exist")
        assert not (type(asked) in (str, int) and str(asked) == result.id)  # its own reads
        return
    event("read")
    assert isinstance(asked, str | int) and not isinstance(asked, bool)
    assert again.id == str(asked)


def test_other_spellings_of_an_id_and_ids_past_a_key_name_no_job():
    """(6) The examples the property may not draw: each other spelling of a job's id, and
    ids past what a job's key holds, through get_result() and aget_result()."""
    from django.tasks.exceptions import TaskResultDoesNotExist

    result = add.enqueue(1, 2)
    pk = int(result.id)
    assert add.get_result(result.id).id == result.id
    assert add.get_result(pk).id == result.id
    for asked in [*_spellings(pk), "9" * 23, str(2**63), -pk, 2**70, None, [pk]]:
        with pytest.raises(TaskResultDoesNotExist):
            add.get_result(asked)
        with pytest.raises(TaskResultDoesNotExist):
            async_to_sync(add.aget_result)(asked)
