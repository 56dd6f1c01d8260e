"""The check at the engine's front (engine/request_limits.py): each refusal names the argument at
fault, and the context is counted exactly, resumed output included."""

from __future__ import annotations

import pickle

import pytest

from engine.errors import RequestRejected
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams

LIMITS = RequestLimits(max_model_len=1024, vocab_size=100)


def refusal(
    token_ids: list[int],
    params: SamplingParams | None = None,
    resumed: list[int] | None = None,
    cache_salt: str | None = None,
    clamp_max_tokens: bool = True,
) -> RequestRejected:
    with pytest.raises(RequestRejected) as refused:
        LIMITS.check(
            token_ids,
            params or SamplingParams(),
            resumed,
            cache_salt,
            clamp_max_tokens=clamp_max_tokens,
        )
    return refused.value


def test_a_prompt_is_counted_exactly_with_its_resumed_ids() -> None:
    LIMITS.check([5] * 1000, SamplingParams(max_tokens=None), [5] * 23)
    refused = refusal([5] * 1000, resumed=[5] * 24)
    assert (refused.param, refused.exceeds_context) == ("prompt", True)
    assert str(refused) == (
        "This model's maximum context length is 1024 tokens. However, your prompt has 1024 "
        "tokens, and at least one must be left to generate."
    )


def test_max_tokens_is_a_cap_for_the_engine_and_must_fit_for_openai() -> None:
    params = SamplingParams(max_tokens=100)
    LIMITS.check([5] * 1000, params)  # the engine stops at the context's end instead
    refused = refusal([5] * 1000, params, resumed=[5] * 4, clamp_max_tokens=False)
    assert (refused.param, refused.exceeds_context) == ("max_tokens", True)
    assert "requested 1104 tokens (1004 in the prompt, 100 for the completion)" in str(refused)
    LIMITS.check([5] * 900, params, [5] * 24, clamp_max_tokens=False)


def test_a_lower_bound_says_at_least() -> None:
    with pytest.raises(RequestRejected, match="has at least 1030 tokens") as refused:
        LIMITS.check_fits(1030, None, is_at_least=True)
    assert refused.value.param == "prompt"
    with pytest.raises(RequestRejected, match="requested at least 1100 tokens") as refused:
        LIMITS.check_fits(1000, 100, is_at_least=True)
    assert refused.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("token_ids", "resumed", "params", "cache_salt", "param", "message"),
    [
        ([], None, SamplingParams(), None, "prompt", "the prompt is empty"),
        ([5, 100], None, SamplingParams(), None, "prompt", "prompt token ids must be in [0, 100)"),
        ([5, -1], None, SamplingParams(), None, "prompt", "prompt token ids must be in [0, 100)"),
        ([5], [100], SamplingParams(), None, "resumed_token_ids", "resumed token ids must be in"),
        ([5], None, SamplingParams(stop_token_ids=[100]), None, "stop_token_ids", "must be in"),
        ([5], None, SamplingParams(), "", "cache_salt", "cache_salt must be a non-empty string"),
    ],
)
def test_each_refusal_names_the_argument_at_fault(
    token_ids: list[int],
    resumed: list[int] | None,
    params: SamplingParams,
    cache_salt: str | None,
    param: str,
    message: str,
) -> None:
    refused = refusal(token_ids, params, resumed, cache_salt)
    assert (refused.param, refused.exceeds_context) == (param, False)
    assert message in refused.message and str(refused) == refused.message


def test_a_refusal_pickles_with_its_fields() -> None:
    refused = RequestRejected("max_tokens", "too many", exceeds_context=True)
    copy = pickle.loads(pickle.dumps(refused))
    assert (copy.param, copy.message, copy.exceeds_context) == ("max_tokens", "too many", True)
