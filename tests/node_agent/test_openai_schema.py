"""Request validation at the HTTP boundary (no engine involved)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from node_agent.openai_schema import ChatCompletionRequest, CompletionRequest, lone_surrogate_at

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_and_derived_values() -> None:
    body = ChatCompletionRequest.model_validate(
        BASE | {"max_completion_tokens": 5, "max_tokens": 9, "stop": "x"}
    )
    assert body.max_output_tokens == 5  # the newer name wins
    assert body.stop_strings == ["x"]
    assert body.engine_logprobs is None
    assert not body.include_usage
    with_logprobs = ChatCompletionRequest.model_validate(
        BASE | {"logprobs": True, "top_logprobs": 3}
    )
    assert with_logprobs.engine_logprobs == 3
    assert ChatCompletionRequest.model_validate(BASE | {"logprobs": True}).engine_logprobs == 0


def test_text_parts_are_joined_and_unknown_fields_kept() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "future": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    )
    assert body.messages[0].text == "ab"
    assert body.model_extra == {"future": 1}


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 0},
        {"temperature": 2.5},
        {"top_p": 0},
        {"max_tokens": 0},
        {"top_logprobs": 2},
        {"top_logprobs": 21, "logprobs": True},
        {"stream_options": {"include_usage": True}},
        {"frequency_penalty": 2.5},
        {"logit_bias": {"x": 5}},
        {"logit_bias": {"1": 101}},
        {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
        {"guided_choice": []},
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_schema"}},
        {"stop": ["a"] * 17},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ],
)
def test_chat_refuses(extra: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(BASE | extra)


def test_completion_prompt_forms() -> None:
    assert CompletionRequest(model="m", prompt="a").single_prompt == "a"
    assert CompletionRequest(model="m", prompt=["a"]).single_prompt == "a"
    assert CompletionRequest(model="m", prompt=[1, 2]).single_prompt == [1, 2]
    assert CompletionRequest(model="m", prompt=[[1, 2]]).single_prompt == [1, 2]
    assert CompletionRequest(model="m", prompt="a").max_tokens == 16  # OpenAI's default
    assert (
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "a", "max_tokens": None}
        ).max_tokens
        == 16
    )  # null means absent, as at OpenAI
    assert (
        ChatCompletionRequest.model_validate(BASE | {"max_tokens": None}).max_output_tokens is None
    )
    bad_prompts: list[object] = [["a", "b"], [[1], [2]], [[]], []]
    for bad in bad_prompts:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})
    for extra in ({"echo": True}, {"suffix": "x"}, {"best_of": 2}, {"logprobs": 21}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": "a"} | extra)


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ([{"content": [{"text": "ok"}, {"text": "x\ud800"}]}], "f[0].content[1].text"),
        ({"k\udc00": 1}, "f"),
        ([1, 2.5, None, [3, "\ud801"]], "f[3][1]"),
        ([1, "a", {"b": ["c", "\udfff"]}], "f[2].b[1]"),
        ("\ud800", "f"),
        ([5] * 1000 + ["fine", {"k": "v"}, "🤖"], None),
    ],
)
def test_a_lone_surrogate_is_found_with_its_path(value: object, where: str | None) -> None:
    assert lone_surrogate_at(value, "f") == where
