"""Token buckets (the in-process backend): admission, settlement, headers, shares."""

from __future__ import annotations

import asyncio

import pytest

from gateway.keys import ApiKey
from gateway.limits import LocalBuckets, decide, format_duration, refill
from wire.limit_shares import KeyLevels

KEY = ApiKey("key_1", rpm=60, tpm=1000)


def test_admission_takes_one_request_and_the_whole_reservation() -> None:
    admission, requests, tokens = decide(KEY, 1.0, 60.0, 1000.0, 300)
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
    admission, requests, tokens = decide(KEY, 1.0, 5.0, 100.0, 300)
    assert not admission.is_allowed and admission.limited_by == "tokens"
    assert (requests, tokens) == (5.0, 100.0)
    assert admission.retry_after_s == pytest.approx(12.0)  # 200 tokens short at 16.7/s
    assert admission.headers()["retry-after"] == "12"
    assert admission.headers()["retry-after-ms"] == "12000"
    by_requests, _, _ = decide(KEY, 1.0, 0.5, 1000.0, 10)
    assert by_requests.limited_by == "requests"
    assert by_requests.retry_after_s == pytest.approx(0.5)


def test_a_reservation_over_the_whole_tpm_is_too_large() -> None:
    admission, _, _ = decide(KEY, 1.0, 60.0, 1000.0, 1001)
    assert not admission.is_allowed and admission.is_too_large


def test_refill_is_linear_and_capped() -> None:
    assert refill(0.0, 60, 1.0, 1.0) == pytest.approx(1.0)
    assert refill(59.5, 60, 1.0, 10.0) == 60.0
    assert refill(10.0, 60, 1.0, -5.0) == 10.0  # a clock step back never drains


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0204, "20ms"), (1.0, "1s"), (1.5, "1.5s"), (360.0, "6m0s"), (61.2, "1m1s")],
)
def test_durations_are_formatted_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_local_buckets_settle_unused_tokens_back() -> None:
    async def run() -> None:
        buckets = LocalBuckets()
        first = await buckets.admit(KEY, 1.0, 900)
        assert first.is_allowed and not first.is_shared
        assert not (await buckets.admit(KEY, 1.0, 900)).is_allowed
        await buckets.settle(KEY, 1.0, first, 850)  # used 50 of the 900
        second = await buckets.admit(KEY, 1.0, 900)
        assert second.is_allowed
        await buckets.settle(KEY, 1.0, second, -500)  # the prompt was underestimated: into debt
        refused = await buckets.admit(KEY, 1.0, 10)
        assert not refused.is_allowed and refused.token_level < 0

    asyncio.run(run())


def test_local_buckets_keep_keys_apart_and_follow_new_limits() -> None:
    async def run() -> None:
        buckets = LocalBuckets()
        small = ApiKey("key_2", rpm=1, tpm=1000)
        assert (await buckets.admit(small, 1.0, 1)).is_allowed
        assert not (await buckets.admit(small, 1.0, 1)).is_allowed
        assert (await buckets.admit(KEY, 1.0, 1)).is_allowed
        raised = ApiKey("key_2", rpm=120, tpm=1000)  # a new snapshot with a higher limit
        admission = await buckets.admit(raised, 1.0, 1)
        assert admission.rpm == 120

    asyncio.run(run())


def test_a_share_sizes_the_buckets_and_retry_after_counts_the_whole_key() -> None:
    admission, requests, tokens = decide(KEY, 0.25, 15.0, 250.0, 100)
    assert admission.is_allowed and (requests, tokens) == (14.0, 150.0)
    headers = admission.headers()
    assert headers["x-ratelimit-limit-tokens"] == "1000"  # the key's limit
    assert headers["x-ratelimit-remaining-tokens"] == "150"  # what is left of it here
    assert headers["x-ratelimit-reset-tokens"] == "24s"  # 100 tokens at 250/60 a second
    # 400 tokens cannot fit in a quarter of 1000: the soonest is when the key's rate comes here.
    refused, _, _ = decide(KEY, 0.25, 15.0, 250.0, 400)
    assert not refused.is_allowed and refused.retry_after_s == pytest.approx(9.0)


def test_a_shrunk_share_counts_at_once_a_grown_one_from_the_next_touch() -> None:
    clock = [1000.0]

    def now() -> float:
        return clock[0]

    async def run() -> None:
        buckets = LocalBuckets()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("gateway.limits.time.monotonic", now)
            first = await buckets.admit(KEY, 0.5, 500)  # the whole half
            assert first.is_allowed and first.token_level == 0.0
            clock[0] += 6.0  # at a tenth, 6 s refill 10 tokens (not 50 at the half)
            assert (await buckets.admit(KEY, 0.1, 10)).is_allowed
            assert not (await buckets.admit(KEY, 0.1, 1)).is_allowed
            clock[0] += 6.0  # grown back to a half: the 6 s since count at the tenth
            refused = await buckets.admit(KEY, 0.5, 11)
            assert not refused.is_allowed and refused.token_level == pytest.approx(10.0)
            clock[0] += 6.0  # now at the half: 50 more
            assert (await buckets.admit(KEY, 0.5, 60)).is_allowed
            # A bucket never holds more than its share now.
            clock[0] += 600.0
            assert (await buckets.admit(KEY, 0.2, 1)).token_level == pytest.approx(199.0)

    asyncio.run(run())


def test_seeded_levels_start_the_buckets_in_debt() -> None:
    async def run() -> None:
        buckets = LocalBuckets()
        assert buckets.needs_levels
        await buckets.seed([KeyLevels(key_id=KEY.id, request_level=30.0, token_level=-400.0)])
        assert not buckets.needs_levels
        refused = await buckets.admit(KEY, 1.0, 1)
        assert not refused.is_allowed and refused.token_level < -390

    asyncio.run(run())
