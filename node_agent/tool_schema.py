"""OpenAI's function-calling fields at the HTTP boundary: `tools`, `tool_choice`, and the tool
calls and results a conversation carries.

Checked before any work: function names as OpenAI allows them (letters, digits, `_`, `-`, at most
64), no two tools of one name, and a `tool_choice` that names a function names one of `tools`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from node_agent.request_docs import describe

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=describe)


class FunctionDefinition(_Lenient):
    name: FunctionName
    description: str | None = None
    # The arguments' JSON schema; absent: a function of no arguments.
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Lenient):
    name: FunctionName


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Lenient):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(_Lenient):
    """A tool call an earlier assistant message made (sent back with the conversation)."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallIn


def check_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    seen: set[str] = set()
    for tool in tools:
        name = tool.function.name
        if name in seen:
            raise ValueError(f"two tools are named {name!r}: function names must be unique")
        seen.add(name)
    return tools


def check_tool_choice(
    choice: ToolChoice | None, tools: list[ToolDefinition] | None, has_tools_field: bool
) -> ToolChoice | None:
    """`tools` is what validated (`has_tools_field`: whether it did: if not, its own error
    stands and this one would only repeat it)."""
    if choice is None or choice in ("none", "auto") or not has_tools_field:
        return choice
    names = [tool.function.name for tool in tools or ()]
    if not names:
        raise ValueError("tool_choice other than 'none' or 'auto' needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(
            f"tool_choice names {choice.function.name!r}, which is not one of the tools: "
            + ", ".join(names)
        )
    return choice
