"""Budgets and spend at one gateway process (gateway/spend.py) and admission on a key's limits
per model (gateway/limit_shares.py PopLimiter): plain values, a fake clock, local buckets."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admit import budget_error, rate_limit_error
from gateway.keys import ApiKey, KeyBudget
from gateway.limit_shares import PopLimiter, ShareTable, UsageMeter
from gateway.limits import LocalBuckets
from gateway.spend import SpendBook
from wire.key_snapshot import KeyGrant
from wire.limit_shares import KeySpent, ShareAnswer, model_entry

DAY_S = 86_400
NOW = 100 * DAY_S + 3600.0  # 01:00 UTC
MODEL = "smollm2-135m-instruct"
BUDGETED = ApiKey("key_b", 1000, 100_000, budget=KeyBudget(max_tokens=100, period_s=DAY_S))


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def answered(book: SpendBook, spent: int, start: float = NOW - 3600.0) -> None:
    batch = book.take()
    book.answered(batch, [KeySpent(key_id="key_b", period_start=int(start), spent_tokens=spent)])


def test_a_budget_admits_until_spent_here_and_elsewhere_then_says_when_it_resets() -> None:
    clock = Clock()
    book = SpendBook(clock)
    assert book.reserve(BUDGETED, 60) is None
    assert book.reserve(BUDGETED, 60) is None  # 60 held: below the budget still
    refused = book.reserve(BUDGETED, 1)  # 120 held: the budget is taken by requests in flight
    assert refused is not None and refused.resets_at == NOW - 3600 + DAY_S
    book.settle(BUDGETED, MODEL, 60, 10)
    book.settle(BUDGETED, MODEL, 60, 10)
    assert book.reserve(BUDGETED, 60) is None  # 20 spent here
    book.release(BUDGETED, 60)  # refused by a rate limit after all

    answered(book, spent=20)  # the control plane has this process's 20
    assert book.spent_of("key_b") == 20
    assert book.reserve(BUDGETED, 5) is None
    book.settle(BUDGETED, MODEL, 5, 5)
    answered(book, spent=100)  # other PoPs spent the rest
    assert book.reserve(BUDGETED, 1) is not None

    clock.now = NOW + DAY_S  # the next day: the answer was of the last period
    assert book.reserve(BUDGETED, 1) is None


def test_spend_goes_in_batches_and_a_batch_is_sent_again_until_answered() -> None:
    book = SpendBook(Clock())
    plain = ApiKey("key_p", 10, 1000)
    book.settle(plain, MODEL, 50, 12)
    book.settle(plain, "other-model", 50, 3)
    book.settle(plain, "a name that is no model name", 50, 4)
    book.settle(plain, MODEL, 50, 0)  # failed before the node answered: nothing spent
    batch = book.take()
    assert batch is not None
    assert {(s.model, s.num_tokens) for s in batch.spend()} == {
        (MODEL, 12),
        ("other-model", 3),
        ("unknown", 4),
    }
    book.settle(plain, MODEL, 50, 1)
    assert book.take() is batch  # its report failed: the same id again, the new spend waits
    book.answered(batch, [])
    later = book.take()
    assert later is not None and later.id != batch.id
    assert [(s.model, s.num_tokens) for s in later.spend()] == [(MODEL, 1)]
    book.answered(later, [])
    assert book.take() is None


def limiter_with(key_share: float = 1.0) -> PopLimiter:
    shares = ShareTable()
    shares.replace(ShareAnswer(default_share=key_share))
    return PopLimiter(LocalBuckets(), shares, UsageMeter(), SpendBook())


def key_of(**grant: object) -> ApiKey:
    values: dict[str, object] = {
        "id": "key_m",
        "tenant": None,
        "secret_sha256": "0" * 64,
        "rpm": 100,
        "tpm": 100_000,
    }
    return ApiKey.of(KeyGrant.model_validate(values | grant))


def test_a_model_limit_refuses_on_its_own_and_gives_the_keys_request_back() -> None:
    key = key_of(model_limits={MODEL: {"rpm": 2, "tpm": 1000}})
    limiter = limiter_with()

    async def run() -> None:
        for _ in range(2):
            admitted = await limiter.admit(key, MODEL, 100, key.model_limits.get(MODEL))
            assert admitted.is_allowed and admitted.on_model is not None
        refused = await limiter.admit(key, MODEL, 100, key.model_limits.get(MODEL))
        assert not refused.is_allowed and refused.refused_on_model
        assert refused.admission.limited_by == "requests" and refused.admission.rpm == 2
        error = rate_limit_error(refused, 100)
        assert error.code == "rate_limit_exceeded"
        assert f"requests per min (RPM) on model {MODEL}: Limit 2" in error.message
        assert "retry-after" in error.headers
        # The key's own buckets hold two requests taken, not three.
        levels = limiter.buckets.levels_of("key_m")
        assert levels is not None and levels.request_level == pytest.approx(98.0, abs=0.1)
        assert (
            await limiter.admit(key, "other-model", 100, key.model_limits.get("other-model"))
        ).is_allowed  # no limit there
        too_large = await limiter.admit(key, MODEL, 5000, key.model_limits.get(MODEL))
        assert (
            too_large.admission.is_too_large
            and "(TPM) on model" in rate_limit_error(too_large, 5000).message
        )

    asyncio.run(run())
    asked = limiter.meter.take()
    assert asked[model_entry("key_m", MODEL)].num_requests == 3
    assert asked["key_m"].num_requests == 5


def test_settling_gives_back_to_both_entries_and_counts_the_spend_per_model() -> None:
    key = key_of(model_limits={MODEL: {"rpm": 10, "tpm": 1000}})
    limiter = limiter_with()

    async def run() -> None:
        admission = await limiter.admit(key, MODEL, 400, key.model_limits.get(MODEL))
        await limiter.settle(key, admission, 400 - 30)  # used 30

    asyncio.run(run())
    on_model = limiter.buckets.levels_of(model_entry("key_m", MODEL))
    assert on_model is not None and on_model.token_level == pytest.approx(970.0, abs=1.0)
    batch = limiter.spend.take()
    assert batch is not None and batch.tokens == {("key_m", MODEL): 30}


def test_an_exhausted_budget_is_a_429_that_says_when_it_resets() -> None:
    key = key_of(max_budget_tokens=50, budget_period_s=DAY_S)
    limiter = limiter_with()

    async def run() -> None:
        admission = await limiter.admit(key, MODEL, 60, key.model_limits.get(MODEL))
        await limiter.settle(key, admission, 0)  # used all 60
        refused = await limiter.admit(key, MODEL, 10, key.model_limits.get(MODEL))
        assert not refused.is_allowed and refused.admission.limited_by == "budget"
        error = budget_error(key, refused)
        assert error.code == "budget_exceeded" and error.status_code == 429
        assert "budget of 50 tokens per 1d is spent" in error.message
        assert "resets at " in error.message and "Z (in " in error.message
        assert 1 <= int(error.headers["retry-after"]) <= DAY_S
        assert set(error.headers) == {"retry-after", "retry-after-ms"}

    asyncio.run(run())
    levels = limiter.buckets.levels_of("key_m")
    assert levels is not None and levels.request_level == pytest.approx(99.0, abs=0.1)
