"""The engine's measured prefill rate (engine/prefill_rate.py): prompt tokens over the seconds
they added to the steps that computed them, over the last steps that prefilled."""

from __future__ import annotations

import pytest

from engine.prefill_rate import MIN_TOKEN_S, PrefillRate


def test_no_rate_until_a_step_has_prefilled() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None and rate.step_s is None
    rate.record(0, 0.02)  # a decode-only step
    rate.record(5, 0.0)  # timed at nothing
    assert rate.tokens_per_s is None
    assert rate.step_s == pytest.approx(0.02)  # the fixed part, from the decode-only step


def test_without_steps_to_compare_the_rate_is_tokens_over_the_steps_time() -> None:
    rate = PrefillRate(num_steps=3)
    rate.record(1000, 0.5)
    assert rate.tokens_per_s == pytest.approx(2000.0)
    rate.record(3000, 0.5)  # weighed by time, not a mean of the two rates
    assert rate.tokens_per_s == pytest.approx(4000.0)
    rate.record(600, 0.1)
    rate.record(600, 0.1)  # the first step leaves the window of three
    assert rate.tokens_per_s == pytest.approx(4200 / 0.7)


def test_the_fixed_part_of_a_step_comes_off_its_time() -> None:
    rate = PrefillRate(num_steps=2)
    rate.record(0, 0.03)
    rate.record(0, 0.05)  # steps without prefill take 0.04 s
    rate.record(20, 0.06)
    rate.record(100, 0.14)  # so 120 tokens added 0.02 + 0.10 s
    assert rate.tokens_per_s == pytest.approx(1000.0)
    assert rate.step_s == pytest.approx(0.04)  # prefilling steps are not in it
    # Shorter than the fixed part (noise): no time of its own, yet the rate stays bounded.
    rate = PrefillRate()
    rate.record(0, 0.05)
    rate.record(10, 0.04)
    assert rate.tokens_per_s == pytest.approx(1 / MIN_TOKEN_S)
