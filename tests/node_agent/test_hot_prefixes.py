"""The prefix keys a node reports in its beats: those served within the age limit, sorted,
at most the bound; anything not shaped as a key is ignored."""

from __future__ import annotations

import pytest

from node_agent.hot_prefixes import HotPrefixes

A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_keys_served_lately_sorted_and_aged_out() -> None:
    now = [0.0]
    hot = HotPrefixes(max_age_s=10.0, max_keys=2, clock=lambda: now[0])
    for key in (B, A, None, "not-a-key", "A" * 16):
        hot.seen(key)
    assert hot.hot() == (A, B)
    now[0] = 5.0
    hot.seen(B)  # served again: younger
    hot.seen(C)  # over the bound: A, the least recent, goes
    assert hot.hot() == (B, C)
    now[0] = 15.5
    assert hot.hot() == ()


def test_the_bound_is_within_a_beats_limit() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        HotPrefixes(max_keys=65)
