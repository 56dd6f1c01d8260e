"""What the agent API's live tests ask of the real SmolLM2, against a node agent and through a
gateway alike (issue 33's "Done when"): 20 prompts `chat.completions.parse` must turn into a
`Person`, and two tools whose arguments must validate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
from openai.types.chat import ChatCompletionToolParam
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
