"""tests/bounded_wait.py: the first truthy value is returned; none in time fails naming the wait."""

from __future__ import annotations

import itertools

import pytest
from bounded_wait import wait_until


def test_the_first_truthy_value_is_returned() -> None:
    answers = iter([0, None, "", "found", "later"])
    assert wait_until(lambda: next(answers), 5.0, "an answer", interval_s=0.001) == "found"


def test_a_condition_never_met_fails_naming_what_was_awaited() -> None:
    calls = itertools.count()
    with pytest.raises(AssertionError, match=r"^timed out after 0.05 s waiting for the moon$"):
        wait_until(lambda: next(calls) < 0, 0.05, "the moon", interval_s=0.01)
    assert next(calls) >= 2  # it polled, and checked once more at the deadline
