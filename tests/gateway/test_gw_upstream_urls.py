"""The gateway sends its serving token (and tenants' cache salts) only to ingress URLs that pass
the upstream rule, with the request's path joined to them, never concatenated: a region stored
with `http://HOST/internal/admin?steal=` (by an older control plane) is not routed to at all."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from gw_fleet import Fleet, wait_until

from control_plane.store import open_store
from gateway.region_ingress import with_region_ingress
from wire.region_summary import QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy
from wire.upstream_url import join_path

SERVING_TOKEN = "srv-" + "s" * 30
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Listener:
    """Any request to any path, recorded: where a leaked token would land."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # method, path and query, auth
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        async def record(request: web.Request) -> web.Response:
            self.seen.append(
                (request.method, request.path_qs, request.headers.get("authorization"))
            )
            return web.json_response({})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def seed_region(db_path: Path, name: str, ingress_url: str) -> None:
    """A region as an older control plane stored it, before URLs were checked."""
    store = open_store(str(db_path))
    try:
        store.write_sync(
            lambda conn: conn.execute(
                "INSERT INTO regions (name, lat, lon, ingress_url, weight, state, created_at, "
                "updated_at) VALUES (?, 39.0, -77.5, ?, 1.0, 'active', 0, 0)",
                (name, ingress_url),
            )
        )
    finally:
        store.close()


@pytest.fixture
def listener_fleet(
    tmp_path: Path, server_cert: tuple[Path, Path]
) -> Iterator[tuple[Fleet, Listener]]:
    fleet = Fleet(tmp_path, server_cert)
    listener = Listener()
    try:
        fleet.loop.run(listener.start())
        seed_region(
            tmp_path / "cp.db", "us-east", f"http://127.0.0.1:{listener.port}/internal/admin?steal="
        )
        fleet.start_control_plane()
        yield fleet, listener
    finally:
        fleet.loop.run(listener.stop())
        fleet.close()


def test_an_ingress_url_with_a_path_and_query_gets_nothing(
    listener_fleet: tuple[Fleet, Listener], client_ssl: ssl.SSLContext
) -> None:
    fleet, listener = listener_fleet
    fleet.add_region("us-east", register=False)  # its node beats: the region is healthy
    gateway = fleet.start_gateway(serving_token=SERVING_TOKEN)
    _, secret = fleet.create_key()
    router = gateway.handlers.router

    def sees_the_region() -> bool:
        state = router.regions.get("us-east")
        return state is not None and state.summary.healthy_nodes > 0

    wait_until(sees_the_region, 10.0, "the gateway to see us-east")
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        statuses = [http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)]
    assert listener.seen == []  # neither the token nor the tenant's salt went there
    assert statuses == [503] * 3  # no region to send to
    assert router.regions["us-east"].summary.ingress_url is None


def _summary(name: str, url: str | None) -> RegionSummary:
    queue = QueueEstimate(
        num_waiting=0, num_waiting_prefill_tokens=0, decode_tokens_per_s=0, expected_queue_delay_s=0
    )
    return RegionSummary(
        name=name,
        lat=0,
        lon=0,
        state="active",
        ingress_url=url,
        healthy_nodes=1,
        kv_blocks_free=1,
        kv_blocks_total=1,
        queue=queue,
        weight=1,
    )


def test_only_urls_that_pass_the_rule_are_kept() -> None:
    document = RegionSummaryIndex(
        index=1,
        regions=[
            _summary("ok", "http://127.0.0.1:10201"),
            _summary("path", "http://127.0.0.1:10202/internal?steal="),
            _summary("metadata", "http://169.254.169.254"),
            _summary("fragment", "http://127.0.0.1:10203#x"),
            _summary("mine", "http://127.0.0.1:10204"),
        ],
        routing=RoutingPolicy(),
    )
    own = {"ok": "http://127.0.0.1:10301", "mine": "http://[fe80::1]:80"}
    kept = with_region_ingress(document, own)
    assert [r.ingress_url for r in kept.regions] == [
        "http://127.0.0.1:10301",
        None,
        None,
        None,
        None,
    ]


@pytest.mark.parametrize(
    ("base", "path", "joined"),
    [
        (
            "http://127.0.0.1:9001",
            "/v1/chat/completions",
            "http://127.0.0.1:9001/v1/chat/completions",
        ),
        ("http://127.0.0.1:9001/", "/v1/models", "http://127.0.0.1:9001/v1/models"),
        (
            "http://h:1/internal/admin?steal=",
            "/v1/chat/completions",
            "http://h:1/v1/chat/completions",
        ),
        ("http://u:p@h:1#x", "/v1/models?a=1", "http://h:1/v1/models?a=1"),
        ("http://[::1]:8", "//elsewhere/v1/models", "http://[::1]:8/v1/models"),
    ],
)
def test_paths_are_joined_to_the_host_never_appended(base: str, path: str, joined: str) -> None:
    assert join_path(base, path) == joined
