"""Response and chunk shapes, and token texts for logprobs (on the fake engine's byte-level
tokenizer: each byte a token of its own, spelled as GPT-2 spells bytes)."""

from __future__ import annotations

import json

from fake_engine import IM_END, byte_tokenizer

from engine.sequence import TokenLogprobs
from node_agent.responses import (
    CHAT,
    DONE,
    CompletionLogprobs,
    ResponseHeader,
    TokenTexts,
    Usage,
    chat_logprobs,
)


def parse(event: bytes) -> dict[str, object]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    result: dict[str, object] = json.loads(event[6:])
    return result


def test_chat_chunks_carry_null_usage_only_when_usage_is_asked_for() -> None:
    with_usage = ResponseHeader("chatcmpl-1", 7, "m", CHAT, include_usage=True)
    chunk = parse(with_usage.chunk({"delta": {"content": "hi"}}))
    assert chunk == {
        "id": "chatcmpl-1",
        "created": 7,
        "model": "m",
        "object": "chat.completion.chunk",
        "choices": [
            {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    }
    assert "usage" not in parse(ResponseHeader("c", 7, "m", CHAT).chunk({"delta": {}}, "stop"))
    last = parse(with_usage.usage_chunk(Usage(3, 2, 1)))
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert DONE == b"data: [DONE]\n\n"


def test_token_texts_give_exact_bytes_even_for_partial_characters() -> None:
    tokenizer = byte_tokenizer()
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(" café ☃")
    assert len(ids) == len(" café ☃".encode())  # é and ☃ are split between tokens
    data = b"".join(bytes(texts.get(i)[1]) for i in ids)
    assert data == " café ☃".encode()
    [im_end] = tokenizer.encode(IM_END)
    assert texts.get(im_end) == (IM_END, list(IM_END.encode()))


def test_logprobs_shapes() -> None:
    tokenizer = byte_tokenizer()
    texts = TokenTexts(tokenizer)
    space, yes = tokenizer.encode(" "), tokenizer.encode("Y")
    lps = [TokenLogprobs(space[0], -0.1, [(space[0], -0.1), (yes[0], -2.0)])]
    chat = chat_logprobs(texts, lps, 1)
    assert chat == {
        "content": [
            {
                "token": " ",
                "logprob": -0.1,
                "bytes": list(b" "),
                "top_logprobs": [{"token": " ", "logprob": -0.1, "bytes": list(b" ")}],
            }
        ]
    }
    legacy = CompletionLogprobs(texts, 2)
    first = legacy.next(lps)
    assert first["top_logprobs"] == [{" ": -0.1, "Y": -2.0}]
    assert legacy.next(lps)["text_offset"] == [len(" ")]
