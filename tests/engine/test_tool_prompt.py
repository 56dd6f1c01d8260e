"""Tools rendered into a chat: the generic form for a template without a tools section, the
template's own where it has one."""

from __future__ import annotations

import json

from engine.chat_template import ChatMessage, ChatTemplate, TemplateValue
from engine.tool_prompt import tool_call_text, with_tools

# ChatML, as SmolLM2's (no tools section).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WITH_TOOLS_SECTION = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% if message.tool_calls %} CALLS {{ message.tool_calls | tojson }}{% endif %}\n"
    "{% endfor %}"
)
TOOL: dict[str, TemplateValue] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CONVERSATION: list[ChatMessage] = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "Rain"},
]


def test_tools_join_the_system_message_or_make_one() -> None:
    made = with_tools([{"role": "user", "content": "Hi"}], [TOOL])
    assert made[0]["role"] == "system" and made[1] == {"role": "user", "content": "Hi"}
    system = str(made[0]["content"])
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in system
    assert "<tool_call>" in system and "</tool_call>" in system
    joined = with_tools([{"role": "system", "content": "Be brief."}], [TOOL])
    assert len(joined) == 1 and str(joined[0]["content"]).startswith("Be brief.\n\n")


def test_calls_and_results_become_text_a_plain_template_renders() -> None:
    text = ChatTemplate(CHATML).render(CONVERSATION, tools=[TOOL])
    calls = "\n".join(
        tool_call_text("get_weather", args) for args in ('{"city": "Paris"}', '{"city": "Rome"}')
    )
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in text
    responses = (
        '<tool_response>{"tool_call_id": "c1", "name": "get_weather", "content": "Sunny"}'
        "</tool_response>\n"
        '<tool_response>{"tool_call_id": "c2", "name": "get_weather", "content": "Rain"}'
        "</tool_response>"
    )
    # Consecutive results: one user turn; the reply follows.
    assert text.endswith(f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text


def test_a_call_is_written_as_the_parser_reads_it() -> None:
    assert (
        tool_call_text("f", '{"a": 1}')
        == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )


def test_a_template_with_a_tools_section_renders_them_itself() -> None:
    template = ChatTemplate(WITH_TOOLS_SECTION)
    assert template.has_tools_section and not ChatTemplate(CHATML).has_tools_section
    text = template.render(CONVERSATION[:2], tools=[TOOL], add_generation_prompt=False)
    assert text.startswith("TOOLS get_weather\nuser: Weather in Paris and Rome?")
    assert "assistant:  CALLS [" in text and "<tool_call>" not in text
