"""Response and chunk shapes, and token texts for logprobs."""

from __future__ import annotations

import json

from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer
from node_agent.responses import (
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
    with_usage = ResponseHeader("chatcmpl-1", 7, "m", include_usage=True)
    chunk = parse(with_usage.chat_chunk({"content": "hi"}))
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
    assert "usage" not in parse(ResponseHeader("c", 7, "m").chat_chunk({}, "stop"))
    last = parse(with_usage.chat_usage_chunk(Usage(3, 2, 1)))
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert DONE == b"data: [DONE]\n\n"


def test_token_texts_give_exact_bytes_even_for_partial_characters(tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(" café ☃")
    data = b"".join(bytes(texts.get(i)[1]) for i in ids)
    assert data == " café ☃".encode()
    assert texts.get(2) == ("<|im_end|>", list(b"<|im_end|>"))


def test_logprobs_shapes(tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    paris, london = tokenizer.encode(" Paris")[0], tokenizer.encode(" London")[0]
    lps = [TokenLogprobs(paris, -0.1, [(paris, -0.1), (london, -2.0)])]
    chat = chat_logprobs(texts, lps, 1)
    assert chat == {
        "content": [
            {
                "token": " Paris",
                "logprob": -0.1,
                "bytes": list(b" Paris"),
                "top_logprobs": [{"token": " Paris", "logprob": -0.1, "bytes": list(b" Paris")}],
            }
        ]
    }
    legacy = CompletionLogprobs(texts, 2)
    first = legacy.next(lps)
    assert first["top_logprobs"] == [{" Paris": -0.1, " London": -2.0}]
    assert legacy.next(lps)["text_offset"] == [len(" Paris")]
