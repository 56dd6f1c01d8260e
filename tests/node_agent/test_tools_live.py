"""Function calling through the official `openai` client against a node agent serving the real
SmolLM2, whose template has no tools section (engine/tool_prompt.py renders them)."""

from __future__ import annotations

import openai
import pytest
from agent_api_cases import ARGUMENTS, CLOCK, WEATHER, ClockArgs
from node_helpers import MODEL_NAME
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)

pytestmark = pytest.mark.slow

ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


def test_a_named_function_is_called_with_arguments_that_validate(
    openai_client: openai.OpenAI,
) -> None:
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        reply = openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=temperature,
            seed=seed,
            max_tokens=40,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_time"
        assert call.id.startswith("call_")
        ClockArgs.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_a_tool_whose_schema_the_arguments_follow(
    openai_client: openai.OpenAI, stream: bool
) -> None:
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        reply = openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=temperature,
            seed=seed,
            max_tokens=40,
        )
        assert reply.choices[0].message.tool_calls is not None
        (call,) = reply.choices[0].message.tool_calls
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        if stream:
            calls = streamed_calls(openai_client, temperature, seed)
            assert calls == [(call.function.name, call.function.arguments)]
        assert reply.choices[0].finish_reason == "tool_calls"
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)


def streamed_calls(
    client: openai.OpenAI, temperature: float, seed: int | None
) -> list[tuple[str, str]]:
    """The calls of a streamed required request, as a client joins its fragments."""
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        temperature=temperature,
        seed=seed,
        max_tokens=40,
        stream=True,
    )
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for item in choice.delta.tool_calls or ():
                assert item.function is not None
                parts = calls.setdefault(item.index, [item.function.name or "", ""])
                parts[1] += item.function.arguments or ""
    assert finish == "tool_calls"
    return [(name, arguments) for name, arguments in calls.values()]


def test_a_streamed_call_arrives_as_openai_streams_it(openai_client: openai.OpenAI) -> None:
    common = {
        "model": MODEL_NAME,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = openai_client.chat.completions.create(**common)  # type: ignore[call-overload]
    stream = openai_client.chat.completions.create(**common, stream=True)  # type: ignore[call-overload]
    items = [item for chunk in stream for c in chunk.choices for item in c.delta.tool_calls or ()]
    first, *rest = items
    # id, type and name first, with empty arguments; then the arguments' fragments alone.
    assert first.id is not None and first.function is not None
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(item.id is None and item.index == 0 for item in rest)
    arguments = "".join(item.function.arguments or "" for item in rest if item.function)
    whole_call = whole.choices[0].message.tool_calls[0]
    assert arguments == whole_call.function.arguments


def test_a_conversation_with_a_tool_result_continues(openai_client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees Celsius."},
    ]
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER], temperature=0, max_tokens=30
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    without_result = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages[:1], tools=[WEATHER], temperature=0, max_tokens=1
    )
    # The call and its result are in the prompt.
    assert reply.usage is not None and without_result.usage is not None
    assert reply.usage.prompt_tokens > without_result.usage.prompt_tokens + 20


def test_tool_choice_none_hides_the_tools(openai_client: openai.OpenAI) -> None:
    with_tools = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=1
    )
    hidden = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    plain = openai_client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1)
    assert with_tools.usage is not None and hidden.usage is not None and plain.usage is not None
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "no-such-type"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ],
)
def test_bad_tools_are_400_with_param(
    openai_client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=MODEL_NAME, messages=ASK, **extra)  # type: ignore[call-overload]
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_a_tool_result_without_its_call_id_is_400(openai_client: openai.OpenAI) -> None:
    messages = [*ASK, {"role": "tool", "content": "Sunny."}]
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=MODEL_NAME, messages=messages)  # type: ignore[arg-type]
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "messages"
