"""A key's limits on a model and its token budget, across two PoPs sharing them through a real
control plane (no Redis: each PoP's process keeps its buckets): the model's RPM holds over both
PoPs, and a budget spent at one PoP is refused at the other once the control plane has heard."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_fleet import FAKE_MODEL, Fleet, GatewayThread, wait_until
from gw_shares import limiter_of, wait_for_even_shares

pytestmark = pytest.mark.slow  # starts a control plane, gateways and fake regions
POPS = ("new-york", "london")
CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
USED = 10  # the fake node's usage per request: 7 prompt tokens and 3 completion tokens


def two_pops(fleet: Fleet, access: dict[str, Any]) -> tuple[str, list[GatewayThread], str]:
    """us-east, a gateway at each PoP holding half of every key, and a key with `access`."""
    fleet.add_region("us-east")
    body = {"name": "k", "rpm": 10_000, "tpm": 10_000_000} | access
    created = fleet.admin_call("POST", "/v1/keys", json=body)
    gateways = [fleet.start_gateway(pop=pop) for pop in POPS]
    wait_for_even_shares(fleet, gateways)
    return created["id"], gateways, created["secret"]


@pytest.fixture
def clients(client_ssl: ssl.SSLContext) -> Iterator[dict[str, httpx.Client]]:
    made: dict[str, httpx.Client] = {}
    try:
        yield made
    finally:
        for client in made.values():
            client.close()


def client_of(
    clients: dict[str, httpx.Client], gateway: GatewayThread, secret: str, tls: ssl.SSLContext
) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"}
    client = httpx.Client(base_url=gateway.base_url, verify=tls, headers=headers, timeout=30.0)
    clients[gateway.settings.pop] = client
    return client


def test_a_models_rpm_holds_across_two_pops_and_its_429_names_the_model(
    fleet: Fleet, client_ssl: ssl.SSLContext, clients: dict[str, httpx.Client]
) -> None:
    access = {"model_limits": {FAKE_MODEL: {"rpm": 2, "tpm": 1_000_000}}}
    _, gateways, secret = two_pops(fleet, access)
    https = [client_of(clients, g, secret, client_ssl) for g in gateways]
    started = time.monotonic()
    statuses = [http.post("/v1/chat/completions", json=CHAT) for _ in range(3) for http in https]
    elapsed_s = time.monotonic() - started
    num_ok = sum(response.status_code == 200 for response in statuses)
    # The model's 2 RPM over both PoPs, plus its refill over the window and one report interval.
    assert 1 <= num_ok <= 2 + 2 / 60 * (elapsed_s + 1.0), [r.status_code for r in statuses]
    refused = next(response for response in statuses if response.status_code == 429)
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert f"requests per min (RPM) on model {FAKE_MODEL}: Limit 2" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1


def test_a_budget_spent_at_one_pop_is_refused_at_the_other_until_raised(
    fleet: Fleet, client_ssl: ssl.SSLContext, clients: dict[str, httpx.Client]
) -> None:
    key_id, (new_york, london), secret = two_pops(
        fleet, {"max_budget_tokens": 25, "budget_period": "1d"}
    )
    here, there = (client_of(clients, g, secret, client_ssl) for g in (new_york, london))
    assert [here.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [200] * 2
    # 20 of 25 spent: a stream is admitted, runs past the budget and finishes.
    with here.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.read().rstrip().endswith(b"data: [DONE]")
    refused = here.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"

    def spend() -> dict[str, Any]:
        answer: dict[str, Any] = fleet.admin_call("GET", f"/v1/keys/{key_id}/spend")
        return answer

    wait_until(lambda: spend()["spent_tokens"] == 3 * USED, 10.0, "the spend reported")
    assert spend()["models"] == {FAKE_MODEL: 3 * USED} and spend()["remaining_tokens"] == 0
    book = limiter_of(london).spend
    wait_until(lambda: book.spent_of(key_id) == 3 * USED, 10.0, "london to hear the spend")
    refused = there.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded" and "budget of 25 tokens per 1d" in error["message"]
    day_s = 86_400
    resets_in_s = day_s - time.time() % day_s  # at 00:00 UTC
    assert abs(int(refused.headers["retry-after"]) - resets_in_s) <= 5

    fleet.admin_call(
        "PATCH", f"/v1/keys/{key_id}", json={"max_budget_tokens": 100, "budget_period": "1d"}
    )
    keys = london.handlers.keys

    def london_budget() -> int | None:  # (london may have it before this looks: no index race)
        budget = keys.authenticate(f"Bearer {secret}").budget
        return None if budget is None else budget.max_tokens

    wait_until(lambda: london_budget() == 100, 10.0, "the raised budget at london")
    assert there.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_key_created_with_models_may_use_those_alone(
    fleet: Fleet, client_ssl: ssl.SSLContext, clients: dict[str, httpx.Client]
) -> None:
    fleet.add_region("us-east")
    gateway = fleet.start_gateway()
    fleet.wait_for_gateway(gateway)
    body = {"name": "k", "rpm": 100, "tpm": 100_000, "models": ["another-model"]}
    created = fleet.admin_call("POST", "/v1/keys", json=body)
    wait_until(lambda: len(gateway.handlers.keys) > 0, what="the key")
    http = client_of(clients, gateway, created["secret"], client_ssl)
    refused = http.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    fleet.admin_call("PATCH", f"/v1/keys/{created['id']}", json={"models": [FAKE_MODEL]})
    wait_until(
        lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200,
        5.0,
        "the key's new models",
    )
