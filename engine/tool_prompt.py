"""Tools in a conversation, for a chat template that has no tools section of its own (SmolLM2's).

Such a template only knows messages with text, so the conversation is rewritten into those:

- the tools go at the end of the system message (one is added first when there is none), as
  instructions followed by one JSON object per tool, one a line, between `<tools>` and
  `</tools>`, and the call syntax: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's tool calls are appended to its text in that syntax, one a line;
- tool results (role `tool`) become a user message, one `<tool_response>` element per result,
  consecutive results in one message, each a JSON object of the call id, the function's name
  (from the call it answers) and the result's text.

node_agent/tool_calls.py parses the same syntax out of the model's output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

# A message or a tool as JSON-like data (engine/chat_template.py's Message is one).
Message = Mapping[str, object]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_INSTRUCTIONS = (
    "You can call functions to help answer. The functions you can call are listed below, one "
    "JSON object a line, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and its arguments between "
    "<tool_call> and </tool_call>, like this:\n"
    '<tool_call>{{"name": "function_name", "arguments": {{"argument": "value"}}}}</tool_call>\n'
    "To call several, write one <tool_call> a line. The results come back in "
    "<tool_response> elements."
)


def tool_call_text(name: str, arguments: str) -> str:
    """One call in the syntax the model is taught; `arguments` is JSON text, kept as written."""
    return (
        f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{TOOL_CALL_CLOSE}'
    )


def tools_instructions(tools: Sequence[Mapping[str, object]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _INSTRUCTIONS.format(tools=lines)


def with_tools(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, object]] | None,
) -> list[Message]:
    """`messages` as plain text messages, the tools (if any) in the system message."""
    names = {call_id: name for m in messages for call_id, name, _ in _calls(m)}
    rewritten: list[Message] = []
    follows_result = False
    for message in messages:
        is_result = message.get("role") == "tool"
        if is_result:
            response = _tool_response(message, names)
            if follows_result:  # consecutive results: one user turn
                last = rewritten[-1]
                rewritten[-1] = {**last, "content": f"{last['content']}\n{response}"}
            else:
                rewritten.append({"role": "user", "content": response})
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            rewritten.append(_with_calls(message))
        else:
            rewritten.append(message)
        follows_result = is_result
    if tools:
        instructions = tools_instructions(tools)
        if rewritten and rewritten[0].get("role") == "system":
            text = str(rewritten[0].get("content") or "")
            joined = f"{text}\n\n{instructions}" if text else instructions
            rewritten[0] = {**rewritten[0], "content": joined}
        else:
            rewritten.insert(0, {"role": "system", "content": instructions})
    return rewritten


def _calls(message: Message) -> list[tuple[str, str, str]]:
    """An assistant message's tool calls: (id, function name, arguments' JSON text)."""
    calls = message.get("tool_calls")
    found: list[tuple[str, str, str]] = []
    for call in calls if isinstance(calls, Sequence) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(call, Mapping) and isinstance(function, Mapping):
            found.append(
                (str(call.get("id")), str(function.get("name")), str(function.get("arguments")))
            )
    return found


def _with_calls(message: Message) -> Message:
    lines = [str(message["content"])] if message.get("content") else []
    lines += [tool_call_text(name, arguments) for _, name, arguments in _calls(message)]
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": "\n".join(lines)}


def _tool_response(message: Message, names: dict[str, str]) -> str:
    call_id = str(message.get("tool_call_id"))
    result = {
        "tool_call_id": call_id,
        "name": names.get(call_id),
        "content": message.get("content"),
    }
    return f"<tool_response>{json.dumps(result, ensure_ascii=False)}</tool_response>"
