"""Routing per model through a real gateway, a real control plane and fake regions whose nodes
serve one model each (and refuse others, as node agents do): each model is answered where it is
served, unknown names are 404 and names a key may not use 403 before any rate limit is spent
(with an empty catalog, a model whose nodes are all down is a 503, not unknown), a model without
capacity is answered by its fallback (named in `x-meridian-model`, and the spend is its), a
stream resumes only where the same weights serve its model, and a model taken out of the catalog
mid-stream lets the stream finish. The catalog and keys' model lists are written through the
control plane's admin API."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator

import httpx
import pytest
from gw_catalog import CatalogForwarder
from gw_fleet import FakeRegion, Fleet, GatewayThread, wait_until

from gateway.breaker import BreakerState
from gateway.errors import GatewayError
from gateway.keys import ApiKey
from wire.model_catalog import MODEL_HEADER, CatalogAlias, CatalogModel, ModelCatalog

CHAT_PATH = "/v1/chat/completions"
A_WEIGHTS, B_WEIGHTS = "a" * 32, "b" * 32
CATALOG = ModelCatalog(
    models=(CatalogModel(name="large", fallbacks=("small",)), CatalogModel(name="small")),
    aliases=(CatalogAlias(name="chat-default", target="large"),),
)


def chat(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


def chunks_of(body: str) -> list[dict[str, object]]:
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]
    return [json.loads(event) for event in events if event != "[DONE]"]


def client(gateway: GatewayThread, verify: ssl.SSLContext, secret: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.Client(base_url=gateway.base_url, verify=verify, headers=headers, timeout=30.0)


def wait_for_models(gateway: GatewayThread, *names: str) -> None:
    """Until the gateway routes `names` and sees a region with healthy nodes for each."""
    router = gateway.handlers.router

    def serves_all() -> bool:
        def is_served(name: str) -> bool:
            model = router.models.model_of.get(name)
            return model is not None and any(
                state.models.get(model) is not None and state.models[model].healthy_nodes > 0
                for state in router.regions.values()
            )

        return gateway.handlers.keys.is_loaded and all(map(is_served, names))

    wait_until(serves_all, 10.0, f"the gateway to route {names}")


def wait_for_key(
    gateway: GatewayThread, secret: str, models: tuple[str, ...] | None = None
) -> None:
    """Until the gateway holds the key of `secret` with the model list `models`."""
    keys = gateway.handlers.keys

    def key() -> ApiKey | None:
        try:
            return keys.authenticate(f"Bearer {secret}")
        except GatewayError:
            return None

    def has_models() -> bool:
        found = key()
        wanted = None if models is None else frozenset(models)
        return found is not None and found.models == wanted

    wait_until(has_models, 5.0, f"the key's model list {models}")


def new_key(
    fleet: Fleet, gateway: GatewayThread, rpm: int = 10_000, models: tuple[str, ...] | None = None
) -> str:
    """A new key's secret, once `gateway` holds it (`models`: the names it may use)."""
    body = {"name": "k", "rpm": rpm, "tpm": 10_000_000, "models": models}
    secret: str = fleet.admin_call("POST", "/v1/keys", json=body)["secret"]
    wait_for_key(gateway, secret, models)
    return secret


def assert_answered_by(response: httpx.Response, region: str, model: str) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["x-meridian-region"] == region
    assert response.headers[MODEL_HEADER] == model


@pytest.fixture
def two_models(fleet: Fleet) -> Fleet:
    """`small` in us-east (about 5 ms from the New York PoP), `large` in eu-west (about 55)."""
    fleet.add_region("us-east", model="small")
    fleet.add_region("eu-west", model="large")
    return fleet


@pytest.fixture
def served_gateway(two_models: Fleet) -> GatewayThread:
    """A gateway on the control plane's own documents: no catalog, every served name routed."""
    gateway = two_models.start_gateway()
    wait_for_models(gateway, "small", "large")
    return gateway


@pytest.fixture
def forwarder(two_models: Fleet) -> Iterator[CatalogForwarder]:
    """`CATALOG` put into the control plane's documents on their way to a gateway started on
    `forwarder.url` (gw_catalog.py): the edge and model-list tests set catalogs through it."""
    forwarder = CatalogForwarder(two_models.cp_url, CATALOG)
    two_models.loop.run(forwarder.start())
    yield forwarder
    two_models.loop.run(forwarder.stop())


def write_catalog(fleet: Fleet, catalog: ModelCatalog) -> None:
    """`catalog` through the admin API: the models, their aliases, then their fallbacks (a
    fallback must name a model or alias that exists)."""
    for model in catalog.models:
        fleet.admin_call("POST", "/v1/models", json={"name": model.name})
    for alias in catalog.aliases:
        fleet.admin_call("POST", "/v1/models", json={"name": alias.name, "target": alias.target})
    for model in catalog.models:
        if model.fallbacks:
            body = {"fallbacks": list(model.fallbacks)}
            fleet.admin_call("PATCH", f"/v1/models/{model.name}", json=body)


@pytest.fixture
def catalog_gateway(two_models: Fleet) -> GatewayThread:
    """A gateway once the operator has listed `CATALOG`."""
    write_catalog(two_models, CATALOG)
    gateway = two_models.start_gateway()
    wait_for_models(gateway, "large", "small", "chat-default")
    return gateway


def flip_to_small(fleet: Fleet, gateway: GatewayThread) -> None:
    """Point chat-default at `small`, once `gateway` has the document that says so."""
    fleet.admin_call("PATCH", "/v1/models/chat-default", json={"target": "small"})
    routes = gateway.handlers.router
    wait_until(lambda: routes.models.model_of["chat-default"] == "small", 5.0, "the flip")


def test_each_model_is_answered_by_the_region_that_serves_it(
    two_models: Fleet, served_gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> None:
    # `large` crosses the ocean although us-east is nearer; `small` stays near.
    secret = new_key(two_models, served_gateway)
    with client(served_gateway, client_ssl, secret) as http:
        small = http.post(CHAT_PATH, json=chat("small"))
        assert_answered_by(small, "us-east", "small")
        assert small.json()["model"] == "small"
        large = http.post(CHAT_PATH, json=chat("large", stream=True))
        assert_answered_by(large, "eu-west", "large")
        assert {chunk["model"] for chunk in chunks_of(large.text)} == {"large"}
    far = two_models.regions["eu-west"].upstream.seen
    assert [seen.body["model"] for seen in far] == ["large"]
    assert far[0].headers[MODEL_HEADER] == "large"  # what the region's Envoy routes on
    assert [seen.body["model"] for seen in two_models.regions["us-east"].upstream.seen] == ["small"]


def test_with_an_empty_catalog_a_model_whose_nodes_are_down_is_a_503_not_a_404(
    two_models: Fleet, served_gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_models, served_gateway)
    two_models.kill_region("eu-west")  # the one node serving `large`
    router = served_gateway.handlers.router

    def large_has_no_nodes() -> bool:
        load = router.regions["eu-west"].models.get("large")
        return load is not None and load.healthy_nodes == 0

    wait_until(large_has_no_nodes, 10.0, "eu-west's node of large to be unhealthy")
    with client(served_gateway, client_ssl, secret) as http:
        none = http.post(CHAT_PATH, json=chat("large"))
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_capacity"


def test_an_unknown_model_is_a_404_that_spends_no_rate_limit(
    two_models: Fleet, served_gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_models, served_gateway, rpm=2)
    with client(served_gateway, client_ssl, secret) as http:
        for _ in range(3):
            unknown = http.post(CHAT_PATH, json=chat("gpt-4"))
            assert unknown.status_code == 404
            error = unknown.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert error["message"].endswith("Models you may use: large, small.")
        # The key's 2 requests a minute are still both there.
        assert [http.post(CHAT_PATH, json=chat("small")).status_code for _ in range(3)] == [
            200,
            200,
            429,
        ]
    assert all(r.upstream.num_requests <= 2 for r in two_models.regions.values())


def test_an_alias_is_answered_as_its_model_flips_and_a_limited_key_gets_403(
    two_models: Fleet,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    first_secret = new_key(two_models, catalog_gateway)
    with client(catalog_gateway, client_ssl, first_secret) as http:
        aliased = http.post(CHAT_PATH, json=chat("chat-default"))
        assert_answered_by(aliased, "eu-west", "large")
        assert aliased.json()["model"] == "large"
    assert two_models.regions["eu-west"].upstream.seen[-1].body["model"] == "large"
    secret = new_key(two_models, catalog_gateway, rpm=2, models=("small",))
    with client(catalog_gateway, client_ssl, secret) as http:
        for name in ("large", "chat-default", "large"):
            refused = http.post(CHAT_PATH, json=chat(name))
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "model_not_allowed"
        unknown = http.post(CHAT_PATH, json=chat("gpt-4"))
        assert unknown.json()["error"]["message"].endswith("Models you may use: small.")
        # Refusals spent none of its 2 requests a minute.
        assert_answered_by(http.post(CHAT_PATH, json=chat("small")), "us-east", "small")
        assert_answered_by(http.post(CHAT_PATH, json=chat("small")), "us-east", "small")
    flip_to_small(two_models, catalog_gateway)  # a rollout: the next document moves traffic
    with client(catalog_gateway, client_ssl, first_secret) as http:
        assert_answered_by(http.post(CHAT_PATH, json=chat("chat-default")), "us-east", "small")


def test_limits_named_by_an_alias_apply_to_the_model_it_names_and_follow_a_flip(
    two_models: Fleet,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    limits = {"chat-default": {"rpm": 2, "tpm": 1_000_000}}
    body = {"name": "k", "rpm": 10_000, "tpm": 10_000_000, "model_limits": limits}
    secret = two_models.admin_call("POST", "/v1/keys", json=body)["secret"]
    wait_for_key(catalog_gateway, secret)
    with client(catalog_gateway, client_ssl, secret) as http:
        # chat-default names `large`: its limits hold for `large` by any name.
        statuses = [http.post(CHAT_PATH, json=chat(name)).status_code for name in ("large",) * 2]
        refused = http.post(CHAT_PATH, json=chat("chat-default"))
        assert statuses == [200, 200] and refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "(RPM) on model chat-default: Limit 2" in error["message"]
        assert_answered_by(http.post(CHAT_PATH, json=chat("small")), "us-east", "small")
    flip_to_small(two_models, catalog_gateway)
    with client(catalog_gateway, client_ssl, secret) as http:
        assert_answered_by(http.post(CHAT_PATH, json=chat("large")), "eu-west", "large")
        # `small` now takes from chat-default's buckets, which `large` emptied.
        assert http.post(CHAT_PATH, json=chat("small")).status_code == 429


def test_a_slow_model_falls_back_and_its_last_fallback_is_waited_on(
    two_models: Fleet, client_ssl: ssl.SSLContext
) -> None:
    write_catalog(two_models, CATALOG)
    gateway = two_models.start_gateway(first_byte_timeout_s=0.3)
    wait_for_models(gateway, "large", "small")
    for region in two_models.regions.values():  # both slower than the first-byte timeout
        region.upstream.behavior.delay_s = 1.0
    secret = new_key(two_models, gateway)
    with client(gateway, client_ssl, secret) as http:
        answer = http.post(CHAT_PATH, json=chat("large", stream=True))
    # `large` had a fallback to go to; `small`, the last place to ask, was waited on.
    assert_answered_by(answer, "us-east", "small")
    assert [r.upstream.num_requests for r in two_models.regions.values()] == [1, 1]


def test_a_model_without_capacity_is_answered_by_its_fallback(
    two_models: Fleet,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    far = two_models.regions["eu-west"].upstream
    router = catalog_gateway.handlers.router
    secret = new_key(two_models, catalog_gateway)
    with client(catalog_gateway, client_ssl, secret) as http:
        # Every region serving `large` refuses for capacity (its nodes' queues are full).
        far.behavior.fail_status = 429
        refused = http.post(CHAT_PATH, json=chat("large", stream=True))
        assert_answered_by(refused, "us-east", "small")
        assert {chunk["model"] for chunk in chunks_of(refused.text)} == {"small"}
        assert far.seen[-1].body["model"] == "large"
        # No region serving `large` can take work at all: straight to the fallback.
        far.behavior.fail_status = None
        two_models.set_region_state("eu-west", "draining")
        wait_until(lambda: not router.plan(10, model="large").candidates, 5.0, "the drain")
        num_seen = len(far.seen)
        drained = http.post(CHAT_PATH, json=chat("chat-default"))
        assert_answered_by(drained, "us-east", "small")
        assert drained.json()["model"] == "small" and len(far.seen) == num_seen
    # The key's spend is on the model that answered.
    key_id = catalog_gateway.handlers.keys.authenticate(f"Bearer {secret}").id

    def spent() -> dict[str, int]:
        models: dict[str, int] = two_models.admin_call("GET", f"/v1/keys/{key_id}/spend")["models"]
        return models

    wait_until(spent, 10.0, "the spend reported")
    assert spent().keys() == {"small"}
    # A key that may not use the fallback gets the model's own answer: no capacity.
    limited = new_key(two_models, catalog_gateway, models=("large",))
    with client(catalog_gateway, client_ssl, limited) as http:
        none = http.post(CHAT_PATH, json=chat("large"))
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_capacity"
    assert "'large'" in none.json()["error"]["message"]


def two_weights(fleet: Fleet) -> tuple[FakeRegion, FakeRegion, FakeRegion]:
    """`small` in us-east and eu-west on weights A, in chicago (between them by cost from New
    York) on weights B."""
    return (
        fleet.add_region("us-east", model="small", weights_id=A_WEIGHTS),
        fleet.add_region("chicago", model="small", weights_id=B_WEIGHTS),
        fleet.add_region("eu-west", model="small", weights_id=A_WEIGHTS),
    )


def started_on_weights(fleet: Fleet) -> GatewayThread:
    """A gateway that knows every region's weights, and plans us-east, chicago, eu-west."""
    gateway = fleet.start_gateway()
    router = gateway.handlers.router
    wait_until(
        lambda: all(router.serving_key_of(name, "small") for name in fleet.regions),
        10.0,
        "the weights of every region",
    )
    plan = router.plan(10, model="small").candidates
    assert [c.region for c in plan] == ["us-east", "chicago", "eu-west"]
    return gateway


def test_a_model_whose_only_region_is_circuit_open_is_answered_by_its_fallback_at_once(
    two_models: Fleet, client_ssl: ssl.SSLContext
) -> None:
    # eu-west, the one region serving `large`, fails (its node answers 503) until this PoP's
    # breaker for it opens; the summaries still list it, as in the seconds after a region dies.
    write_catalog(two_models, CATALOG)
    gateway = two_models.start_gateway(breaker_failures=3, breaker_open_s=600.0)
    wait_for_models(gateway, "large", "small")
    far = two_models.regions["eu-west"].upstream
    breaker = gateway.handlers.router.regions["eu-west"].breaker
    secret = new_key(two_models, gateway)
    far.behavior.fail_status = 503
    with client(gateway, client_ssl, secret) as http:
        for _ in range(3):
            assert_answered_by(http.post(CHAT_PATH, json=chat("large")), "us-east", "small")
        assert breaker.state is BreakerState.OPEN and len(far.seen) == 3
        # Were eu-west tried now, the request would wait there for a first byte: it is not.
        far.behavior.fail_status, far.behavior.delay_s = None, 60.0
        answered = http.post(CHAT_PATH, json=chat("large", stream=True))
        assert_answered_by(answered, "us-east", "small")
        assert {chunk["model"] for chunk in chunks_of(answered.text)} == {"small"}
    assert len(far.seen) == 3


def test_failover_goes_only_to_regions_serving_the_first_regions_weights(
    fleet: Fleet, client_ssl: ssl.SSLContext
) -> None:
    # us-east refuses; chicago is next by cost but serves `small` with other weights: the
    # request fails over to eu-west, whose weights are us-east's.
    first, other, same = two_weights(fleet)
    gateway = started_on_weights(fleet)
    first.upstream.behavior.fail_status = 500
    with client(gateway, client_ssl, new_key(fleet, gateway)) as http:
        assert_answered_by(http.post(CHAT_PATH, json=chat("small")), "eu-west", "small")
        # With no region of those weights left, the model has no capacity: 503, not chicago.
        same.upstream.behavior.fail_status = 503
        none = http.post(CHAT_PATH, json=chat("small"))
    assert none.status_code == 503
    assert other.upstream.num_requests == 0


def test_a_stream_resumes_only_where_the_same_weights_serve_its_model(
    fleet: Fleet, client_ssl: ssl.SSLContext
) -> None:
    # us-east breaks mid-stream. Chicago is the next cheapest, but its nodes serve `small`
    # with other weights: the continuation goes to eu-west, whose weights are us-east's.
    broken, other, same = two_weights(fleet)
    for region in (broken, other, same):
        region.upstream.behavior.num_chunks = 6
    broken.upstream.behavior.die_after_chunks = 2
    gateway = started_on_weights(fleet)
    with client(gateway, client_ssl, new_key(fleet, gateway)) as http:
        response = http.post(CHAT_PATH, json=chat("small", stream=True, max_tokens=50))
    assert response.status_code == 200
    chunks = chunks_of(response.text)
    text = "".join(
        (choice.get("delta") or {}).get("content") or ""
        for chunk in chunks
        for choice in chunk.get("choices") or []  # type: ignore[attr-defined]
    )
    assert text == "".join(f"t{i} " for i in range(6))  # whole, every token once
    assert other.upstream.num_requests == 0
    assert same.upstream.seen[-1].body["resume_token_ids"] == [100, 101]


def test_a_model_taken_out_of_the_catalog_mid_stream_finishes(
    two_models: Fleet,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    near = two_models.regions["us-east"].upstream
    near.behavior.num_chunks, near.behavior.chunk_delay_s = 100, 0.05
    secret = new_key(two_models, catalog_gateway)
    routes = catalog_gateway.handlers.router
    with (
        client(catalog_gateway, client_ssl, secret) as http,
        http.stream("POST", CHAT_PATH, json=chat("small", stream=True, max_tokens=200)) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        two_models.admin_call("PATCH", "/v1/models/large", json={"fallbacks": []})
        two_models.admin_call("DELETE", "/v1/models/small")
        wait_until(lambda: "small" not in routes.models.model_of, 10.0, "the catalog")
        near.behavior.chunk_delay_s = 0.0  # taken out mid-stream: the rest may come at once
        rest = "\n\n".join(lines)
    assert "t99 " in rest and "error" not in rest and rest.rstrip().endswith("[DONE]")
    with client(catalog_gateway, client_ssl, secret) as http:
        gone = http.post(CHAT_PATH, json=chat("small"))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
