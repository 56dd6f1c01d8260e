"""What the node does when its engine fails, over the fake engine (fake_engine.py): a stream under
way ends with an error event, `/health` and `/ready` say why, new requests get 503 and the
heartbeat says so. The real engine's ways of failing (a killed core process, a silent one) are
in test_engine_process.py and test_engine_liveness.py."""

from __future__ import annotations

import json
from collections.abc import Callable

from node_helpers import MODEL_NAME, FakeNodes, NodeHandle

STREAM = {"model": MODEL_NAME, "prompt": "Count: one, two,", "stream": True, "max_tokens": 50}
PLAIN = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}


def stream_ended_by(node: NodeHandle, fail: Callable[[], None]) -> dict[str, str]:
    """The error event that ends a stream when `fail()` is called after its first chunk."""
    with node.client() as http, http.stream("POST", "/v1/completions", json=STREAM) as stream:
        assert stream.status_code == 200
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith("data: {")
        fail()
        rest = list(lines)  # the stream ends, rather than hanging with the engine
    assert rest[-1] == "data: [DONE]"
    error: dict[str, str] = json.loads(rest[-2].removeprefix("data: "))["error"]
    return error


def test_a_dead_engine_ends_streams_and_the_node_reports_it(fake_nodes: FakeNodes) -> None:
    llm, node = fake_nodes()
    llm.hold(after_tokens=1)
    error = stream_ended_by(node, lambda: llm.fail("the core fell over"))
    assert error["code"] == "engine_dead" and "the core fell over" in error["message"]
    with node.client() as http:
        assert http.get("/health").status_code == 503
        assert http.get("/ready").json()["reason"] == "the engine has stopped"
        refused = http.post("/v1/completions", json=PLAIN)
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "not_ready")
    beat = node.runtime.heartbeat()
    assert beat is not None and beat.draining and not beat.engine_alive


def test_a_silent_engine_fails_requests_until_it_answers_again(fake_nodes: FakeNodes) -> None:
    llm, node = fake_nodes()
    llm.hold(after_tokens=1)
    error = stream_ended_by(node, lambda: llm.stop_answering("stuck in a test"))
    assert error["code"] == "engine_dead" and "stuck in a test" in error["message"]
    with node.client() as http:
        ready = http.get("/ready")
        assert ready.status_code == http.get("/health").status_code == 503
        assert "the engine core does not answer: stuck in a test" in ready.json()["reason"]
        assert http.post("/v1/completions", json=PLAIN).status_code == 503
        beat = node.runtime.heartbeat()
        assert beat is not None and not beat.engine_alive and not beat.draining
        llm.release()
        llm.answer_again()
        node.wait_ready()
        assert http.post("/v1/completions", json=PLAIN).status_code == 200
