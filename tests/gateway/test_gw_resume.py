"""Streams that break mid-way continue in the next region, against fake regions over verified
HTTPS: the client sees one stream (one id, every token once, summed usage, a resume marker);
a resume that cannot happen ends the stream with the error event as before."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator

import httpx
import pytest
from gw_fakes import PROMPT_TOKENS
from gw_fleet import Fleet, GatewayThread, wait_until

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "stream": True,
    "max_tokens": 50,
}
NUM_TOKENS = 6
WHOLE_TEXT = "".join(f"t{i} " for i in range(NUM_TOKENS))


def events_of(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]


def chunks_of(body: str) -> list[dict[str, object]]:
    return [json.loads(e) for e in events_of(body) if e != "[DONE]"]


def text_of(chunks: list[dict[str, object]]) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:  # type: ignore[attr-defined]
            parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


@pytest.fixture
def regions(two_regions: Fleet) -> Fleet:
    for region in two_regions.regions.values():
        region.upstream.behavior.num_chunks = NUM_TOKENS
    return two_regions


def start(fleet: Fleet, **settings: object) -> GatewayThread:
    gateway = fleet.start_gateway(**settings)
    fleet.wait_for_gateway(gateway)
    return gateway


@pytest.fixture
def client(
    regions: Fleet, client_ssl: ssl.SSLContext
) -> Iterator[tuple[Fleet, str, ssl.SSLContext]]:
    _, secret = regions.create_key()
    yield regions, secret, client_ssl


def post(
    gateway: GatewayThread, secret: str, verify: ssl.SSLContext, body: object
) -> httpx.Response:
    keys = gateway.handlers.keys
    wait_until(lambda: len(keys) > 0, 5.0, "the key snapshot")
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=verify, timeout=30.0) as http:
        return http.post("/v1/chat/completions", json=body, headers=headers)


def metric(gateway: GatewayThread, name: str) -> str:
    rendered = gateway.handlers.metrics.render().decode()
    return "\n".join(line for line in rendered.splitlines() if line.startswith(name))


@pytest.mark.parametrize(
    "failure", ["die_after_chunks", "error_after_chunks", "stall_after_chunks"]
)
def test_a_stream_broken_mid_way_continues_in_the_next_region_as_one_stream(
    client: tuple[Fleet, str, ssl.SSLContext], failure: str
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet, stream_idle_timeout_s=0.5)
    near, far = fleet.regions["us-east"].upstream, fleet.regions["eu-west"].upstream
    setattr(near.behavior, failure, 2)
    body = {**CHAT, "stream_options": {"include_usage": True}}
    response = post(gateway, secret, verify, body)
    assert response.status_code == 200
    chunks = chunks_of(response.text)
    assert events_of(response.text)[-1] == "[DONE]"
    assert text_of(chunks) == WHOLE_TEXT  # every token once, in order
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]  # type: ignore[index]
    assert len(roles) == 1
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])  # type: ignore[index]
    assert not any("error" in c for c in chunks)
    [final] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]  # type: ignore[index]
    assert final["meridian_resumes"] == 1
    # The continuation: the ids relayed, max_tokens less them, the same everything else.
    sent = far.seen[-1].body
    assert sent["resume_token_ids"] == [100, 101]
    assert sent["max_tokens"] == CHAT["max_tokens"] - 2
    assert sent["messages"] == CHAT["messages"]
    # Usage summed over both attempts: the prompt twice (the second with the 2 resumed ids).
    usage = chunks[-1]["usage"]
    assert usage == {
        "prompt_tokens": 2 * PROMPT_TOKENS + 2,
        "completion_tokens": NUM_TOKENS,
        "total_tokens": 2 * PROMPT_TOKENS + 2 + NUM_TOKENS,
    }
    assert 'from_region="us-east",to_region="eu-west"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_total"
    )
    gaps = metric(gateway, "meridian_gateway_stream_resume_gap_seconds_count")
    assert 'region="eu-west"} 1.0' in gaps


def test_the_client_that_asks_for_token_ids_gets_them_across_the_resume(
    client: tuple[Fleet, str, ssl.SSLContext],
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet)
    fleet.regions["us-east"].upstream.behavior.die_after_chunks = 3
    response = post(gateway, secret, verify, {**CHAT, "return_token_ids": True})
    chunks = chunks_of(response.text)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]  # type: ignore[attr-defined]
    assert ids == [100 + i for i in range(NUM_TOKENS)]
    assert all("usage" not in c for c in chunks)  # not asked for: still hidden


def test_without_another_region_the_stream_ends_with_the_error_event(
    client: tuple[Fleet, str, ssl.SSLContext],
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet)
    fleet.set_region_state("eu-west", "disabled")
    router = gateway.handlers.router
    wait_until(lambda: router.regions.get("eu-west") is None
               or router.regions["eu-west"].summary.state == "disabled", 5.0)
    near = fleet.regions["us-east"].upstream
    near.behavior.die_after_chunks = 2
    response = post(gateway, secret, verify, CHAT)
    events = events_of(response.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert text_of(chunks_of(response.text)[:-1]) == "t0 t1 "
    assert 'reason="exhausted"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )
    # The node's own error event passes as it is when no resume can happen.
    near.behavior.die_after_chunks, near.behavior.error_after_chunks = None, 1
    events = events_of(post(gateway, secret, verify, CHAT).text)
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"


def test_with_resumes_off_a_broken_stream_ends_with_an_error_event(
    client: tuple[Fleet, str, ssl.SSLContext],
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet, max_resumes=0)
    fleet.regions["us-east"].upstream.behavior.die_after_chunks = 1
    response = post(gateway, secret, verify, CHAT)
    events = events_of(response.text)
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "t0 "
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert fleet.regions["eu-west"].upstream.num_requests == 0


def test_resumes_stop_at_max_resumes(client: tuple[Fleet, str, ssl.SSLContext]) -> None:
    fleet, secret, verify = client
    fleet.add_region("us-west")
    for name in ("us-east", "eu-west", "us-west"):
        fleet.regions[name].upstream.behavior.num_chunks = NUM_TOKENS
        fleet.regions[name].upstream.behavior.die_after_chunks = 1
    gateway = start(fleet, max_resumes=1)
    response = post(gateway, secret, verify, CHAT)
    events = events_of(response.text)
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert text_of(chunks_of(response.text)[:-1]) == "t0 t1 "
    assert sum(r.upstream.num_requests for r in fleet.regions.values()) == 2
    assert 'reason="max_resumes"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )


# Non-streamed requests: the gateway reads them upstream as streams and resumes them the same way.

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 50}


def post_whole(
    gateway: GatewayThread, secret: str, verify: ssl.SSLContext, path: str, body: object
) -> httpx.Response:
    keys = gateway.handlers.keys
    wait_until(lambda: len(keys) > 0, 5.0, "the key snapshot")
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=verify, timeout=30.0) as http:
        return http.post(path, json=body, headers=headers)


def whole_request(endpoint: str) -> tuple[str, dict[str, object]]:
    if endpoint == "chat":
        return "/v1/chat/completions", {**CHAT, "stream": False}
    return "/v1/completions", COMPLETION


def text_of_whole(body: dict[str, object]) -> str:
    [choice] = body["choices"]  # type: ignore[misc]
    return choice["message"]["content"] if "message" in choice else choice["text"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unbroken_non_stream_gets_the_body_the_node_would_answer(
    client: tuple[Fleet, str, ssl.SSLContext], endpoint: str
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet)
    path, body = whole_request(endpoint)
    response = post_whole(gateway, secret, verify, path, body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    answer = response.json()
    near = fleet.regions["us-east"].upstream
    expected = near._whole(endpoint == "chat", NUM_TOKENS, {"model": "fake-model"})
    # The node's whole body, field for field (its id and created are the stream's).
    assert answer.keys() == expected.keys()
    assert answer["choices"] == expected["choices"]
    assert answer["usage"] == expected["usage"]
    assert answer["object"] == expected["object"] and answer["served_by"] == "us-east"
    assert "meridian_resumes" not in answer
    assert near.seen[-1].body["stream"] is True


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    "failure", ["die_after_chunks", "error_after_chunks", "stall_after_chunks"]
)
def test_a_non_stream_broken_mid_way_continues_in_the_next_region_as_one_body(
    client: tuple[Fleet, str, ssl.SSLContext], endpoint: str, failure: str
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet, stream_idle_timeout_s=0.5)
    near, far = fleet.regions["us-east"].upstream, fleet.regions["eu-west"].upstream
    setattr(near.behavior, failure, 2)
    path, body = whole_request(endpoint)
    response = post_whole(gateway, secret, verify, path, body)
    assert response.status_code == 200
    answer = response.json()
    assert text_of_whole(answer) == WHOLE_TEXT  # every token once, in order
    assert answer["object"] == ("chat.completion" if endpoint == "chat" else "text_completion")
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "token_ids" not in answer["choices"][0]
    assert answer["meridian_resumes"] == 1
    assert far.seen[-1].body["resume_token_ids"] == [100, 101]
    assert answer["usage"] == {
        "prompt_tokens": 2 * PROMPT_TOKENS + 2,
        "completion_tokens": NUM_TOKENS,
        "total_tokens": 2 * PROMPT_TOKENS + 2 + NUM_TOKENS,
    }
    assert 'from_region="us-east",to_region="eu-west"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_total"
    )


def test_a_resumed_non_stream_that_asks_for_token_ids_gets_all_of_them(
    client: tuple[Fleet, str, ssl.SSLContext],
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet)
    fleet.regions["us-east"].upstream.behavior.die_after_chunks = 3
    path, body = whole_request("chat")
    answer = post_whole(gateway, secret, verify, path, {**body, "return_token_ids": True}).json()
    assert answer["choices"][0]["token_ids"] == [100 + i for i in range(NUM_TOKENS)]
    assert answer["meridian_resumes"] == 1


def test_without_another_region_a_broken_non_stream_gets_the_error_as_before(
    client: tuple[Fleet, str, ssl.SSLContext],
) -> None:
    fleet, secret, verify = client
    gateway = start(fleet)
    fleet.set_region_state("eu-west", "disabled")
    router = gateway.handlers.router
    wait_until(lambda: router.regions.get("eu-west") is None
               or router.regions["eu-west"].summary.state == "disabled", 5.0)
    fleet.regions["us-east"].upstream.behavior.die_after_chunks = 2
    path, body = whole_request("chat")
    response = post_whole(gateway, secret, verify, path, body)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    assert 'reason="exhausted"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )
