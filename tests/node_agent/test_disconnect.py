"""A client that goes away aborts its request at once: the engine frees its KV blocks."""

from __future__ import annotations

import time

import httpx
import pytest
from node_helpers import MODEL_NAME, NodeHandle, engine_idle, wait_until

pytestmark = pytest.mark.slow

# Long enough that only an abort can end it within the test's patience (~40 ms per token here).
LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
ABORT_WITHIN_S = 2.0


def _running(node: NodeHandle) -> bool:
    stats = node.stats()
    return stats.num_running == 1 and stats.kv_blocks_free < stats.kv_blocks_total


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(node: NodeHandle) -> None:
    assert wait_until(lambda: engine_idle(node))
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


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(node: NodeHandle) -> None:
    assert wait_until(lambda: engine_idle(node))
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
