"""Bad requests get OpenAI's error JSON with the right status, and never reach the engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from node_helpers import MAX_MODEL_LEN, MODEL_NAME, NodeHandle
from openai.types.chat import ChatCompletionMessageParam

CHAT = "/v1/chat/completions"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def http(node: NodeHandle) -> Iterator[httpx.Client]:
    with node.client() as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> Any:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": "smollm2-135m-instruct"}', "messages"),
        (b'{"model": "smollm2-135m-instruct", "messages": []}', "messages"),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "robot", "content": "x"}]}',
            "messages",
        ),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": 3}',
            "temperature",
        ),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 0}',
            "max_tokens",
        ),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
            b'"stop": [1, 2]}',
            "stop",
        ),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
            b'"top_logprobs": 2}',
            None,
        ),
    ],
)
def test_malformed_bodies_get_400_and_never_reach_the_engine(
    node: NodeHandle, http: httpx.Client, body: bytes, param: str | None
) -> None:
    before = node.stats().prompt_tokens_total, node.stats().prefix_cache_queried_tokens
    response = http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert (node.stats().prompt_tokens_total, node.stats().prefix_cache_queried_tokens) == before


_TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 9}, "n"),  # over the node's max_num_choices (8)
        ({"tools": [_TOOL, _TOOL]}, "tools"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "result"}]}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages"),
    ],
)  # fmt: skip
def test_bad_choices_and_tools_are_400_before_any_work(
    node: NodeHandle, http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    before = node.stats().prompt_tokens_total, node.stats().prefix_cache_queried_tokens
    response = http.post(CHAT, json={"model": MODEL_NAME, "messages": MESSAGES} | extra)
    assert_openai_error(response, 400, param)
    assert (node.stats().prompt_tokens_total, node.stats().prefix_cache_queried_tokens) == before


def test_unknown_model_is_404(http: httpx.Client) -> None:
    response = http.post(CHAT, json={"model": "gpt-17", "messages": MESSAGES})
    error = assert_openai_error(response, 404, "model")
    assert error["code"] == "model_not_found"


def test_n_above_the_nodes_limit_or_below_one_is_400(http: httpx.Client) -> None:
    for n in (9, 0):
        response = http.post(CHAT, json={"model": MODEL_NAME, "messages": MESSAGES, "n": n})
        assert_openai_error(response, 400, "n")


def test_prompt_longer_than_the_context_is_400_context_length_exceeded(
    http: httpx.Client,
) -> None:
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 1}
    )
    error = assert_openai_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    # Prompt plus max_tokens over the context is refused the same way, naming max_tokens.
    response = http.post(
        CHAT, json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}
    )
    error = assert_openai_error(response, 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"


def test_unsupported_features_are_refused_not_ignored(http: httpx.Client) -> None:
    extras: list[tuple[dict[str, Any], str | None]] = [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, None),
    ]
    for extra, param in extras:
        body = {"model": MODEL_NAME, "messages": MESSAGES, **extra}
        assert_openai_error(http.post(CHAT, json=body), 400, param)
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": ["a", "b"], "max_tokens": 1}
    )
    assert_openai_error(response, 400, "prompt")


def test_unknown_fields_are_tolerated(http: httpx.Client) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 2,
        "a_future_field": {"x": 1},
        "user": "u-1",
        "metadata": {"k": "v"},
    }
    assert http.post(CHAT, json=body).status_code == 200


def test_unknown_route_is_404_in_openai_shape(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/engines"), 404)


def test_request_id_is_echoed_or_made_beside_the_nodes_own(
    http: httpx.Client, node: NodeHandle
) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}
    response = http.post(CHAT, json=body, headers={"X-Request-Id": "gw-42"})
    assert response.headers["x-request-id"] == "gw-42"
    # The node names itself as its heartbeats do: a gateway matches it to the summary's health.
    assert response.headers["x-meridian-node"] == node.runtime.node_id
    streamed = http.post(CHAT, json={**body, "stream": True})
    assert streamed.headers["x-meridian-node"] == node.runtime.node_id
    made = http.post(CHAT, json=body).headers["x-request-id"]
    assert made and made != "gw-42"
    # Errors carry it too.
    assert (
        http.post(CHAT, content=b"{", headers={"X-Request-Id": "gw-43"}).headers["x-request-id"]
        == "gw-43"
    )


def test_openai_client_raises_typed_errors(node: NodeHandle) -> None:
    with openai.OpenAI(base_url=node.base_url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            client.chat.completions.create(model="nope", messages=MESSAGES)
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=9)
        assert bad.value.param == "n"


COMPLETIONS = "/v1/completions"
DEEP = "[" * 100_000 + "]" * 100_000
# Shallow enough for the JSON parser, deep for anything walking the parsed body recursively.
SHALLOWER = "[" * 900 + "]" * 900


def chat_json(content: str, *extra: str) -> bytes:
    """A chat body, as raw JSON text: `content` is the message's content, as JSON."""
    fields = [f'"model": "{MODEL_NAME}"', f'"messages": [{{"role": "user", "content": {content}}}]']
    return ("{" + ", ".join([*fields, *extra]) + "}").encode()


def completion_json(prompt: str) -> bytes:
    return ("{" + f'"model": "{MODEL_NAME}", "prompt": {prompt}' + "}").encode()


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        (CHAT, chat_json(r'"a\ud800b"'), "messages", "messages[0].content"),
        (
            CHAT,
            chat_json(r'[{"type": "text", "text": "\udfff"}]'),
            "messages",
            "messages[0].content[0].text",
        ),
        (CHAT, chat_json('"hi"', r'"stop": ["\ud800"]'), "stop", "stop[0]"),
        (COMPLETIONS, completion_json(r'"x\ud800"'), "prompt", "prompt"),
        (COMPLETIONS, completion_json(r'["\udbff"]'), "prompt", "prompt[0]"),
    ],
    ids=["chat-content", "chat-text-part", "stop", "prompt", "prompt-list"],
)
def test_a_lone_surrogate_in_the_text_is_400_and_the_node_keeps_serving(
    node: NodeHandle, http: httpx.Client, path: str, body: bytes, param: str, where: str
) -> None:
    before = node.stats().prompt_tokens_total
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error" and where in error["message"]
    assert "surrogate" in error["message"]
    assert node.stats().prompt_tokens_total == before
    ok = http.post(CHAT, json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_a_surrogate_pair_is_one_character_and_served(http: httpx.Client) -> None:
    body = chat_json(r'"smile \ud83d\ude00"', '"max_tokens": 1')
    response = http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, DEEP.encode()),
        (CHAT, chat_json(DEEP)),
        (COMPLETIONS, completion_json(DEEP)),
        (COMPLETIONS, completion_json(SHALLOWER)),
        (CHAT, chat_json(SHALLOWER)),
    ],
    ids=["bare-100k", "chat-100k", "prompt-100k", "prompt-900", "chat-900"],
)
def test_json_nested_too_deep_is_400_and_the_node_keeps_serving(
    node: NodeHandle, http: httpx.Client, path: str, body: bytes
) -> None:
    before = node.stats().prompt_tokens_total
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert node.stats().prompt_tokens_total == before
    ok = http.post(CHAT, json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
