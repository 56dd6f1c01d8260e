"""One decision across the two levels, live: a real control plane, a real gateway and a real
node agent in each of two near regions (us-east and toronto, within the near-best tolerance
of each other from New York). A system prompt that the gateway's rendezvous guess sends to
us-east is served once in toronto; toronto's node reports its key in its beats, the summary's
digest carries it, and the gateway then sends that prompt to toronto. A prompt no region
reports still goes where the guess sends it."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gw_fleet import Fleet, wait_until
from test_gw_real_nodes import MAX_LOAD_S, start_real_node, stop_nodes

from engine.model_store import DEFAULT_MODEL
from gateway.cache_salt import cache_salt_of
from gateway.routing import Router
from wire.prefix_key import PREFIX_KEY_HEADER, prefix_key_of

pytestmark = pytest.mark.slow

REGIONS = ("us-east", "toronto")


def chat(system: str) -> dict[str, object]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
    return {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 2}


def guessed_for(router: Router, region: str, count: int, key_of: Callable[[str], str]) -> list[str]:
    """`count` system prompts the plan sends to `region` by its guess (no digest holds them)."""
    found: list[str] = []
    for i in range(200):
        system = f"You are assistant number {i}. Answer briefly."
        plan = router.plan(10, key_of(system), model=DEFAULT_MODEL)
        if plan.reason == "affinity" and plan.candidates[0].region == region:
            found.append(system)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} prompts guessed for {region}")


@pytest.fixture
def near_fleet(
    tmp_path: Path, server_cert: tuple[Path, Path], smollm2_gguf: Path
) -> Iterator[tuple[Fleet, dict[str, str]]]:
    fleet = Fleet(tmp_path, server_cert, heartbeat_interval_s=0.5)
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        fleet.start_control_plane()
        for region in REGIONS:
            nodes.append(start_real_node(fleet, region, tmp_path))
        ingresses = dict(zip(REGIONS, [proxy.url for proxy in fleet.proxies], strict=True))
        yield fleet, ingresses
    finally:
        stop_nodes(nodes)
        fleet.close()


def test_a_prompt_cached_in_toronto_goes_to_toronto_by_the_digest(
    near_fleet: tuple[Fleet, dict[str, str]], client_ssl: ssl.SSLContext
) -> None:
    fleet, ingresses = near_fleet
    # Both regions near-best throughout: a node that has served measures its prefill rate
    # (tens of tokens a second on a loaded CPU), which moves its region's cost by far more than
    # the default slack; the choice between near-best regions is what is tested.
    gateway = fleet.start_gateway(near_best_slack_s=5.0)
    key_id, secret = fleet.create_key()

    def key_of(system: str) -> str:  # as the gateway makes it for this key (its cache salt)
        return prefix_key_of(system, cache_salt_of(key_id))

    fleet.wait_for_gateway(gateway, num_regions=2, timeout_s=MAX_LOAD_S)
    router = gateway.handlers.router
    cached, plain = guessed_for(router, "us-east", 2, key_of)

    # Served once in toronto (at its ingress, with the key as the gateway sends it).
    with httpx.Client(base_url=ingresses["toronto"], timeout=60.0) as node:
        response = node.post(
            "/v1/chat/completions", json=chat(cached), headers={PREFIX_KEY_HEADER: key_of(cached)}
        )
        assert response.status_code == 200, response.text

    def toronto_digest() -> dict[str, int]:
        return dict(router.regions["toronto"].hot_prefixes(DEFAULT_MODEL))

    wait_until(lambda: key_of(cached) in toronto_digest(), 10.0, "toronto's digest")
    assert toronto_digest() == {key_of(cached): 1}
    assert not router.regions["us-east"].hot_prefixes(DEFAULT_MODEL)

    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(
        base_url=gateway.base_url, headers=headers, verify=client_ssl, timeout=60.0
    ) as http:
        served = http.post("/v1/chat/completions", json=chat(cached))
        assert served.status_code == 200, served.text
        assert served.headers["x-meridian-region"] == "toronto"
        assert router.plan(10, key_of(cached), model=DEFAULT_MODEL).reason == "cached"
        # No region reports this one: the guess, as before.
        served = http.post("/v1/chat/completions", json=chat(plain))
        assert served.status_code == 200, served.text
        assert served.headers["x-meridian-region"] == "us-east"
    # The gateway sent the key upstream: us-east's node now reports the plain prompt.
    wait_until(lambda: key_of(plain) in router.regions["us-east"].hot_prefixes(DEFAULT_MODEL))
