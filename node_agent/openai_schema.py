"""OpenAI request bodies at the HTTP boundary (chat and completions), validated before the engine.

Unknown fields are tolerated, as OpenAI's own servers tolerate them. Fields OpenAI defines that
this node cannot honour (legacy `functions`, echo, suffix, best_of > 1, non-text message parts)
are rejected with 400 rather than ignored. A response_format, guided_regex or guided_choice
constrains the output (structured_output.py).
`n` choices are checked against the node's limit in `serving.py`; tools in `tool_schema.py`.
`ignore_eos` and `top_k` are accepted as vLLM accepts them, for benchmarks.
`max_tokens: null` means absent, as at OpenAI: 16 on /v1/completions, and on chat as many as the
context leaves.
Text with a lone surrogate (JSON's "\ud800" unpaired) is refused with 400: it is not Unicode, so
no tokenizer or UTF-8 encoder downstream can take it.
Responses are plain dicts built in `responses.py`: no pydantic in the token loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import compress, count, repeat
from operator import is_
from typing import Annotated, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.grammar_spec import GrammarSpec
from engine.sampling_params import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS
from node_agent.cache_salt import MAX_CACHE_SALT_LEN
from node_agent.request_docs import describe
from node_agent.structured_output import GuidedChoice, ResponseFormat, grammar_of
from node_agent.tool_schema import (
    ToolCallIn,
    ToolChoice,
    ToolDefinition,
    check_tool_choice,
    check_tools,
)
from wire.output_limit import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_output_limit,
    completions_output_limit,
)

MAX_STOP_STRINGS = 16
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINER_TYPES = frozenset({list, dict})

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
PromptInput = str | Annotated[list[int], Field(min_length=1)] | list[str] | list[list[int]]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=describe)


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessageIn:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def lone_surrogate_at(value: object, path: str) -> str | None:
    """Where in `value` (JSON data) a string holds a lone surrogate, or None.

    Iterative: the parser allows nesting deeper than the room left on Python's stack here. It
    runs on the event loop, so lists and objects are gone through in C (`_queue_children`): a
    prompt of a million token ids, or an object of a million keys, costs no Python step each.
    """
    # Each item's place links back through its parents: (parent's place, key or index), or None.
    pending: list[tuple[object, object]] = [(value, None)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path + _spelled(where)
        elif isinstance(item, dict):
            keys = list(item)
            if _any_string_has_surrogate(keys, list(map(type, keys))):
                return path + _spelled(where)
            _queue_children(pending, list(item.values()), keys, where)
        elif isinstance(item, list):
            _queue_children(pending, item, count(), where)
    return None


def _queue_children(
    pending: list[tuple[object, object]],
    children: list[object],
    steps: Iterable[object],
    where: object,
) -> None:
    """Queue the children that may hold a lone surrogate, each with its place: strings only if
    one of them does (all searched at once), and lists and objects."""
    types = list(map(type, children))
    placed = zip(children, zip(repeat(where), steps), strict=False)
    if _any_string_has_surrogate(children, types):
        pending.extend(placed)
    else:
        pending.extend(compress(placed, map(_CONTAINER_TYPES.__contains__, types)))


def _any_string_has_surrogate(items: list[object], types: list[type]) -> bool:
    # A surrogate in a Python string is always a lone one (JSON's pairs decode to one code
    # point), so joining strings cannot make or hide one.
    strings = compress(items, map(is_, types, repeat(str)))
    return _SURROGATE.search("".join(cast(Iterable[str], strings))) is not None


def _spelled(where: object) -> str:
    steps: list[str] = []
    while isinstance(where, tuple):
        where, step = where
        steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "".join(reversed(steps))


class SamplingRequest(_Lenient):
    """Fields both endpoints share."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    max_tokens: MaxTokens | None = Field(
        default=None,
        description=(
            "The most tokens to generate; null or absent: as many as the context leaves after "
            "the prompt (and any resumed ids)."
        ),
    )
    stop: Stop | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Choices to make of the prompt: at most the node's max_num_choices."
    )
    user: str | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> a bias in [-100, 100] on its logit."
    )
    # vLLM's extras: sampling controls, and a grammar the output must follow
    # (structured_output.py).
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    guided_regex: str | None = None
    guided_choice: GuidedChoice | None = None
    # vLLM's: prefix-cache hits only among requests of the same salt (see cache_salt.py).
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_LEN)] | None = None
    # Resuming a generation elsewhere (wire/resume.py): ids out, and ids to continue after.
    return_token_ids: bool = False
    resume_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = (
        Field(
            default=None,
            description=(
                "A gateway's own field: output ids an earlier attempt generated, to continue "
                "after; they count as prompt tokens. Accepted only with the serving token."
            ),
        )
    )

    @field_validator("*", mode="before")
    @classmethod
    def _unicode_text(cls, value: object, info: ValidationInfo) -> object:
        field = str(info.field_name)
        where = lone_surrogate_at(value, field)
        if where is not None:
            at = "" if where == field else f" at {where}"
            raise ValueError(
                f"the text{at} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not valid Unicode"
            )
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty_in_range(cls, value: float | None) -> float | None:
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_bounded_biases(
        cls, value: dict[str, float] | None
    ) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingRequest:
        self.grammar  # noqa: B018 - raises if several fields ask for a grammar
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must follow, if any field asks for one."""
        return grammar_of(None, self.guided_regex, self.guided_choice)

    @property
    def engine_logit_bias(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = Field(
        default=None,
        description="The newer name of `max_tokens`, read first; null or absent: `max_tokens`.",
    )
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # after `tools`: its check reads them
    parallel_tool_calls: bool = True
    functions: list[dict[str, object]] | None = None
    response_format: ResponseFormat | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        return check_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        return check_tool_choice(value, info.data.get("tools"), "tools" in info.data)

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list[dict[str, object]] | None) -> list[dict[str, object]] | None:
        if value:
            raise ValueError("the legacy `functions` field is not supported: send `tools`")
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        return grammar_of(self.response_format, self.guided_regex, self.guided_choice)

    @property
    def max_output_tokens(self) -> int | None:
        return chat_output_limit(lambda name: getattr(self, name))

    @property
    def engine_logprobs(self) -> int | None:
        """The engine's `logprobs`: None for none, else how many top candidates to return."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: MaxTokens | None = Field(
        default=COMPLETIONS_DEFAULT_MAX_TOKENS,
        description=(
            "The most tokens to generate; null or absent: "
            f"{COMPLETIONS_DEFAULT_MAX_TOKENS}, OpenAI's default for legacy completions."
        ),
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: PromptInput) -> PromptInput:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            if isinstance(value[0], list) and not value[0]:
                raise ValueError("the prompt is empty")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, value: int | None) -> int:
        return completions_output_limit(value)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]
        if isinstance(first, int):
            return [p for p in prompt if isinstance(p, int)]
        return first
