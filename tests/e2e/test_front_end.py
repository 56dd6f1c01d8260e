"""End to end, the global front end: `meridian up --detach` with three PoPs (an edge node beside
one), three client cities and one region; each city reaches its nearest PoP through the Anycast
front and through the stack's DNS (`meridian resolve`, then a connection to what it answered);
light `auto` requests from beside the edge are answered there; a PoP killed under 16 concurrent
non-streamed requests from its clients costs none of them, and new connections land on the next
PoP; `meridian down` stops it all. Bounded: one region node and one edge node load the model.
A key's limits hold across PoPs, each PoP's buckets in a redis-server of its own where there is
one (the `stack` extra installs one), else in its gateway."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from bounded_wait import wait_until
from port_blocks import free_stack_config
from suite_env import child_env
from tf_helpers import REPO_ROOT

from stack.layout import StackLayout
from stack.servers import redis_server_path
from stack.state import StateDir
from stack.summary import limits_mode

NEAREST = {"sydney": "sydney", "paris": "london", "chicago": "new-york"}
NUM_CONCURRENT = 16
HAS_REDIS = redis_server_path() is not None


def _config_text(base: int) -> str:
    # RTT routes: base+50 + 100*p for PoP p, redis base+60 + p; the next range starts far enough
    # away.
    return (
        "regions: [{name: us-east}]\n"
        "pops: [new-york, london, sydney]\nclients: [sydney, paris, chicago]\n"
        "edge: {pops: [sydney], max_tokens: 32}\nenvoy: off\n"
        "node: {kv_cache_gib: 0.25, max_num_seqs: 16}\n"
        # The key `up` makes: room for the failover below at whichever PoP's share.
        "api_key: {rpm: 100000, tpm: 100000000}\n"
        f"ports: {{control_plane: {base}, xds: {base + 1}, dns: {base + 2}, "
        f"gateway: {base + 3}, anycast_admin: {base + 4}, anycast_base: {base + 5}, "
        f"redis: {base + 60}, node_base: {base + 10}, edge_base: {base + 20}, "
        f"envoy_base: {base + 30}, envoy_admin_base: {base + 40}, "
        f"rtt_proxy_base: {base + 50}, direct_base: {base + 80}, "
        # Not the default 9464: another stack test may run beside this one (xdist).
        f"gateway_metrics: {base + 70}}}\n"
    )


def meridian(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = child_env(keep=("MERIDIAN_HOME",))
    return subprocess.run(
        [sys.executable, "-m", "stack", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@dataclass
class Front:
    layout: StackLayout
    state_root: Path
    output: str

    def printed(self, label: str) -> str:
        found = re.search(rf"^  {label}   (\S+)", self.output, re.MULTILINE)
        assert found, f"`meridian up` printed no {label}:\n{self.output}"
        return found.group(1)

    @property
    def verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.printed("CA cert"))

    def client(self, base_url: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.printed('API key')}"}
        return httpx.Client(base_url=base_url, verify=self.verify, headers=headers, timeout=120)

    def city_url(self, city: str) -> str:
        return next(c.url for c in self.layout.clients if c.city == city)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    config, layout = free_stack_config(
        tmp_path, _config_text, span=100, step=100, has_redis=HAS_REDIS
    )
    state_root = tmp_path / "state"
    try:
        up = meridian(
            "up",
            "--config",
            str(config),
            "--state-dir",
            str(state_root),
            "--detach",
            timeout_s=600,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        yield Front(layout, state_root, up.stdout)
    finally:
        down = meridian("down", "--state-dir", str(state_root))
        assert down.returncode == 0, down.stdout + down.stderr


def _chat(client: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def _check_a_keys_limit_is_shared_across_pops(front: Front) -> None:
    """One key's requests per minute are counted across PoPs (the control plane's shares: a
    fresh key's burst is split between them, so the fleet admits at most its 3)."""
    admin = StateDir(front.state_root).read_tokens()["MERIDIAN_ADMIN_TOKEN"]
    created = httpx.post(
        front.layout.control_plane_url + "/v1/keys",
        json={"name": "three-a-minute", "rpm": 3, "tpm": 100_000},
        headers={"Authorization": f"Bearer {admin}"},
    ).json()
    body = {"model": "auto", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    statuses = []
    for city in ("chicago", "paris") * 3:  # new-york, london, new-york, ...
        headers = {"Authorization": f"Bearer {created['secret']}"}
        with httpx.Client(verify=front.verify, headers=headers, timeout=120) as client:

            def known(url: str = front.city_url(city) + "/v1/chat/completions") -> int:
                status = client.post(url, json=body).status_code
                return 0 if status == 401 else status

            # The new key reaches every gateway within about a second.
            statuses.append(wait_until(known, 10, f"the new key at {city}'s PoP"))
    assert statuses[:2] == [200, 200] and statuses[-2:] == [429, 429], statuses
    assert statuses.count(200) <= 3, statuses


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cities_reach_their_nearest_pop_by_anycast_and_dns_edge_answers_light_auto_and_a_killed_pop_costs_nothing(  # noqa: E501
    front: Front,
) -> None:
    # Each city, by Anycast and by DNS, lands on its nearest PoP.
    for city, pop in NEAREST.items():
        with front.client(front.city_url(city)) as client:
            assert (
                _chat(client, "auto" if city != "sydney" else "smollm2-135m-instruct").headers[
                    "x-meridian-pop"
                ]
                == pop
            )
        resolved = meridian(
            "resolve", "--from", city, "--short", "--state-dir", str(front.state_root)
        )
        assert resolved.returncode == 0, resolved.stderr
        address = resolved.stdout.strip()
        with front.client(f"https://{address}:{front.layout.gateway_port}") as client:
            assert _chat(client, "smollm2-135m-instruct").headers["x-meridian-pop"] == pop
    # Each city's public path straight to the region (geo-DNS alone, no PoP) reaches its node.
    for place in front.layout.clients:
        assert place.direct is not None and place.direct.region == "us-east"
        assert httpx.get(place.direct.url + "/ready", timeout=30).status_code == 200
        assert f"{place.direct.url}/v1   (public, straight to us-east" in front.output
    # Light `auto` requests beside the edge are answered there; heavy ones by the region.
    with front.client(front.city_url("sydney")) as client:
        light = _chat(client, "auto")
        assert (light.headers["x-meridian-region"], light.headers["x-meridian-tier"]) == (
            "edge-sydney",
            "edge",
        )
        heavy = _chat(client, "auto", max_tokens=100)
        assert heavy.headers["x-meridian-tier"] == "region"
    status = meridian("status", "--state-dir", str(front.state_root))
    assert "edge+region" in status.stdout and limits_mode(front.layout) in status.stdout
    _check_a_keys_limit_is_shared_across_pops(front)
    # London killed under 16 concurrent non-streamed requests from Paris.
    state = StateDir(front.state_root).read()
    assert state is not None
    london = next(r for r in state.processes if r.name == "gateway london")
    failures: list[str] = []
    pops: list[str] = []
    stop = threading.Event()

    def work() -> None:
        http = httpx.Client(verify=front.verify, timeout=120)
        client = openai.OpenAI(
            base_url=front.city_url("paris") + "/v1",
            api_key=front.printed("API key"),
            http_client=http,  # type: ignore[arg-type]
        )
        while not stop.is_set():
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="smollm2-135m-instruct",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4,
                )
                pops.append(raw.headers["x-meridian-pop"])
            except openai.OpenAIError as exc:
                failures.append(repr(exc))
        http.close()

    workers = [threading.Thread(target=work) for _ in range(NUM_CONCURRENT)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 120
    try:
        wait_until(
            lambda: pops.count("london") >= NUM_CONCURRENT or failures,
            120,
            f"{NUM_CONCURRENT} answers from london",
        )
        os.kill(london.pid, signal.SIGKILL)
        killed_at = len(pops)
        wait_until(
            lambda: len(pops) >= killed_at + NUM_CONCURRENT or failures,
            max(0.0, deadline - time.monotonic()),
            f"{NUM_CONCURRENT} answers after london's death",
        )
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
    assert failures == []
    assert "new-york" in pops[killed_at:]
    with front.client(front.city_url("paris")) as client:  # a new connection
        assert client.get("/health").json()["pop"] == "new-york"
