"""The token-bucket limiter (in-process backend): admission, settlement, headers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.keys import ApiKey
from gateway.limits import LocalLimiter, decide, format_duration, refill

KEY = ApiKey("key_1", rpm=60, tpm=1000)


def test_admission_takes_one_request_and_the_whole_reservation() -> None:
    admission, requests, tokens = decide(KEY, 60.0, 1000.0, 300)
    assert admission.is_allowed and admission.limited_by is None
    assert (requests, tokens) == (59.0, 700.0)
    headers = admission.headers()
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "59"
    assert headers["x-ratelimit-remaining-tokens"] == "700"
    assert headers["x-ratelimit-reset-requests"] == "1s"  # one request back per second
    assert headers["x-ratelimit-reset-tokens"] == "18s"  # 300 tokens at 1000/60 a second
    assert "retry-after" not in headers


def test_refusal_takes_nothing_and_says_when_to_retry() -> None:
    admission, requests, tokens = decide(KEY, 5.0, 100.0, 300)
    assert not admission.is_allowed and admission.limited_by == "tokens"
    assert (requests, tokens) == (5.0, 100.0)
    assert admission.retry_after_s == pytest.approx(12.0)  # 200 tokens short at 16.7/s
    assert admission.headers()["retry-after"] == "12"
    assert admission.headers()["retry-after-ms"] == "12000"
    by_requests, _, _ = decide(KEY, 0.5, 1000.0, 10)
    assert by_requests.limited_by == "requests"
    assert by_requests.retry_after_s == pytest.approx(0.5)


def test_a_reservation_over_the_whole_tpm_is_too_large() -> None:
    admission, _, _ = decide(KEY, 60.0, 1000.0, 1001)
    assert not admission.is_allowed and admission.is_too_large


def test_refill_is_linear_and_capped() -> None:
    assert refill(0.0, 60, 1.0) == pytest.approx(1.0)
    assert refill(59.5, 60, 10.0) == 60.0
    assert refill(10.0, 60, -5.0) == 10.0  # a clock step back never drains


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0204, "20ms"), (1.0, "1s"), (1.5, "1.5s"), (360.0, "6m0s"), (61.2, "1m1s")],
)
def test_durations_are_formatted_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_local_limiter_settles_unused_tokens_back() -> None:
    async def run() -> None:
        limiter = LocalLimiter()
        first = await limiter.admit(KEY, 900)
        assert first.is_allowed and not first.is_shared
        assert not (await limiter.admit(KEY, 900)).is_allowed
        await limiter.settle(KEY, first, 850)  # used 50 of the 900
        second = await limiter.admit(KEY, 900)
        assert second.is_allowed
        await limiter.settle(KEY, second, -500)  # the prompt was underestimated: into debt
        refused = await limiter.admit(KEY, 10)
        assert not refused.is_allowed and refused.token_level < 0

    asyncio.run(run())


def test_local_limiter_keeps_keys_apart_and_follows_new_limits() -> None:
    async def run() -> None:
        limiter = LocalLimiter()
        small = ApiKey("key_2", rpm=1, tpm=1000)
        assert (await limiter.admit(small, 1)).is_allowed
        assert not (await limiter.admit(small, 1)).is_allowed
        assert (await limiter.admit(KEY, 1)).is_allowed
        raised = ApiKey("key_2", rpm=120, tpm=1000)  # a new snapshot with a higher limit
        admission = await limiter.admit(raised, 1)
        assert admission.rpm == 120

    asyncio.run(run())
