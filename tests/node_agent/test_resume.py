"""Resuming a generation: `return_token_ids` gives each chunk's ids, and `resume_token_ids`
continues after them with what an unbroken run would have produced next.

Exact continuation is tested on the real SmolLM2 in an fp32 engine: in bf16 the continuation's
prefill of the resumed tokens rounds their KV differently from the decode steps that made them,
and greedy texts part after a few tokens (docs/gateway.md). The field's checks and the ids
returned are tested over the fake engine (fake_engine.py). `resume_token_ids` is a gateway's
field: these nodes have a serving token, and the requests carry it as a gateway's do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from node_helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    BackgroundLoop,
    NodeHandle,
    start_engine,
    start_node,
)

SERVING_TOKEN = "srv-" + "g" * 28
AS_GATEWAY = {"Authorization": f"Bearer {SERVING_TOKEN}"}
A_TOKEN = 65  # any id in both engines' vocabularies


@pytest.fixture(scope="module")
def fp32_node(smollm2_gguf: Path, server_loop: BackgroundLoop) -> Iterator[NodeHandle]:
    llm = start_engine(server_loop, smollm2_gguf, dtype="float32")
    handle = start_node(server_loop, llm, serving_token=SERVING_TOKEN)
    yield handle
    handle.stop()
    server_loop.run(llm.shutdown())


@pytest.fixture(scope="module")
def gateway_node(server_loop: BackgroundLoop, fake_llm: FakeEngine) -> Iterator[NodeHandle]:
    """A node over the shared fake engine that serves gateways: it has a serving token."""
    handle = start_node(server_loop, fake_llm, serving_token=SERVING_TOKEN)
    yield handle
    handle.stop()


CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a short story about a robot."}],
    "max_tokens": 24,
    "ignore_eos": True,
}
SAMPLINGS: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
    # A stop string holds text back while it could be forming: the resume must hold the same.
    "seeded_with_stop": {"temperature": 0.9, "seed": 99, "stop": ["never appears here"]},
}


def stream(node: NodeHandle, body: dict[str, object]) -> list[dict[str, Any]]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(
        node.base_url + "/v1/chat/completions", json=body, headers=AS_GATEWAY, timeout=120.0
    )
    assert response.status_code == 200, response.text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def content_and_ids(chunks: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    pieces = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if "role" not in delta:
                pieces.append((delta.get("content") or "", choice.get("token_ids", [])))
    return pieces


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_resumed_stream_continues_exactly_as_the_unbroken_one(
    fp32_node: NodeHandle, sampling: str
) -> None:
    node = fp32_node
    body = {**CHAT, **SAMPLINGS[sampling], "return_token_ids": True}
    unbroken = content_and_ids(stream(node, body))
    ids = [t for _, piece in unbroken for t in piece]
    assert len(ids) == CHAT["max_tokens"]
    # Break after the chunk that brings the relayed ids to 9 or more.
    cut = next(i for i in range(len(unbroken)) if sum(len(p) for _, p in unbroken[: i + 1]) >= 9)
    sent = unbroken[: cut + 1]
    num_sent = sum(len(p) for _, p in sent)
    resumed_chunks = stream(
        node,
        {**body, "resume_token_ids": ids[:num_sent], "max_tokens": len(ids) - num_sent},
    )
    resumed = content_and_ids(resumed_chunks)
    assert [t for _, p in resumed for t in p] == ids[num_sent:]
    text = "".join(c for c, _ in unbroken)
    assert "".join(c for c, _ in sent) + "".join(c for c, _ in resumed) == text
    usage = resumed_chunks[-1]["usage"]
    prompt = stream(node, {**body, "max_tokens": 1})[-1]["usage"]["prompt_tokens"]
    assert usage["prompt_tokens"] == prompt + num_sent
    assert usage["completion_tokens"] == len(ids) - num_sent
    # The first chunk says what the node prefilled: the prompt, then the resumed ids.
    prompt_ids = resumed_chunks[0]["prompt_token_ids"]
    assert len(prompt_ids) == usage["prompt_tokens"]
    assert prompt_ids[-num_sent:] == ids[:num_sent]
    assert all("prompt_token_ids" not in c for c in resumed_chunks[1:])


def test_token_ids_are_returned_only_when_asked(node: NodeHandle) -> None:
    url = node.base_url + "/v1/chat/completions"
    body = {**CHAT, "temperature": 0, "max_tokens": 6}
    plain = httpx.post(url, json=body, timeout=60.0).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    assert all("token_ids" not in c["choices"][0] for c in stream(node, body) if c["choices"])
    assert all("prompt_token_ids" not in c for c in stream(node, body))
    with_ids = httpx.post(url, json={**body, "return_token_ids": True}, timeout=60.0).json()
    assert list(with_ids)[:5] == ["id", "object", "created", "model", "prompt_token_ids"]
    assert len(with_ids["prompt_token_ids"]) == with_ids["usage"]["prompt_tokens"]
    streamed = [
        t for _, p in content_and_ids(stream(node, {**body, "return_token_ids": True})) for t in p
    ]
    assert with_ids["choices"][0]["token_ids"] == streamed and len(streamed) == 6


@pytest.mark.slow
def test_a_completion_resumes_too(fp32_node: NodeHandle) -> None:
    node = fp32_node
    url = node.base_url + "/v1/completions"
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 5,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = httpx.post(url, json=body, headers=AS_GATEWAY, timeout=60.0).json()["choices"][0]
    rest = httpx.post(
        url,
        json={**body, "resume_token_ids": whole["token_ids"][:5], "max_tokens": 7},
        headers=AS_GATEWAY,
        timeout=60.0,
    ).json()["choices"][0]
    assert rest["token_ids"] == whole["token_ids"][5:]
    assert whole["text"].endswith(rest["text"]) and rest["text"]


@pytest.mark.parametrize(
    ("resume", "message"),
    [
        ([49152], "resumed token ids must be in"),
        ([1] * 1100, "maximum context length"),
        ([-1], "greater than or equal to 0"),
        ([], "at least 1 item"),
    ],
)
def test_bad_resume_token_ids_are_refused_with_400(
    gateway_node: NodeHandle, resume: list[int], message: str
) -> None:
    body = {**CHAT, "resume_token_ids": resume}
    response = httpx.post(
        gateway_node.base_url + "/v1/chat/completions", json=body, headers=AS_GATEWAY, timeout=60.0
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_resume_token_ids_are_refused_from_a_caller_not_authenticated_as_a_gateway(
    node: NodeHandle, gateway_node: NodeHandle
) -> None:
    """A node without a serving token (loopback only, every caller alike) cannot tell a gateway
    from a client, so it refuses the field; a node with one takes it with the token."""
    body = {**CHAT, "max_tokens": 2, "resume_token_ids": [A_TOKEN] * 6}
    refused = httpx.post(node.base_url + "/v1/chat/completions", json=body, timeout=60.0)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("resume_token_ids", "invalid_request")
    accepted = httpx.post(
        gateway_node.base_url + "/v1/chat/completions", json=body, headers=AS_GATEWAY, timeout=60.0
    )
    assert accepted.status_code == 200, accepted.text


def test_resumed_ids_count_as_prompt_in_the_context_check(gateway_node: NodeHandle) -> None:
    url = gateway_node.base_url + "/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "return_token_ids": True}
    answer = httpx.post(url, json={**body, "max_tokens": 1}, headers=AS_GATEWAY, timeout=60.0)
    num_prompt = answer.json()["usage"]["prompt_tokens"]
    room = 2  # tokens left for the completion after the prompt and the resumed ids
    resumed = [A_TOKEN] * (MAX_MODEL_LEN - num_prompt - room)
    fits = httpx.post(
        url,
        json={**body, "resume_token_ids": resumed, "max_tokens": room},
        headers=AS_GATEWAY,
        timeout=60.0,
    )
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == num_prompt + len(resumed)
    over = httpx.post(
        url,
        json={**body, "resume_token_ids": resumed, "max_tokens": room + 1},
        headers=AS_GATEWAY,
        timeout=60.0,
    )
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"({num_prompt + len(resumed)} in the prompt" in error["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CONSTRAINED: dict[str, dict[str, object]] = {
    "tool_required": {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    "tool_named": {
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    },
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER_TOOL["function"]["parameters"]},  # type: ignore[index]
        }
    },
}


def joined(chunks: list[dict[str, Any]]) -> tuple[str, dict[int, dict[str, Any]], list[object]]:
    """The content, the tool calls by index (ids seen, name, arguments joined) and the finish
    reasons of a chat stream's chunks, as a client joins them."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for item in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(item["index"], {"ids": [], "name": "", "arguments": ""})
                call["ids"] += [item["id"]] if "id" in item else []
                call["name"] += item["function"].get("name") or ""
                call["arguments"] += item["function"].get("arguments") or ""
            if choice["finish_reason"] is not None:
                finishes.append(choice["finish_reason"])
    return content, calls, finishes


@pytest.mark.slow
@pytest.mark.parametrize("kind", CONSTRAINED)
def test_a_constrained_or_tool_stream_resumes_under_its_grammar_without_repeating_deltas(
    fp32_node: NodeHandle, kind: str
) -> None:
    body = {
        **CHAT,
        **CONSTRAINED[kind],
        "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
        "temperature": 0,
        "max_tokens": 30,
        "ignore_eos": False,
        "return_token_ids": True,
    }
    unbroken_chunks = stream(fp32_node, body)
    whole = joined(unbroken_chunks)
    ids = [t for c in unbroken_chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    if kind == "json_schema":
        json.loads(whole[0])
    else:
        assert whole[2] == ["tool_calls"] and len(whole[1]) == 1
        json.loads(whole[1][0]["arguments"])
    # Broken after each of a few chunks: in the call's head, in its arguments, near the end.
    with_ids = [
        i
        for i, c in enumerate(unbroken_chunks)
        if c["choices"] and c["choices"][0].get("token_ids")
    ]
    for cut in sorted({with_ids[1], with_ids[len(with_ids) // 2], with_ids[-2]}):
        sent = unbroken_chunks[: cut + 1]
        num_sent = sum(len(ch.get("token_ids", [])) for c in sent for ch in c["choices"])
        resumed = stream(
            fp32_node,
            {**body, "resume_token_ids": ids[:num_sent], "max_tokens": 30 - num_sent},
        )
        assert [t for c in resumed for ch in c["choices"] for t in ch.get("token_ids", [])] == (
            ids[num_sent:]
        )
        content, calls, finishes = joined(sent + resumed[1:])  # the client has its role chunk
        assert (content, finishes) == (whole[0], whole[2]), f"cut after chunk {cut}"
        assert {i: (c["name"], c["arguments"]) for i, c in calls.items()} == {
            i: (c["name"], c["arguments"]) for i, c in whole[1].items()
        }
        assert all(len(c["ids"]) == 1 for c in calls.values())  # each call's id sent once
