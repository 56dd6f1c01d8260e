"""The RTT proxy's two kinds of path (stack/path_delays.py): the backbone holds every chunk
exactly half the RTT; a public path adds seeded jitter and, now and then, a retransmission.
The schedules are checked as the proxy draws them (deterministic, no clocks); one live pass
carries bytes through a public route on real sockets."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import pytest

from stack import commands
from stack.config import PathsConfig, load_config
from stack.front import AnycastFront, Endpoint
from stack.layout import plan_layout
from stack.path_delays import LOSS_PENALTY_S, MAX_LOSS_RATE, PathDelays, PublicPath, connection_rng
from stack.rtt_proxy import Route, RttProxy, main
from wire.geo import locate

ONE_WAY_S = 0.05
NUM_CHUNKS = 20_000


def _draws(delays: PathDelays) -> list[float]:
    return [delays.next_s() for _ in range(NUM_CHUNKS)]


def test_the_backbone_is_steady_and_lossless() -> None:
    delays = PathDelays(ONE_WAY_S, None, random.Random(1))
    assert set(_draws(delays)) == {ONE_WAY_S} and delays.num_lost == 0


def test_a_public_path_jitters_and_loses_as_configured() -> None:
    public = PublicPath(jitter_share=0.1, loss_per_100_ms=0.01)  # 1% on this 100 ms RTT
    delays = PathDelays(ONE_WAY_S, public, random.Random(1))
    draws = _draws(delays)
    assert min(draws) >= ONE_WAY_S
    assert sum(d > ONE_WAY_S for d in draws) == NUM_CHUNKS  # every chunk jitters
    # Exponential jitter of mean 5 ms plus 0.2 s for ~1% of chunks: wide bounds, 20k draws.
    lost = sum(d >= ONE_WAY_S + LOSS_PENALTY_S for d in draws)
    assert 0.006 * NUM_CHUNKS < lost < 0.014 * NUM_CHUNKS
    assert delays.num_lost >= lost
    mean_jitter_s = (
        sum(draws) / NUM_CHUNKS - ONE_WAY_S - delays.num_lost * LOSS_PENALTY_S / NUM_CHUNKS
    )
    assert 0.004 < mean_jitter_s < 0.006


def test_the_same_seed_draws_the_same_schedule_and_connections_draw_apart() -> None:
    public = PublicPath()
    first = _draws(PathDelays(ONE_WAY_S, public, connection_rng(7, 10601, 0, "up")))
    again = _draws(PathDelays(ONE_WAY_S, public, connection_rng(7, 10601, 0, "up")))
    other = _draws(PathDelays(ONE_WAY_S, public, connection_rng(7, 10601, 1, "up")))
    assert first == again and first != other


def test_the_proxy_gives_each_route_its_kind() -> None:
    backbone = Route(("127.0.0.1", 10201), (("127.0.0.1", 9001),), 100.0)
    public = Route(("127.0.0.1", 10601), (("127.0.0.1", 9001),), 100.0, kind="public")
    proxy = RttProxy([backbone, public], PublicPath(jitter_share=0.2, loss_per_100_ms=0.1), seed=3)
    for delays in proxy.delays_of(backbone, 0):
        assert {delays.next_s() for _ in range(100)} == {0.05}
    up, down = proxy.delays_of(public, 0)
    assert len({up.next_s() for _ in range(100)}) == 100 and up.num_lost > 0
    again = proxy.delays_of(public, 0)[1]  # the same connection's schedule, drawn anew
    assert [down.next_s() for _ in range(5)] == [again.next_s() for _ in range(5)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--jitter-share", "-1", "--route", "127.0.0.1:1=127.0.0.1:2@1"],
        ["--loss-per-100-ms", "0.2", "--public-route", "127.0.0.1:1=127.0.0.1:2@1"],
        [],
    ],
)
def test_bad_path_settings_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_bytes_pass_a_public_route_whole_and_in_order() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = int(upstream.sockets[0].getsockname()[1])
    route = Route(("127.0.0.1", 0), (("127.0.0.1", port),), 2.0, kind="public")
    route = replace(route, rtt_ms=400.0)  # loss grows with the RTT: 40% of chunks held back
    proxy = RttProxy([route], PublicPath(jitter_share=0.01, loss_per_100_ms=0.1), seed=0)
    await proxy.start()
    try:
        proxy_port = int(proxy._servers[0].sockets[0].getsockname()[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        sent = b"".join(b"line %d\n" % i for i in range(50))
        for i in range(50):  # separate writes: chunks with their own draws, some held back
            writer.write(b"line %d\n" % i)
            await writer.drain()
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 30.0) == sent
        writer.close()
    finally:
        await proxy.close()
        upstream.close()
        await upstream.wait_closed()


def test_meridian_up_runs_the_pop_paths_as_backbone_with_the_configured_public_settings() -> None:
    config = load_config()
    assert config.paths == PathsConfig()  # default.yaml states the defaults
    custom = config.model_copy(
        update={"paths": PathsConfig(public_jitter_share=0.1, public_loss_per_100_ms=0.02, seed=4)}
    )
    layout = plan_layout(custom, use_envoy=True)
    argv = commands.rtt_proxy(layout, custom.paths).argv
    num_paths = sum(len(region.paths) for region in layout.regions)
    assert argv.count("--route") == num_paths
    public = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--public-route"]
    assert public == [
        f"127.0.0.1:{c.direct.port}={c.direct.upstreams[0].removeprefix('http://')}"
        f"@{c.direct.rtt_ms:g}"
        for c in layout.clients
        if c.direct is not None
    ]
    assert len(public) == len(layout.clients)
    tail = argv[argv.index("--jitter-share") :]
    assert tail == ("--jitter-share", "0.1", "--loss-per-100-ms", "0.02", "--seed", "4")
    front = commands.anycast_front(layout, Path("ca.pem"), custom.paths).argv
    assert front[front.index("--jitter-share") :] == tail


def test_each_client_city_has_a_public_path_straight_to_its_nearest_region() -> None:
    config = load_config()
    layout = plan_layout(config, use_envoy=True)
    direct = {c.city: c.direct for c in layout.clients}
    assert {city: d.region for city, d in direct.items() if d} == {
        "tokyo": "ap-southeast",
        "paris": "eu-west",
        "chicago": "us-east",
    }
    ports = [d.port for d in direct.values() if d]
    assert ports == [config.ports.direct_base + k for k in range(len(config.clients))]
    envoy = {region.name: region.upstream_urls for region in layout.regions}
    assert all(d.upstreams == envoy[d.region] for d in direct.values() if d)
    assert all(0.0 < d.rtt_ms < 100.0 for d in direct.values() if d)
    owners = dict(layout.tcp_ports())
    assert owners[ports[0]] == "RTT proxy tokyo → ap-southeast (public)"
    calm = plan_layout(config.model_copy(update={"simulate_rtt": False}), use_envoy=True)
    assert all(client.direct is None for client in calm.clients)
    assert "--public-route" not in commands.rtt_proxy(calm, config.paths).argv


def test_loss_grows_with_the_path_s_rtt_and_is_capped() -> None:
    public = PublicPath(jitter_share=0.0, loss_per_100_ms=0.005)
    assert public.loss_rate(0.010) == pytest.approx(0.001)  # a near PoP: 20 ms RTT
    assert public.loss_rate(0.100) == pytest.approx(0.01)  # a far region: 200 ms RTT
    assert PublicPath(loss_per_100_ms=0.1).loss_rate(10.0) == MAX_LOSS_RATE


def test_the_anycast_front_s_city_legs_are_public() -> None:
    pops = [Endpoint("london", "127.0.1.2", 8443)]
    cities = [Endpoint("paris", "127.0.0.1", 8602)]
    steady = AnycastFront(pops, cities)
    route = steady.table.reach(locate("paris"))
    for delays in steady.delays_of("paris", route, 0):
        assert {delays.next_s() for _ in range(50)} == {route.rtt_ms / 2000.0}
    public = AnycastFront(pops, cities, PublicPath(jitter_share=0.5), seed=1)
    up, _ = public.delays_of("paris", route, 0)
    assert len({up.next_s() for _ in range(50)}) == 50
