"""Streams that break mid-way continue in the next region, against fake regions over verified
HTTPS: the client sees one stream (one id, every token once, summed usage, a resume marker);
a resume that cannot happen ends the stream with the error event as before."""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from gw_fakes import PROMPT_TOKENS, FakeUpstream
from gw_fleet import Fleet, GatewayThread, wait_until

from gateway.relay import SilenceLimits
from wire.region_summary import QueueEstimate, RegionSummary

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "stream": True,
    "max_tokens": 50,
}
CHAT_PATH = "/v1/chat/completions"
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


@dataclass
class Resumable:
    """Two fake regions of streams of NUM_TOKENS tokens (us-east the nearer) and a key."""

    fleet: Fleet
    secret: str
    verify: ssl.SSLContext

    @property
    def near(self) -> FakeUpstream:
        return self.fleet.regions["us-east"].upstream

    @property
    def far(self) -> FakeUpstream:
        return self.fleet.regions["eu-west"].upstream

    def gateway(self, **settings: Any) -> GatewayThread:
        gateway = self.fleet.start_gateway(**settings)
        self.fleet.wait_for_gateway(gateway)
        keys = gateway.handlers.keys
        wait_until(lambda: len(keys) > 0, 5.0, "the key snapshot")
        return gateway

    def without_far(self, gateway: GatewayThread) -> None:
        """eu-west disabled, and `gateway` knows it: no region left to resume in."""
        self.fleet.set_region_state("eu-west", "disabled")
        router = gateway.handlers.router
        wait_until(
            lambda: (
                router.regions.get("eu-west") is None
                or router.regions["eu-west"].summary.state == "disabled"
            ),
            5.0,
        )

    def stop_near_heartbeats_once_streaming(self, gateway: GatewayThread, body: object) -> str:
        """Stream `body`, and once its first chunk is in, stop us-east's heartbeats (its node
        hangs as far as the control plane can tell): the whole body, read to its end."""
        headers = {"Authorization": f"Bearer {self.secret}"}
        with (
            httpx.Client(base_url=gateway.base_url, verify=self.verify, timeout=30.0) as http,
            http.stream("POST", CHAT_PATH, json=body, headers=headers) as response,
        ):
            assert response.status_code == 200
            parts = response.iter_bytes()
            first = next(parts)
            self.fleet.regions["us-east"].is_beating = False
            return (first + b"".join(parts)).decode()

    def stall_near_and_resume_once_its_heartbeats_stop(self, gateway: GatewayThread) -> None:
        """us-east's stream goes silent after 2 chunks and its node stops beating: the stream
        resumes in eu-west, far sooner than a 60 s idle timeout (or the client's own 30 s)."""
        self.near.behavior.stall_after_chunks = 2
        started_s = time.monotonic()
        text = self.stop_near_heartbeats_once_streaming(gateway, CHAT)
        took_s = time.monotonic() - started_s
        chunks = chunks_of(text)
        assert text_of(chunks) == WHOLE_TEXT and events_of(text)[-1] == "[DONE]"
        [final] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]  # type: ignore[index]
        assert final["meridian_resumes"] == 1
        assert self.far.seen[-1].body["resume_token_ids"] == [100, 101]
        # Heartbeats missed for unhealthy_after_s, the summary to the gateway, then at most the
        # gateway's short silence limit.
        print(f"\nresumed {took_s:.2f} s after the request")
        assert took_s < 15.0

    def post(self, gateway: GatewayThread, body: object, path: str = CHAT_PATH) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.secret}"}
        with httpx.Client(base_url=gateway.base_url, verify=self.verify, timeout=30.0) as http:
            return http.post(path, json=body, headers=headers)


@pytest.fixture
def resumable(two_regions: Fleet, client_ssl: ssl.SSLContext) -> Resumable:
    for region in two_regions.regions.values():
        region.upstream.behavior.num_chunks = NUM_TOKENS
    _, secret = two_regions.create_key()
    return Resumable(two_regions, secret, client_ssl)


def metric(gateway: GatewayThread, name: str) -> str:
    rendered = gateway.handlers.metrics.render().decode()
    return "\n".join(line for line in rendered.splitlines() if line.startswith(name))


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.parametrize(
    "failure", ["die_after_chunks", "error_after_chunks", "stall_after_chunks"]
)
def test_a_stream_broken_mid_way_continues_in_the_next_region_as_one_stream(
    resumable: Resumable, failure: str
) -> None:
    gateway = resumable.gateway(stream_idle_timeout_s=0.5)
    near, far = resumable.near, resumable.far
    setattr(near.behavior, failure, 2)
    body = {**CHAT, "stream_options": {"include_usage": True}}
    response = resumable.post(gateway, body)
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


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_stream_silent_from_a_region_with_no_healthy_node_resumes_without_the_idle_wait(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway(stream_idle_timeout_s=60.0, unhealthy_node_silence_s=1.0)
    resumable.stall_near_and_resume_once_its_heartbeats_stop(gateway)


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_stream_silent_from_an_unhealthy_node_resumes_while_its_region_serves_on(
    resumable: Resumable,
) -> None:
    near = resumable.fleet.regions["us-east"]
    near.spare_nodes["us-east-n2"] = True  # keeps beating: us-east stays healthy throughout
    gateway = resumable.gateway(stream_idle_timeout_s=60.0, unhealthy_node_silence_s=1.0)
    router = gateway.handlers.router
    wait_until(lambda: router.regions["us-east"].summary.healthy_nodes == 2, 5.0, "2 nodes")
    resumable.stall_near_and_resume_once_its_heartbeats_stop(gateway)
    # Its node (us-east-n1, as it named itself) unhealthy, its region not: the node decided.
    summary = router.regions["us-east"].summary
    assert summary.healthy_nodes == 1 and summary.unhealthy_nodes == ("us-east-n1",)


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_silent_stream_from_a_healthy_node_waits_the_idle_timeout_beside_an_unhealthy_one(
    resumable: Resumable,
) -> None:
    near = resumable.fleet.regions["us-east"]
    near.spare_nodes["us-east-n2"] = True
    gateway = resumable.gateway(stream_idle_timeout_s=3.0, unhealthy_node_silence_s=0.5)
    router = gateway.handlers.router
    wait_until(lambda: router.regions["us-east"].summary.healthy_nodes == 2, 5.0, "2 nodes")
    near.spare_nodes["us-east-n2"] = False  # the other node hangs; the stream's beats on
    wait_until(lambda: router.regions["us-east"].summary.unhealthy_nodes == ("us-east-n2",), 5.0)
    near.upstream.behavior.stall_after_chunks = 2
    started_s = time.monotonic()
    response = resumable.post(gateway, CHAT)
    took_s = time.monotonic() - started_s
    assert text_of(chunks_of(response.text)) == WHOLE_TEXT
    assert resumable.far.num_requests == 1
    assert took_s >= 3.0  # its own node kept beating: its silence may be a slow step


def test_the_silence_limit_follows_the_streams_node_and_region() -> None:
    def summary(healthy: int, unhealthy: tuple[str, ...]) -> RegionSummary:
        queue = QueueEstimate(
            num_waiting=0, num_waiting_prefill_tokens=0, decode_tokens_per_s=0.0,
            expected_queue_delay_s=0.0,
        )  # fmt: skip
        return RegionSummary(
            name="us-east", lat=0.0, lon=0.0, state="active", healthy_nodes=healthy,
            unhealthy_nodes=unhealthy, kv_blocks_free=0, kv_blocks_total=0, queue=queue,
            weight=1.0,
        )  # fmt: skip

    summaries: dict[str, RegionSummary] = {}
    limits = SilenceLimits(60.0, 2.0, summaries.get)
    assert limits.of("us-east", "n1") == 60.0  # a region not in the summaries: unknown
    summaries["us-east"] = summary(2, ())
    assert limits.of("us-east", "n1") == 60.0
    summaries["us-east"] = summary(1, ("n1",))
    assert limits.of("us-east", "n1") == 2.0
    assert limits.of("us-east", "n2") == 60.0
    assert limits.of("us-east", None) == 60.0  # a node that did not name itself
    summaries["us-east"] = summary(0, ())
    assert limits.of("us-east", None) == 2.0 and limits.of("us-east", "n2") == 2.0


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_stream_still_flowing_from_a_region_with_no_healthy_node_is_left_alone(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway(unhealthy_node_silence_s=1.0)
    near = resumable.near
    near.behavior.num_chunks, near.behavior.chunk_delay_s = 30, 0.25  # 7.5 s of stream
    router = gateway.handlers.router
    started_s = time.monotonic()
    text = resumable.stop_near_heartbeats_once_streaming(gateway, CHAT)
    chunks = chunks_of(text)
    assert text_of(chunks) == "".join(f"t{i} " for i in range(30))
    assert resumable.far.num_requests == 0
    # The gateway did see the region unhealthy while the stream still flowed.
    assert router.regions["us-east"].summary.healthy_nodes == 0
    assert time.monotonic() - started_s > 7.0


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_silent_stream_from_a_healthy_region_waits_the_idle_timeout(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway(stream_idle_timeout_s=3.0, unhealthy_node_silence_s=0.5)
    resumable.near.behavior.stall_after_chunks = 2
    started_s = time.monotonic()
    response = resumable.post(gateway, CHAT)
    took_s = time.monotonic() - started_s
    assert text_of(chunks_of(response.text)) == WHOLE_TEXT
    assert resumable.far.num_requests == 1
    assert took_s >= 3.0  # the region kept beating: its silence may be a slow step


def test_with_resume_prewarm_the_far_region_gets_the_prompt_at_the_stream_s_start(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway(resume_prewarm=True)
    resumable.near.behavior.die_after_chunks = 3
    response = resumable.post(gateway, CHAT)
    assert text_of(chunks_of(response.text)) == WHOLE_TEXT
    far = resumable.far.seen
    [warm] = [s for s in far if s.body.get("max_tokens") == 1]
    [continuation] = [s for s in far if "resume_token_ids" in s.body]
    # The prompt as the stream sent it, one token, whole; the tenant's cache salt with it.
    assert warm.body["messages"] == CHAT["messages"]
    assert warm.body["stream"] is False and "stream_options" not in warm.body
    assert warm.headers["x-request-id"] == continuation.headers["x-request-id"] + "-prewarm"
    salt = "x-meridian-cache-salt"
    assert warm.headers[salt] == continuation.headers[salt] == resumable.near.seen[0].headers[salt]
    assert continuation.body["resume_token_ids"] == [100, 101, 102]
    wait_until(lambda: "1.0" in metric(gateway, "meridian_gateway_resume_prewarms_total{"), 5.0)
    assert 'outcome="ok",region="eu-west"} 1.0' in metric(
        gateway, "meridian_gateway_resume_prewarms_total"
    )


def test_without_resume_prewarm_the_far_region_sees_only_the_continuation(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway()
    resumable.near.behavior.die_after_chunks = 3
    assert text_of(chunks_of(resumable.post(gateway, CHAT).text)) == WHOLE_TEXT
    assert [s.body.get("resume_token_ids") for s in resumable.far.seen] == [[100, 101, 102]]


def test_the_client_that_asks_for_token_ids_gets_them_across_the_resume(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway()
    resumable.near.behavior.die_after_chunks = 3
    response = resumable.post(gateway, {**CHAT, "return_token_ids": True})
    chunks = chunks_of(response.text)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]  # type: ignore[attr-defined]
    assert ids == [100 + i for i in range(NUM_TOKENS)]
    assert all("usage" not in c for c in chunks)  # not asked for: still hidden


def test_without_another_region_the_stream_ends_with_the_error_event(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway()
    resumable.without_far(gateway)
    near = resumable.near
    near.behavior.die_after_chunks = 2
    response = resumable.post(gateway, CHAT)
    events = events_of(response.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert text_of(chunks_of(response.text)[:-1]) == "t0 t1 "
    assert 'reason="exhausted"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )
    # The node's own error event passes as it is when no resume can happen.
    near.behavior.die_after_chunks, near.behavior.error_after_chunks = None, 1
    events = events_of(resumable.post(gateway, CHAT).text)
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"


def test_with_resumes_off_a_broken_stream_ends_with_an_error_event(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway(max_resumes=0)
    resumable.near.behavior.die_after_chunks = 1
    response = resumable.post(gateway, CHAT)
    events = events_of(response.text)
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "t0 "
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert resumable.far.num_requests == 0


def test_a_stream_of_several_choices_is_not_resumed(resumable: Resumable) -> None:
    """Its choices' ids interleave: no one continuation could carry them (nodes refuse n > 1
    with resumed ids), so it ends with the error event as a stream without a region left."""
    gateway = resumable.gateway()
    resumable.near.behavior.die_after_chunks = 2
    response = resumable.post(gateway, {**CHAT, "n": 2})
    events = events_of(response.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert resumable.far.num_requests == 0
    assert 'reason="multiple_choices"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )


def test_resumes_stop_at_max_resumes(resumable: Resumable) -> None:
    resumable.fleet.add_region("us-west")
    for name in ("us-east", "eu-west", "us-west"):
        resumable.fleet.regions[name].upstream.behavior.num_chunks = NUM_TOKENS
        resumable.fleet.regions[name].upstream.behavior.die_after_chunks = 1
    gateway = resumable.gateway(max_resumes=1)
    response = resumable.post(gateway, CHAT)
    events = events_of(response.text)
    assert json.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert text_of(chunks_of(response.text)[:-1]) == "t0 t1 "
    assert sum(r.upstream.num_requests for r in resumable.fleet.regions.values()) == 2
    assert 'reason="max_resumes"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )


# Non-streamed requests: the gateway reads them upstream as streams and resumes them the same way.

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 50}


def whole_request(endpoint: str) -> tuple[str, dict[str, object]]:
    if endpoint == "chat":
        return CHAT_PATH, {**CHAT, "stream": False}
    return "/v1/completions", COMPLETION


def text_of_whole(body: dict[str, object]) -> str:
    [choice] = body["choices"]  # type: ignore[misc]
    return choice["message"]["content"] if "message" in choice else choice["text"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unbroken_non_stream_gets_the_body_the_node_would_answer(
    resumable: Resumable, endpoint: str
) -> None:
    gateway = resumable.gateway()
    path, body = whole_request(endpoint)
    response = resumable.post(gateway, body, path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    answer = response.json()
    near = resumable.near
    expected = near._whole(endpoint == "chat", NUM_TOKENS, {"model": "fake-model"})
    # The node's whole body, field for field (its id and created are the stream's).
    assert answer.keys() == expected.keys()
    assert answer["choices"] == expected["choices"]
    assert answer["usage"] == expected["usage"]
    assert answer["object"] == expected["object"] and answer["served_by"] == "us-east"
    assert "meridian_resumes" not in answer
    assert near.seen[-1].body["stream"] is True


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    "failure", ["die_after_chunks", "error_after_chunks", "stall_after_chunks"]
)
def test_a_non_stream_broken_mid_way_continues_in_the_next_region_as_one_body(
    resumable: Resumable, endpoint: str, failure: str
) -> None:
    gateway = resumable.gateway(stream_idle_timeout_s=0.5)
    near, far = resumable.near, resumable.far
    setattr(near.behavior, failure, 2)
    path, body = whole_request(endpoint)
    response = resumable.post(gateway, body, path)
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
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway()
    resumable.near.behavior.die_after_chunks = 3
    path, body = whole_request("chat")
    answer = resumable.post(gateway, {**body, "return_token_ids": True}, path).json()
    assert answer["choices"][0]["token_ids"] == [100 + i for i in range(NUM_TOKENS)]
    assert answer["meridian_resumes"] == 1


def test_without_another_region_a_broken_non_stream_gets_the_error_as_before(
    resumable: Resumable,
) -> None:
    gateway = resumable.gateway()
    resumable.without_far(gateway)
    resumable.near.behavior.die_after_chunks = 2
    path, body = whole_request("chat")
    response = resumable.post(gateway, body, path)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    assert 'reason="exhausted"} 1.0' in metric(
        gateway, "meridian_gateway_stream_resumes_refused_total"
    )


def test_a_non_stream_whose_stream_is_malformed_is_a_502_in_the_access_log_too(
    resumable: Resumable, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = resumable.gateway(access_log=True)
    resumable.near.behavior.malformed_after_chunks = 2
    path, body = whole_request("chat")
    with caplog.at_level("INFO", logger="gateway.access"):
        response = resumable.post(gateway, body, path)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "stream_interrupted"
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert line.startswith(f"POST {path} 502 region=us-east")
    assert 'region="us-east",status="502"' in metric(gateway, "meridian_gateway_requests_total")


@pytest.mark.parametrize("endpoint", ["stream", "chat", "completions"])
def test_a_stream_cut_between_its_finish_and_its_usage_still_has_its_usage(
    resumable: Resumable, endpoint: str
) -> None:
    gateway = resumable.gateway()
    resumable.near.behavior.die_after_finish = True
    if endpoint == "stream":
        path, body = CHAT_PATH, {**CHAT, "stream_options": {"include_usage": True}}
    else:
        path, body = whole_request(endpoint)
    response = resumable.post(gateway, body, path)
    assert response.status_code == 200
    expected = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": NUM_TOKENS,
        "total_tokens": PROMPT_TOKENS + NUM_TOKENS,
    }
    if endpoint == "stream":
        chunks = chunks_of(response.text)
        assert text_of(chunks) == WHOLE_TEXT and events_of(response.text)[-1] == "[DONE]"
        assert chunks[-1]["usage"] == expected and chunks[-1]["choices"] == []
        assert all("prompt_token_ids" not in c for c in chunks)
    else:
        answer = response.json()
        assert text_of_whole(answer) == WHOLE_TEXT and answer["usage"] == expected
        assert "prompt_token_ids" not in answer
    assert resumable.far.num_requests == 0  # nothing was left to resume
