"""fits.py answers once per shape of call what Signature.bind answers for every call.

Invariant (design.md): (6) whatever a caller passes to enqueue is untrusted input: a call
that does not fit is refused, whichever calls of other shapes came before it.
"""

from __future__ import annotations

import functools
import inspect

from hypothesis import given
from hypothesis import strategies as st

from django_leases import fits


def positional_keyword_and_more(a, /, b, c=3, *, d, e=5):
    return a


def open_ended(a, *rest, b=2, **more):
    return a


def takes_nothing():
    return None


FUNCTIONS = [positional_keyword_and_more, open_ended, takes_nothing]
NAMES = ["a", "b", "c", "d", "e", "x"]


def bind_says(func, takes_context, args, kwargs):
    try:
        inspect.signature(func).bind(*([None] if takes_context else []), *args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(FUNCTIONS),
            st.booleans(),
            st.lists(st.integers(), max_size=4),
            st.dictionaries(st.sampled_from(NAMES), st.integers(), max_size=4),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_each_shape_is_answered_as_bind_answers_it(calls):
    """Calls of every shape, in any order and repeated (the second time from what was
    kept): the answer, fitting or the TypeError's words, is bind()'s own."""
    for func, takes_context, args, kwargs in calls * 2:
        assert fits.misfit(func, takes_context, args, kwargs) == bind_says(
            func, takes_context, args, kwargs
        )


def test_a_misfit_is_refused_after_fitting_calls_of_other_shapes():
    fits._shapes.clear()
    assert fits.misfit(positional_keyword_and_more, False, [1, 2], {"d": 4}) is None
    assert fits.misfit(positional_keyword_and_more, False, [1, 2], {}) == (
        "missing a required argument: 'd'"
    )
    # The same count and names with other values: the same answer, kept.
    assert fits.misfit(positional_keyword_and_more, False, ["x", None], {"d": []}) is None
    # A context argument takes the first place.
    assert fits.misfit(positional_keyword_and_more, True, [2], {"d": 4}) is None
    assert fits.misfit(positional_keyword_and_more, True, [1, 2], {"d": 4}) is None
    assert fits.misfit(positional_keyword_and_more, True, [1, 2, 3, 4], {"d": 4}) == (
        "too many positional arguments"
    )


def test_what_is_kept_is_bounded(monkeypatch):
    monkeypatch.setattr(fits, "MAX_KEPT", 8)
    fits._shapes.clear()
    for n in range(20):
        assert fits.misfit(positional_keyword_and_more, False, [0] * n, {"d": 1}) == bind_says(
            positional_keyword_and_more, False, [0] * n, {"d": 1}
        )
        assert 0 < len(fits._shapes) <= 8


def test_names_a_caller_made_up_are_never_kept():
    """Keyword names and counts come from the caller: only names of the function's own
    parameters, and a bounded count, make a shape that is kept, so a caller cannot grow the
    tables with its own."""
    fits._shapes.clear()
    made_up = {"x" * 10_000: 1, "d": 4}
    assert fits.misfit(positional_keyword_and_more, False, [1, 2], made_up) == bind_says(
        positional_keyword_and_more, False, [1, 2], made_up
    )
    # A function that takes **kwargs takes any name: bound every time, nothing kept.
    assert fits.misfit(open_ended, False, [1], {"anything": 1}) is None
    # Passed by keyword, a positional-only parameter is a made-up name too.
    assert fits.misfit(positional_keyword_and_more, False, [2], {"a": 1, "d": 4}) == bind_says(
        positional_keyword_and_more, False, [2], {"a": 1, "d": 4}
    )
    # Nor can a count of positional arguments of the caller's choosing.
    many = [0] * (fits.MAX_POSITIONAL + 1)
    assert fits.misfit(positional_keyword_and_more, False, many, {"d": 4}) == bind_says(
        positional_keyword_and_more, False, many, {"d": 4}
    )
    assert fits._shapes == {}


def test_keywords_that_are_no_mapping_are_refused_not_kept():
    """Both callers pass a dict; should anything else arrive (a list of the same names), it
    is refused as bind refuses it, and never answered from a dict's shape."""
    fits._shapes.clear()
    assert fits.misfit(positional_keyword_and_more, False, [1, 2], {"d": 4}) is None
    answer = fits.misfit(positional_keyword_and_more, False, [1, 2], ["d"])
    assert answer is not None and "must be a mapping" in answer, answer


def test_a_callable_with_no_signature_to_read_is_left_to_the_call():
    """max has no signature inspect can read: no refusal ahead of the call, which decides."""
    assert fits.signature_of(max) is None
    assert fits.misfit(max, False, [], {"nonsense": 1}) is None


class Unhashable:
    """A callable that cannot be a key (``__hash__ = None``, as a class defining ``__eq__``
    alone has): a project's handler object, say."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return self is other

    def __call__(self, a, b=2, *, c):
        return a


def test_an_unhashable_callable_is_answered_every_time_and_never_kept():
    """(6) A callable that cannot be a key of fits' tables is bound at each call, as bind
    answers it, whatever the shape; nothing of it is kept (the lookups' TypeError is
    caught, not raised to the caller)."""
    handler = Unhashable()
    for table in (fits._signatures, fits._keywords, fits._shapes):
        table.clear()
    calls = [([1], {"c": 3}), ([], {"c": 3}), ([1, 2, 3], {"c": 3}), ([1], {"x": 1, "c": 3})]
    for args, kwargs in calls * 2:
        assert fits.misfit(handler, False, args, kwargs) == bind_says(handler, False, args, kwargs)
        assert fits.misfit(handler, True, args, kwargs) == bind_says(handler, True, args, kwargs)
    assert fits.misfit(handler, False, [], {"c": 3}) is not None  # the check can refuse
    assert str(fits.signature_of(handler)) == "(a, b=2, *, c)"
    assert (fits._signatures, fits._keywords, fits._shapes) == ({}, {}, {})


def with_client(func):
    """A decorator that passes its function's first argument itself."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func("client", *args, **kwargs)

    return wrapper


@with_client
def sync_user(client, user_id):
    return client, user_id


def test_a_decorated_function_is_answered_by_what_is_called_not_what_it_wraps():
    """(6) A decorator's wrapper is what a worker calls: a call fits it (and then its own
    call of the function), not the signature functools.wraps points at. Before, a call
    of sync_user(5) was refused ("missing a required argument: 'user_id'") though it runs
    under Django's own backends."""
    assert fits.misfit(sync_user, False, [5], {}) is None
    assert sync_user(5) == ("client", 5)

    @functools.wraps(sync_user)
    def strict(user_id):
        return user_id

    assert "user_id" in fits.misfit(strict, False, [], {})
