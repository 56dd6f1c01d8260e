"""What the agent API's live tests ask of the real SmolLM2, against a node agent, through a
gateway and through the gateway of `meridian up` alike (issue 33's "Done when"): 20 prompts
`chat.completions.parse` must turn into a `Person`, two tools whose arguments must validate, a
conversation with a tool result, `n=4` with the prompt counted once, and `frequency_penalty`
acting on a greedy output that repeats. Each check takes the official client and the model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import openai
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from pydantic import BaseModel, ConfigDict, Field


class Person(BaseModel):
    # Bounded as a careful schema is: greedy, the 135M model may repeat a name until max_tokens
    # (one of the 20 did), and the grammar ends a string at its maxLength.
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=40)


PERSON_PROMPTS = [
    "Invent a person who lives in Lisbon.",
    "Who wrote Hamlet? Give their name, age at death and city.",
    "Describe a retired teacher.",
    "Make up a character for a novel set in Oslo.",
    "Tell me about a young programmer.",
    "Invent a baker from Vienna.",
    "Describe a sailor you might meet in a harbour town.",
    "Who is a famous painter? Give their name, age and city.",
    "Make up a student who studies music.",
    "Describe a doctor who works in Nairobi.",
    "Invent a gardener in her seventies.",
    "Give me a fictional detective and where he lives.",
    "Describe a chess player from Buenos Aires.",
    "Make up a farmer who keeps bees.",
    "Invent a pilot based in Singapore.",
    "Describe a librarian in a small village.",
    "Who could run a bookshop in Dublin?",
    "Invent a chef who cooks in Tokyo.",
    "Describe a mountain guide from the Alps.",
    "Make up an astronaut in training.",
]

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str


class ClockArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]


ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "get_time": ClockArgs}


def unparsed_people(client: openai.OpenAI, model: str, temperature: float) -> list[object]:
    """`parse` with `Person` of every prompt at once (the node batches them), seeded by its
    place: the content of each reply that did not parse (none, when all is well)."""

    def parse(seed: int, prompt: str) -> object:
        try:
            reply = client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                response_format=Person,
                temperature=temperature,
                seed=seed,
                max_tokens=200,
            )
        except openai.LengthFinishReasonError as cut:  # the client's own refusal to parse
            return cut.completion.choices[0].message.content
        return reply.choices[0].message.parsed

    with ThreadPoolExecutor(len(PERSON_PROMPTS)) as pool:
        replies = list(pool.map(parse, range(len(PERSON_PROMPTS)), PERSON_PROMPTS))
    assert len(replies) == 20
    return [reply for reply in replies if not isinstance(reply, Person)]


ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


def streamed_call(client: openai.OpenAI, **fields: Any) -> tuple[list[tuple[str, str]], str]:
    """The calls of a streamed request as a client joins their fragments, and its finish."""
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            for item in choice.delta.tool_calls or ():
                call = calls.setdefault(item.index, ["", ""])
                assert item.function is not None
                call[0] += item.function.name or ""
                call[1] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, arguments) for name, arguments in calls.values()], finish


def check_required_tool_calls(client: openai.OpenAI, model: str) -> None:
    """`tool_choice: required`, greedy and sampled: one call whose arguments validate against
    its function's schema, the same streamed and not."""
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        fields: dict[str, Any] = {
            "model": model,
            "messages": ASK,
            "tools": [WEATHER, CLOCK],
            "tool_choice": "required",
            "temperature": temperature,
            "seed": seed,
            "max_tokens": 40,
        }
        reply = client.chat.completions.create(**fields)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None
        (call,) = choice.message.tool_calls
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        assert call.id.startswith("call_")
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
        calls, finish = streamed_call(client, **fields)
        assert (calls, finish) == ([(call.function.name, call.function.arguments)], "tool_calls")


def check_tool_result_conversation(client: openai.OpenAI, model: str) -> None:
    """A call, then its result in the conversation: the model goes on with both in its prompt."""
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=30,
    )  # fmt: skip
    assert first.choices[0].message.tool_calls is not None
    (call,) = first.choices[0].message.tool_calls
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius."},
    ]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=20
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert reply.usage is not None and first.usage is not None
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result in it


def check_four_choices(client: openai.OpenAI, model: str) -> None:
    """`n=4`: 4 different choices, the prompt counted once in the usage; streamed the same."""
    fields: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 8,
    }
    one = client.chat.completions.create(**fields)
    four = client.chat.completions.create(n=4, extra_body={"return_token_ids": True}, **fields)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in four.choices)
    assert len({c.message.content for c in four.choices}) > 1
    assert one.usage is not None and four.usage is not None
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    ids = [c.model_extra["token_ids"] for c in four.choices if c.model_extra is not None]
    assert four.usage.completion_tokens == sum(map(len, ids)) and len(ids) == 4
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=4, stream=True, **fields):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in four.choices}


def check_frequency_penalty(client: openai.OpenAI, model: str) -> None:
    """A greedy output that repeats a word repeats it less under `frequency_penalty`."""
    texts = [
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Repeat the word 'apple' fifty times."}],
            temperature=0,
            max_tokens=40,
            frequency_penalty=penalty,
        )
        .choices[0]
        .message.content
        or ""
        for penalty in (0.0, 1.5)
    ]
    assert texts[0].count("apple") > texts[1].count("apple")


GRAMMAR_REFUSALS: list[tuple[dict[str, object], str]] = [
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),  # no character matches
    ({"guided_regex": "(a"}, "guided_regex"),  # does not compile
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
            }
        },
        "response_format",  # a feature the grammar library does not take
    ),
]


def check_grammar_refusals(client: openai.OpenAI, model: str) -> None:
    """A grammar that cannot run is a 400 naming its field, streamed or not: refused before
    any response starts."""
    for fields, param in GRAMMAR_REFUSALS:
        for stream in (False, True):
            try:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4,
                    stream=stream,
                    extra_body=fields,
                )
            except openai.BadRequestError as refused:
                assert refused.param == param, (fields, refused)
            else:
                raise AssertionError(f"{fields} was not refused")
