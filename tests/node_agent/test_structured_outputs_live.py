"""Structured outputs and sampling controls through the official `openai` client against a node
agent serving the real SmolLM2 (its engine core in a process of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from agent_api_cases import check_frequency_penalty, check_grammar_refusals, unparsed_people
from node_helpers import MODEL_NAME, NodeHandle
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel

pytestmark = pytest.mark.slow


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float


@pytest.fixture
def client(real_node: NodeHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=real_node.base_url + "/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_parse_returns_a_parsed_object_for_every_prompt(
    client: openai.OpenAI, temperature: float
) -> None:
    assert unparsed_people(client, MODEL_NAME, temperature) == []


def test_stream_json_object_and_choice(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    finish = [c.finish_reason for c in chunks if c.finish_reason]
    # A small model may nest until max_tokens: then the object is cut off, as OpenAI's is.
    assert text.startswith("{") and finish in (["stop"], ["length"]), (text, finish)
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict), text
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert reply.choices[0].message.content in ("yes", "no")
    parsed = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        response_format=Verdict,
        # Greedy, and room to close the object: sampled at 60 tokens it was once cut off.
        temperature=0,
        max_tokens=150,
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


def test_frequency_penalty_changes_a_repeating_greedy_output(client: openai.OpenAI) -> None:
    check_frequency_penalty(client, MODEL_NAME)


def test_a_grammar_that_cannot_run_is_400_naming_its_field_streamed_or_not(
    client: openai.OpenAI,
) -> None:
    check_grammar_refusals(client, MODEL_NAME)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 250}}, "logit_bias"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ],
)
def test_bad_inputs_are_400_naming_the_param(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            **extra,  # type: ignore[call-overload]
        )
    assert bad.value.param == param


def test_min_tokens_logit_bias_and_stop_token_ids_reach_the_engine(
    client: openai.OpenAI,
) -> None:
    hi: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    short = client.chat.completions.create(
        model=MODEL_NAME,
        messages=hi,
        temperature=0,
        max_tokens=40,
    )
    assert short.usage is not None and short.usage.completion_tokens == 8  # ends at <|im_end|>
    held = client.chat.completions.create(
        model=MODEL_NAME,
        messages=hi,
        temperature=0,
        max_tokens=40,
        extra_body={"min_tokens": 12},
    )
    assert held.usage is not None and held.usage.completion_tokens >= 12
    forced = client.chat.completions.create(
        model=MODEL_NAME,
        messages=hi,
        temperature=0,
        max_tokens=3,
        logit_bias={"28": 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].model_extra is not None
    assert forced.choices[0].model_extra["token_ids"] == [28, 28, 28]
    stopped = client.chat.completions.create(
        model=MODEL_NAME,
        messages=hi,
        temperature=0,
        max_tokens=10,
        logit_bias={"28": 100},
        extra_body={"stop_token_ids": [28]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
