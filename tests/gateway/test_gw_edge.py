"""The edge tier and the PoP's headers: the pure classifier, and a real gateway with a fake edge
node beside it (an OpenAI-speaking upstream, no RTT) and fake regions behind simulated RTTs.
`auto` requests that are light go to the edge, the rest (and all of them while the edge is
saturated or down) to a region; explicit models behave as before; every answer says where it
went; the thresholds and the share per tier are metrics. Per model: `auto` goes to the edge only
while it resolves to the edge's model (an alias flip takes it away), no other model's request
reaches the edge, and a version 1 document keeps the edge's model as configured."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator

import httpx
import pytest
import test_gw_models_live as live
from gw_catalog import CatalogForwarder
from gw_fakes import FakeUpstream
from gw_fleet import Fleet, GatewayThread, wait_until
from test_gw_model_list import FirstVersionForwarder
from test_gw_models_live import CATALOG, new_key, wait_for_models

from gateway.tiers import EdgeThresholds, classify
from wire.model_catalog import CatalogAlias, ModelCatalog

THRESHOLDS = EdgeThresholds(max_prompt_tokens=50, max_tokens=32)


@pytest.mark.parametrize(
    (
        "prompt_tokens",
        "max_tokens",
        "policy",
        "is_up",
        "is_saturated",
        "has_edge",
        "is_edge_model",
        "expected",
    ),
    [
        (10, 16, "auto", True, False, True, True, ("edge", "light")),
        (10, 33, "auto", True, False, True, True, ("region", "heavy")),
        (51, 16, "auto", True, False, True, True, ("region", "heavy")),
        (10, 16, "forbid", True, False, True, True, ("region", "forbidden")),
        (500, 1000, "force", True, False, True, True, ("edge", "forced")),
        (10, 16, "auto", False, False, True, True, ("region", "down")),
        (10, 16, "auto", True, True, True, True, ("region", "saturated")),
        (500, 1000, "force", True, True, True, True, ("region", "saturated")),
        (500, 1000, "auto", False, True, True, True, ("region", "heavy")),
        (10, 16, "auto", False, False, False, True, ("region", "no_edge")),
        (500, 1000, "force", False, False, False, True, ("region", "no_edge")),
        (10, 16, "forbid", False, False, False, True, ("region", "forbidden")),
        (10, 16, "auto", True, False, True, False, ("region", "other_model")),
        (500, 1000, "force", True, False, True, False, ("region", "other_model")),
        (500, 1000, "auto", True, False, True, False, ("region", "heavy")),
    ],
)
def test_classifier(
    prompt_tokens: int,
    max_tokens: int,
    policy: str,
    is_up: bool,
    is_saturated: bool,
    has_edge: bool,
    is_edge_model: bool,
    expected: tuple[str, str],
) -> None:
    choice = classify(
        prompt_tokens,
        max_tokens,
        THRESHOLDS,
        policy,  # type: ignore[arg-type]
        is_up,
        is_saturated,
        has_edge,
        is_edge_model,
    )
    assert (choice.tier, choice.reason) == expected


LIGHT = {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
HEAVY = {"model": "auto", "max_tokens": 200, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def edge(two_regions: Fleet) -> Iterator[FakeUpstream]:
    upstream = FakeUpstream("edge", "edge-n1")
    two_regions.loop.run(upstream.start())
    yield upstream
    two_regions.loop.run(upstream.stop())


@pytest.fixture
def policy_keys(two_regions: Fleet) -> dict[str, tuple[str, str]]:
    """Keys whose policy forbids or forces the edge: policy → (id, secret)."""
    return {policy: two_regions.create_key() for policy in ("forbid", "force")}


@pytest.fixture
def edge_gateway(
    two_regions: Fleet, edge: FakeUpstream, policy_keys: dict[str, tuple[str, str]]
) -> GatewayThread:
    gateway = two_regions.start_gateway(
        edge_policy={key_id: policy for policy, (key_id, _) in policy_keys.items()},
        auto_model="fake-model",
        edge_url=edge.url,
        edge_max_tokens=32,
        edge_max_prompt_tokens=50,
        edge_max_concurrency=2,
    )
    two_regions.wait_for_gateway(gateway)
    return gateway


@pytest.fixture
def client(
    edge_gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> Iterator[httpx.Client]:
    _, secret = two_regions.create_key()
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(
        base_url=edge_gateway.base_url, verify=client_ssl, headers=headers, timeout=30.0
    ) as http:
        yield http


def _where(response: httpx.Response) -> tuple[str, str, str]:
    headers = response.headers
    return headers["x-meridian-pop"], headers["x-meridian-region"], headers["x-meridian-tier"]


def test_light_auto_goes_to_the_edge_heavy_to_a_region_explicit_as_before(
    client: httpx.Client, two_regions: Fleet, edge: FakeUpstream, edge_gateway: GatewayThread
) -> None:
    light = client.post("/v1/chat/completions", json=LIGHT)
    assert light.status_code == 200, light.text
    assert _where(light) == ("new-york", "edge-new-york", "edge")
    assert edge.seen[-1].body["model"] == "fake-model"  # the alias resolved upstream
    assert light.headers["x-meridian-model"] == "fake-model"  # and named as what answered
    heavy = client.post("/v1/chat/completions", json=HEAVY)
    assert heavy.status_code == 200
    pop, region, tier = _where(heavy)
    assert (pop, tier) == ("new-york", "region") and region in two_regions.regions
    assert two_regions.regions[region].upstream.seen[-1].body["model"] == "fake-model"
    assert heavy.headers["x-meridian-model"] == "fake-model"
    explicit = client.post("/v1/chat/completions", json=LIGHT | {"model": "fake-model"})
    assert explicit.status_code == 200 and _where(explicit)[2] == "region"
    assert len(edge.seen) == 1
    models = client.get("/v1/models")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["fake-model", "auto"]
    refused = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.headers["x-meridian-pop"] == "new-york"
    metrics = httpx.get(edge_gateway.metrics_url).text
    assert 'meridian_gateway_auto_requests_total{reason="light",tier="edge"} 1.0' in metrics
    assert 'meridian_gateway_auto_requests_total{reason="heavy",tier="region"} 1.0' in metrics
    assert 'meridian_gateway_auto_tier_share{tier="edge"} 0.5' in metrics
    assert 'meridian_gateway_edge_threshold{setting="max_tokens"} 32.0' in metrics


CONSTRAINTS: dict[str, dict[str, object]] = {
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True},
        }
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "guided_regex": {"guided_regex": "[a-z]+"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
}


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_a_constrained_request_is_tiered_like_any_other_and_reaches_the_edge_whole(
    client: httpx.Client, two_regions: Fleet, edge: FakeUpstream, constraint: str
) -> None:
    fields = CONSTRAINTS[constraint]
    light = client.post("/v1/chat/completions", json=LIGHT | fields)
    assert light.status_code == 200, light.text
    assert _where(light)[2] == "edge"
    assert {k: edge.seen[-1].body[k] for k in fields} == fields
    heavy = client.post("/v1/chat/completions", json=HEAVY | fields)
    _, region, tier = _where(heavy)
    assert tier == "region"
    assert {k: two_regions.regions[region].upstream.seen[-1].body[k] for k in fields} == fields


def test_a_dead_edge_falls_back_to_a_region_within_the_request(
    client: httpx.Client, two_regions: Fleet, edge: FakeUpstream, edge_gateway: GatewayThread
) -> None:
    two_regions.loop.run(edge.stop())
    for _ in range(3):
        response = client.post("/v1/chat/completions", json=LIGHT)
        assert response.status_code == 200  # nothing lost
        assert _where(response)[2] == "region"
    health = client.get("/health").json()
    assert (health["edge"]["url"], health["edge"]["model"]) == (edge.url, "fake-model")


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_saturated_edge_sends_the_rest_to_a_region(
    client: httpx.Client, edge: FakeUpstream, edge_gateway: GatewayThread
) -> None:
    edge.behavior.delay_s = 1.0
    tiers: list[str] = []

    def send() -> None:
        tiers.append(client.post("/v1/chat/completions", json=LIGHT).headers["x-meridian-tier"])

    threads = [threading.Thread(target=send) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(tiers) == ["edge", "edge", "region", "region", "region"]  # concurrency 2
    assert edge_gateway.handlers.auto is not None
    assert edge_gateway.handlers.auto.edge is not None
    assert edge_gateway.handlers.auto.edge.num_in_flight == 0  # every edge request finished


def test_a_keys_policy_forbids_or_forces_the_edge(
    client: httpx.Client, policy_keys: dict[str, tuple[str, str]], edge_gateway: GatewayThread
) -> None:
    forbid = {"Authorization": f"Bearer {policy_keys['forbid'][1]}"}
    force = {"Authorization": f"Bearer {policy_keys['force'][1]}"}
    light = client.post("/v1/chat/completions", json=LIGHT, headers=forbid)
    assert light.status_code == 200 and _where(light)[2] == "region"
    heavy = client.post("/v1/chat/completions", json=HEAVY, headers=force)
    assert heavy.status_code == 200 and _where(heavy)[2] == "edge"
    metrics = httpx.get(edge_gateway.metrics_url).text
    assert 'meridian_gateway_auto_requests_total{reason="forbidden",tier="region"} 1.0' in metrics
    assert 'meridian_gateway_auto_requests_total{reason="forced",tier="edge"} 1.0' in metrics


# Per model.

# The regions (`small` in us-east, `large` in eu-west) and the catalog's forwarder.
two_models = live.two_models
forwarder = live.forwarder


@pytest.fixture
def small_edge(two_models: Fleet) -> Iterator[FakeUpstream]:
    """An edge node serving `small` (and refusing other models, as a node agent does)."""
    upstream = FakeUpstream("edge", "edge-n1", "small")
    two_models.loop.run(upstream.start())
    yield upstream
    two_models.loop.run(upstream.stop())


def test_auto_goes_to_the_edge_only_while_it_names_the_edges_model(
    two_models: Fleet,
    forwarder: CatalogForwarder,
    small_edge: FakeUpstream,
    client_ssl: ssl.SSLContext,
) -> None:
    # `auto` is the alias chat-default, first for `small` (the edge's model), then `large`.
    to_small = (CatalogAlias(name="chat-default", target="small"),)
    forwarder.set_catalog(CATALOG.model_copy(update={"aliases": to_small}))
    gateway = two_models.start_gateway(
        control_plane=forwarder.url,
        watch_wait_s=0.5,
        auto_model="chat-default",
        edge_url=small_edge.url,
        edge_model="small",
    )
    router = gateway.handlers.router
    wait_for_models(gateway, "small", "large")
    wait_until(lambda: router.models.model_of["chat-default"] == "small", 5.0, "the catalog")
    with live.client(gateway, client_ssl, new_key(two_models, gateway)) as http:
        light = http.post("/v1/chat/completions", json=LIGHT)
        assert _where(light)[1:] == ("edge-new-york", "edge")
        assert light.headers["x-meridian-model"] == "small"
        assert small_edge.seen[-1].body["model"] == "small"
        # A request naming a model goes to the regions, the edge's own model too.
        for model in ("small", "large"):
            named = http.post("/v1/chat/completions", json=LIGHT | {"model": model})
            assert named.status_code == 200 and _where(named)[2] == "region"
        assert small_edge.num_requests == 1
        # The rollout flips the alias: `auto` now means `large`, which the edge does not serve.
        forwarder.set_catalog(CATALOG)
        wait_until(lambda: router.models.model_of["chat-default"] == "large", 5.0, "the flip")
        flipped = http.post("/v1/chat/completions", json=LIGHT)
        assert _where(flipped)[1:] == ("eu-west", "region")
        assert flipped.headers["x-meridian-model"] == "large"
        assert small_edge.num_requests == 1
        assert http.get("/health").json()["edge"]["model"] == "small"
    metrics = httpx.get(gateway.metrics_url).text
    assert 'meridian_gateway_auto_requests_total{reason="other_model",tier="region"} 1.0' in metrics


def test_a_first_version_document_sends_auto_to_the_edge_as_its_configured_model(
    two_regions: Fleet, edge: FakeUpstream, client_ssl: ssl.SSLContext
) -> None:
    first = FirstVersionForwarder(two_regions.cp_url, ModelCatalog())
    two_regions.loop.run(first.start())
    try:
        gateway = two_regions.start_gateway(
            control_plane=first.url, auto_model="fake-model", edge_url=edge.url, edge_model="tiny"
        )
        two_regions.wait_for_gateway(gateway)
        with live.client(gateway, client_ssl, new_key(two_regions, gateway)) as http:
            light = http.post("/v1/chat/completions", json=LIGHT)
            assert _where(light)[2] == "edge" and light.headers["x-meridian-model"] == "tiny"
            assert edge.seen[-1].body["model"] == "tiny"
            heavy = http.post("/v1/chat/completions", json=HEAVY)
            assert _where(heavy)[2] == "region"
        region = two_regions.regions[_where(heavy)[1]]
        assert region.upstream.seen[-1].body["model"] == "fake-model"
    finally:
        two_regions.loop.run(first.stop())
