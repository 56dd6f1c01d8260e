"""Chat templates: a model's Jinja template rendered the way Hugging Face transformers renders it.

Templates come with downloaded checkpoints, so they are untrusted code: they run in Jinja's
immutable sandbox. The environment mirrors transformers' `apply_chat_template` (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`) so that a prompt renders byte-identical to what the model was trained on.
A template that reads `tools` renders the tools, tool calls and tool results itself; for one
that does not, the conversation is rewritten into plain messages first (engine/tool_prompt.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils

from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.tool_prompt import with_tools

# A JSON-like value a template may read: messages, tools and extra variables are made of these.
TemplateValue = (
    str | int | float | bool | None | Sequence["TemplateValue"] | Mapping[str, "TemplateValue"]
)
ChatMessage = Mapping[str, TemplateValue]


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str) -> None:
        self.source = source
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateError as exc:
            raise UnsupportedModelError(f"the chat template does not compile: {exc}") from exc
        self.has_tools_section = "tools" in variables

    def __reduce__(self) -> tuple[type[ChatTemplate], tuple[str]]:
        # A compiled template does not pickle; its source does (the tokenizer crosses to the
        # node agent's process from the engine core's, engine/core_client.py).
        return ChatTemplate, (self.source,)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, TemplateValue]] | None = None,
        variables: Mapping[str, TemplateValue] | None = None,
    ) -> str:
        """The prompt text for a conversation; a template error is the request's fault."""
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        context: dict[str, object] = {
            name: _plain(value, "variables") for name, value in (variables or {}).items()
        }
        # transformers drops keys whose value is None, so templates test `'x' in message` alike.
        plain = [_plain_message(message) for message in messages]
        plain_tools = [_plain_message(tool) for tool in tools] if tools is not None else None
        if not self.has_tools_section:
            plain, plain_tools = [dict(m) for m in with_tools(plain, plain_tools)], None
        context["messages"] = plain
        context["tools"] = plain_tools
        context["documents"] = None
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"chat template rejected the conversation: {exc}") from exc


def _plain_message(message: ChatMessage) -> dict[str, object]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"a chat message must be a mapping, got {type(message).__name__}")
    return {str(k): _plain(value, "message") for k, value in message.items() if value is not None}


def _plain(value: object, where: str) -> object:
    """A copy made only of JSON types, so that no object with methods reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, where) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item, where) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item, where) for item in value)
    # Subclasses (enums, numpy scalars) carry extra methods: strip them back to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    raise InvalidRequestError(f"unsupported value of type {type(value).__name__} in {where}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which could reach Python internals."""

    def __init__(*args: object, **kwargs: object) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _check_name(name)
        super().__setitem__(name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only
    need it to compile, so it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - Jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env
