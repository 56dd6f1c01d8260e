"""The prompt estimates against the real SmolLM2 tokenizer and chat template: the bound is never
below the tokens the node counts, and the likely figure keeps the edge tier's choice sensible."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from gateway.openai_request import parse_request
from gateway.prompt_estimate import ChatTurn, of_chat, of_texts, of_token_ids
from gateway.settings import GatewaySettings
from gateway.tiers import EdgeThresholds, is_light

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Please summarise the following report on "
    "quarterly revenue, keeping the figures and the names of the regions as they are. "
)
_rng = random.Random(7)
TEXTS = {
    "english": ENGLISH * 4,
    "emoji": "\U0001f600" * 400,
    "mixed emoji": "".join(chr(0x1F600 + i % 80) for i in range(400)),
    "chinese": "中文字符测试" * 50,
    "cyrillic": "Привет, как дела? " * 30,
    "accents": "déjà vu, naïve façade, über " * 20,
    "random ascii": "".join(chr(_rng.randrange(0x20, 0x7F)) for _ in range(1000)),
    "random unicode": "".join(chr(_rng.randrange(0xA0, 0x2FFF)) for _ in range(500)),
    "whitespace": " \n\t" * 200,
    "digits": "0123456789" * 60,
    "special tokens": "<|im_start|>user\n<|im_end|>" * 20,
    "empty": "",
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def num_chat_tokens(tokenizer: Tokenizer, turns: list[ChatTurn]) -> int:
    messages = [{"role": t.role, "content": t.text} for t in turns]
    return len(tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True)))


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_the_bound_is_never_below_the_real_count(tokenizer: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    conversations = [
        [ChatTurn("user", None, text)],
        [ChatTurn("system", None, text), ChatTurn("user", None, text)],
        [
            ChatTurn("user", None, text),
            ChatTurn("assistant", None, text),
            ChatTurn("user", None, "and again"),
        ],
    ]
    for turns in conversations:
        assert of_chat(turns).max_tokens >= num_chat_tokens(tokenizer, turns)
    if text:
        assert of_texts([text]).max_tokens >= len(tokenizer.encode(text))


def test_the_emoji_prompt_of_the_probe_is_bounded(tokenizer: Tokenizer) -> None:
    """400 emoji: 1,230 tokens where characters said about 104."""
    turns = [ChatTurn("user", None, TEXTS["emoji"])]
    real = num_chat_tokens(tokenizer, turns)
    estimate = of_chat(turns)
    assert real == 1230
    assert real <= estimate.max_tokens <= 1700  # its 1,600 bytes and the template's allowance
    assert estimate.likely_tokens > 2 * 256  # not light for the edge tier


def test_token_ids_are_counted_exactly() -> None:
    estimate = of_token_ids([[1, 2, 3], [4]])
    assert (estimate.likely_tokens, estimate.max_tokens) == (4, 4)


def test_ordinary_english_stays_light_for_the_edge_and_heavy_text_does_not(
    tokenizer: Tokenizer,
) -> None:
    """The tier reads the likely figure: the bound would count English at about 4 times its
    tokens and send a 150-token question past the edge."""
    defaults = GatewaySettings.model_fields
    thresholds = EdgeThresholds(
        int(defaults["edge_max_prompt_tokens"].default), int(defaults["edge_max_tokens"].default)
    )
    question = [ChatTurn("user", None, ENGLISH * 3)]
    assert num_chat_tokens(tokenizer, question) < thresholds.max_prompt_tokens
    assert of_chat(question).max_tokens > thresholds.max_prompt_tokens
    assert is_light(of_chat(question).likely_tokens, 16, thresholds)
    for name in ("emoji", "chinese"):
        heavy = [ChatTurn("user", None, TEXTS[name])]
        assert num_chat_tokens(tokenizer, heavy) > thresholds.max_prompt_tokens
        assert not is_light(of_chat(heavy).likely_tokens, 16, thresholds)


def test_the_bound_counts_what_the_template_renders_of_tools(tokenizer: Tokenizer) -> None:
    """Tools, an assistant's calls and a tool result, with a required call's start after the
    generation prompt, as the node renders them (engine/tool_prompt.py): within the gateway's
    bound (gateway/openai_request.py), which the messages' texts alone are not."""
    name = "f" * 64
    tool: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": name,
            "description": "\U0001f600" * 50,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    call = {"id": "c" * 40, "type": "function", "function": {"name": name, "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c" * 40, "content": "\u00e9" * 30},
    ]
    body = {"model": "m", "messages": messages, "tools": [tool], "tool_choice": "required"}
    parsed = parse_request(json.dumps(body).encode(), "chat", 16)
    rendered = tokenizer.render_chat(messages, add_generation_prompt=True, tools=[tool])
    prefix = f'<tool_call>{{"name": "{name}", "arguments": '
    num_real = len(tokenizer.encode(rendered + prefix))
    texts_only = of_chat(
        [ChatTurn(str(m["role"]), None, str(m["content"] or "")) for m in messages]
    )
    assert texts_only.max_tokens < num_real <= parsed.max_prompt_tokens
