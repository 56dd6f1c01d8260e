"""Admission control under overload (429 with Retry-After) and the Prometheus metrics, over the
fake engine (fake_engine.py): held, so that the request admitted first waits for its first token
while the rest arrive."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_engine import FakeEngine
from node_helpers import MODEL_NAME, FakeNodes, NodeHandle, engine_idle, wait_until
from prometheus_client.parser import text_string_to_metric_families

GAUGES = {
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "cache_config_info",
    "kv_cache_free_blocks",
    "num_waiting_prefill_tokens",
    "decode_tokens_per_second",
}
COUNTERS = {
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
}
HISTOGRAMS = {
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
}


@pytest.fixture
def tight_node(fake_nodes: FakeNodes) -> tuple[FakeEngine, NodeHandle]:
    """A node that lets at most one request wait."""
    return fake_nodes(max_num_waiting_requests=1, retry_after_s=2)


async def _burst(
    base_url: str, num_requests: int, headers: dict[str, str] | None = None
) -> list[httpx.Response]:
    words = " ".join(["river", "stone", "light", "garden"] * 5)
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Summarise: {words}"}],
        "max_tokens": 4,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as http:
        return await asyncio.gather(
            *(
                http.post("/v1/chat/completions", json=body, headers=headers)
                for _ in range(num_requests)
            )
        )


def held_burst(
    llm: FakeEngine, node: NodeHandle, num_requests: int, headers: dict[str, str] | None = None
) -> list[httpx.Response]:
    """`num_requests` at once while the engine gives none a token, released once all but the
    first are refused."""
    llm.hold()
    admission = node.runtime.admission
    num_refused = admission.num_rejected + admission.num_deflected + num_requests - 1
    with ThreadPoolExecutor(1) as pool:
        burst = pool.submit(asyncio.run, _burst(node.base_url, num_requests, headers))
        try:
            assert wait_until(
                lambda: admission.num_rejected + admission.num_deflected == num_refused
            )
        finally:
            llm.release()
        return burst.result()


def test_overload_gets_429_with_retry_after(tight_node: tuple[FakeEngine, NodeHandle]) -> None:
    llm, node = tight_node
    responses = held_burst(llm, node, 6)
    statuses = [r.status_code for r in responses]
    assert sorted(statuses) == [200] + [429] * 5, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "2"
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert wait_until(lambda: engine_idle(node))
    assert node.runtime.admission.num_in_flight == 0
    # Once the queue is empty again, requests are admitted.
    assert [r.status_code for r in asyncio.run(_burst(node.base_url, 1))] == [200]


def test_envoy_first_attempts_are_deflected_while_a_request_waits(
    tight_node: tuple[FakeEngine, NodeHandle],
) -> None:
    llm, node = tight_node
    responses = held_burst(llm, node, 4, {"x-envoy-attempt-count": "1"})
    statuses = [r.status_code for r in responses]
    assert sorted(statuses) == [200] + [429] * 3, statuses
    for response in responses:
        if response.status_code == 429:  # deflected, not overloaded: Envoy retries elsewhere
            assert response.headers["x-meridian-deflected"] == "1"
            assert response.json()["error"]["code"] == "deflected"
    assert node.runtime.admission.num_deflected == 3
    assert wait_until(lambda: engine_idle(node))
    # A retry (attempt 2) is never deflected; with nothing waiting, neither is attempt 1.
    for attempt in ("2", "1"):
        burst = asyncio.run(_burst(node.base_url, 1, {"x-envoy-attempt-count": attempt}))
        assert [r.status_code for r in burst] == [200]


def _scrape(node: NodeHandle) -> dict[str, float]:
    """Every sample as `name{labels}` → value, after checking each family's type."""
    text = httpx.get(node.base_url + "/metrics").text
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    prefix = "meridian:"
    assert {name for name, kind in types.items() if kind == "gauge"} == {prefix + g for g in GAUGES}
    assert {n for n, k in types.items() if k == "counter"} >= {prefix + c for c in COUNTERS}
    assert {n for n, k in types.items() if k == "histogram"} == {prefix + h for h in HISTOGRAMS}
    return samples


def test_metrics_parse_and_move_with_traffic(node: NodeHandle) -> None:
    model = f"model_name={MODEL_NAME}"
    before = _scrape(node)
    info = [k for k in before if k.startswith("meridian:cache_config_info")]
    assert info == [
        f"meridian:cache_config_info{{block_size=16,{model},num_gpu_blocks={node.stats().kv_blocks_total}}}"
    ]
    with node.client() as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "One, two, three,",
                "max_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200
    after = _scrape(node)

    def delta(name: str, labels: str = model) -> float:
        key = f"meridian:{name}{{{labels}}}"
        return after[key] - before.get(key, 0.0)

    assert delta("generation_tokens_total") == 5
    assert delta("prompt_tokens_total") >= 1
    assert delta("prefix_cache_queries_total") >= 1
    assert delta("request_success_total", f"finished_reason=length,{model}") == 1
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == 4
    assert delta("e2e_request_latency_seconds_count") == 1
    assert delta("request_queue_time_seconds_count") == 1
    assert after[f"meridian:num_requests_running{{{model}}}"] == 0
    assert 0.0 <= after[f"meridian:kv_cache_usage_perc{{{model}}}"] <= 1.0
