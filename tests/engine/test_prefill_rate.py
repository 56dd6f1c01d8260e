"""The engine's measured prefill rate (engine/prefill_rate.py): prompt tokens over the seconds of
the steps that computed them, over the last steps that prefilled."""

from __future__ import annotations

import pytest

from engine.prefill_rate import PrefillRate


def test_no_rate_until_a_step_has_prefilled() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    rate.record(0, 0.02)  # a decode-only step
    rate.record(5, 0.0)  # timed at nothing
    assert rate.tokens_per_s is None


def test_the_rate_is_tokens_over_seconds_of_the_last_steps() -> None:
    rate = PrefillRate(num_steps=3)
    rate.record(1000, 0.5)
    assert rate.tokens_per_s == pytest.approx(2000.0)
    rate.record(3000, 0.5)  # weighed by time, not a mean of the two rates
    assert rate.tokens_per_s == pytest.approx(4000.0)
    rate.record(0, 9.0)  # decode-only steps do not dilute it
    rate.record(600, 0.1)
    rate.record(600, 0.1)  # the first step leaves the window of three
    assert rate.tokens_per_s == pytest.approx(4200 / 0.7)
