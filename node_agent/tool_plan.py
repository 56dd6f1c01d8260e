"""What a chat request's tools ask of the prompt and the output.

- `tool_choice` none, or no tools: nothing (the tools are not shown to the model).
- auto: the tools are rendered and the output is parsed for calls.
- a named function: the prompt ends with the call's start, `<tool_call>{"name": "NAME",
  "arguments": `, and the output is constrained to the function's parameters schema (an object
  when it has none), so the arguments always parse and validate (unless cut off by max_tokens).
- required: the prompt ends with `<tool_call>` and the output is constrained to one call object
  of one of the tools, `{"name": ..., "arguments": ...}` with that tool's schema. One call: the
  grammar makes one object.

`parallel_tool_calls: false` stops an unconstrained output at the first call's end. A function
schema the grammar library cannot take is a 400 naming `tools`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import RequestRejected
from engine.grammar_spec import GrammarSpec
from engine.tool_prompt import TOOL_CALL_OPEN
from node_agent.chat_choices import ToolParsing
from node_agent.errors import BadRequestError
from node_agent.openai_schema import ChatCompletionRequest
from node_agent.tool_schema import NamedToolChoice, ToolDefinition

_ANY_OBJECT: dict[str, object] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    parsing: ToolParsing
    grammar: GrammarSpec | None  # what the output must follow; None: free


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """None: no tools in play; else how to prompt, constrain and parse (or a 400)."""
    if not body.tools or body.tool_choice == "none":
        return None
    max_calls = None if body.parallel_tool_calls else 1
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        (tool,) = (t for t in body.tools if t.function.name == choice.function.name)
        name = json.dumps(tool.function.name)
        prefix = f'{TOOL_CALL_OPEN}{{"name": {name}, "arguments": '
        return ToolPlan(ToolParsing(max_calls, prefix), _checked(_parameters(tool)))
    if choice == "required":
        calls = [_call_schema(tool) for tool in body.tools]
        schema: dict[str, object] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolPlan(ToolParsing(max_calls, TOOL_CALL_OPEN), _checked(schema))
    return ToolPlan(ToolParsing(max_calls), None)


def _parameters(tool: ToolDefinition) -> dict[str, object]:
    return tool.function.parameters or _ANY_OBJECT


def _call_schema(tool: ToolDefinition) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _checked(schema: dict[str, object]) -> GrammarSpec:
    spec = GrammarSpec("json_schema", json.dumps(schema))
    try:
        spec.check()
    except RequestRejected as exc:
        raise BadRequestError(
            f"a function's parameters cannot constrain the output: {exc.message}", param="tools"
        ) from exc
    return spec
