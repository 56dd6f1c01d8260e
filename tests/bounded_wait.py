"""Waiting in tests: poll a condition until it holds, for a bounded time, and fail naming what
was awaited (never a fixed sleep that hopes the condition holds by then)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """The first truthy value `check()` returns, polled every `interval_s`; AssertionError if
    none within `timeout_s` (an assertion inside `check` fails at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
