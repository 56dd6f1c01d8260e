"""What a constrained request's output must be: a JSON object, JSON of a schema, a regex's match
or one of a list of choices; turned into an llguidance grammar and checked at the engine's front.

The names follow OpenAI's `response_format` (json_object, json_schema) and vLLM's extra fields
(`guided_regex`, `guided_choice`); `param` is the field a refusal names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance

from engine.errors import RequestRejected

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_object", "json_schema", "regex", "choice"]

_PARAMS: dict[str, str] = {
    "json_object": "response_format",
    "json_schema": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
}
_ANY_OBJECT = '{"type": "object"}'  # OpenAI's json_object
# One line, spaced as Python's json.dumps: with free whitespace, a sampled output can spend its
# tokens on blank lines between keys and never close.
_JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """`value`: the schema's JSON text (json_schema), the regex (regex) or the choices as a JSON
    list of strings (choice); unused for json_object. Hashable: compiled grammars are cached by
    it."""

    kind: GrammarKind
    value: str = ""

    @property
    def param(self) -> str:
        return _PARAMS[self.kind]

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this spec."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, _JSON_LAYOUT)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value, _JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        choices = json.loads(self.value)
        # Lark string literals take JSON's escapes.
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def check(self) -> None:
        """Raise RequestRejected naming `param` if the grammar is invalid or unsupported."""
        if self.kind == "choice":
            choices = json.loads(self.value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestRejected(self.param, "guided_choice must be non-empty strings")
        try:
            error = llguidance.LLMatcher.validate_grammar(self.grammar())
        except ValueError as exc:  # a schema that is not JSON
            error = str(exc)
        if error:
            raise RequestRejected(self.param, f"invalid {self.kind.replace('_', ' ')}: {error}")
