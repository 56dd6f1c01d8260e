"""The OpenAI fields that constrain an output, read into the engine's grammar spec: chat's
`response_format` (text, json_object, json_schema) and vLLM's `guided_regex` / `guided_choice`
on both endpoints. At most one may constrain a request.

A schema is passed to the engine as the client sent it; whether it compiles (and whether it uses
a feature the grammar library does not support) is the engine front's check, a 400 naming
`response_format` (engine/request_limits.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.grammar_spec import GrammarSpec
from node_agent.request_docs import describe

MAX_GUIDED_CHOICES = 256


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, json_schema_extra=describe)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: kept under another name.
    json_schema: dict[str, object] = Field(default_factory=dict, alias="schema")
    # Followed strictly or not, the output follows the schema: constrained decoding is exact.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=describe)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        assert self.json_schema is not None
        return GrammarSpec("json_schema", json.dumps(self.json_schema.json_schema))


GuidedChoice = Annotated[
    list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)
]


def grammar_of(
    response_format: ResponseFormat | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
) -> GrammarSpec | None:
    """The one grammar these fields ask for, or None; ValueError if more than one does."""
    specs = [
        response_format.grammar() if response_format is not None else None,
        GrammarSpec("regex", guided_regex) if guided_regex is not None else None,
        GrammarSpec("choice", json.dumps(guided_choice)) if guided_choice is not None else None,
    ]
    asked = [s for s in specs if s is not None]
    if len(asked) > 1:
        raise ValueError(
            "only one of response_format (json), guided_regex and guided_choice may be given"
        )
    return asked[0] if asked else None
