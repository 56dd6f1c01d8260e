"""A client that goes away aborts its request at once: the engine (fake_engine.py, held so that
only an abort can end the request) is left with nothing running and every KV block free."""

from __future__ import annotations

import time

import httpx
import pytest
from node_helpers import MODEL_NAME, FakeNodes, NodeHandle, engine_idle, wait_until

LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
ABORT_WITHIN_S = 2.0


def _running(node: NodeHandle) -> bool:
    stats = node.stats()
    return stats.num_running == 1 and stats.kv_blocks_free < stats.kv_blocks_total


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(fake_nodes: FakeNodes) -> None:
    llm, node = fake_nodes()
    llm.hold(after_tokens=6)
    body = {"model": MODEL_NAME, "prompt": "Count with me: one, two,", "stream": True, **LONG}
    with node.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert all(line.startswith("data: {") for line in received)
        assert _running(node)
        closed_at = time.monotonic()
    # Leaving the `with` closed the connection mid-stream.
    assert wait_until(lambda: engine_idle(node), timeout_s=ABORT_WITHIN_S)
    assert time.monotonic() - closed_at < ABORT_WITHIN_S
    assert wait_until(lambda: node.runtime.admission.num_in_flight == 0)


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(fake_nodes: FakeNodes) -> None:
    llm, node = fake_nodes()
    llm.hold()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell a story"}], **LONG}
    with (
        httpx.Client(base_url=node.base_url, timeout=httpx.Timeout(5.0, read=0.6)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/chat/completions", json=body)
    assert wait_until(lambda: engine_idle(node), timeout_s=ABORT_WITHIN_S)
    assert wait_until(lambda: node.runtime.admission.num_in_flight == 0)
    metrics = httpx.get(node.base_url + "/metrics").text
    assert 'meridian:request_success_total{finished_reason="abort"' in metrics
