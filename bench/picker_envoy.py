"""The picker's round trip as Envoy measures it: a real Envoy with the ext_proc filter, the
picked route and the two clusters exactly as the control plane's xDS builds them
(`control_plane.xds.picker`), chats sent through it, and Envoy's own ext_proc timings read back
from its access log (`%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:...)%`, timed by Envoy's
C++ gRPC client, not by ours).

Used by `bench/picker_round_trip.py`. Three fake nodes (`bench.gateway_upstream`, one process
each) answer the chats as streams; a chat's `bench_chunk_interval_ms` paces its chunks like a
model's decode, so the picker sees requests at the rate a region would, or back to back with
pace 0 (the picker's saturation).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import address_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import json_format, struct_pb2

from bench.gateway_overhead import free_port, wait_for_port
from bench.gateway_upstream import PACE_FIELD
from bench.loadgen import percentile
from control_plane.xds.picker import (
    ext_proc_filter,
    picked_cluster,
    picked_route,
    picker_cluster,
    static_cluster,
)
from control_plane.xds.resources import pack, route
from wire.cache_salt import CACHE_SALT_HEADER
from wire.region_nodes import DESTINATION_HEADER

EXT_PROC_STATE = ext_proc_filter().name  # the filter state's key: the filter's name
# What Envoy logs of each request: how long it waited, the picker's answers to its headers and
# to its body (the one naming the node; microseconds, as Envoy timed them), the node named, the
# node it went to and the status.
LOG_FIELDS = {
    "header_us": f"%FILTER_STATE({EXT_PROC_STATE}:FIELD:request_header_latency_us)%",
    "body_us": f"%FILTER_STATE({EXT_PROC_STATE}:FIELD:request_body_total_latency_us)%",
    # From the request's first byte to its first byte sent to a node: what it waits in the
    # ingress, the picker's answers included.
    "routed_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    # The picker's answer to the response's headers (it counts the request pending on its node
    # until then), which holds them from the client meanwhile.
    "response_us": f"%FILTER_STATE({EXT_PROC_STATE}:FIELD:response_header_latency_us)%",
    "destination": f"%REQ({DESTINATION_HEADER})%",
    "code": "%RESPONSE_CODE%",
    "upstream": "%UPSTREAM_HOST%",
}
UNPICKED_CLUSTER = "unpicked"  # Envoy's own choice when the picker names nothing


def _address(port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port)
    )


def _access_log(path: Path) -> accesslog_pb2.AccessLog:
    fields = struct_pb2.Struct()
    fields.update(LOG_FIELDS)
    file_log = file_pb2.FileAccessLog(
        path=str(path),
        log_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=fields),
    )
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.file", typed_config=pack(file_log))


def bootstrap(listen_port: int, picker_port: int, node_port: int, log: Path) -> dict[str, Any]:
    """An Envoy bootstrap: the ingress's picker filter, picked route and clusters as xDS builds
    them, every other request to one node, and the access log."""
    routes = route_pb2.RouteConfiguration(
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name="all",
                domains=["*"],
                routes=[
                    picked_route(),
                    route(
                        "unpicked", route_components_pb2.RouteMatch(prefix="/"), UNPICKED_CLUSTER
                    ),
                ],
            )
        ]
    )
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix="ingress",
        route_config=routes,
        http_filters=[
            ext_proc_filter(),
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=pack(router_pb2.Router())
            ),
        ],
        access_log=[_access_log(log)],
    )
    chain = listener_components_pb2.FilterChain(
        filters=[
            listener_components_pb2.Filter(
                name="envoy.filters.network.http_connection_manager", typed_config=pack(manager)
            )
        ]
    )
    config = bootstrap_pb2.Bootstrap(
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[
                listener_pb2.Listener(
                    name="ingress", address=_address(listen_port), filter_chains=[chain]
                )
            ],
            clusters=[
                picked_cluster(),
                picker_cluster("127.0.0.1", picker_port),
                static_cluster(UNPICKED_CLUSTER, "127.0.0.1", node_port),
            ],
        )
    )
    return json_format.MessageToDict(config)


@dataclass
class Envoy:
    process: subprocess.Popen[bytes]
    port: int
    log: Path


def start_envoy(root: Path, picker_port: int, node_port: int) -> Envoy:
    port = free_port()
    log = root / "access.log"
    config_path = root / "envoy.json"
    config_path.write_text(json.dumps(bootstrap(port, picker_port, node_port, log)))
    envoy = str(Path(sys.executable).parent / "envoy")
    argv = [envoy, "-c", str(config_path), "--concurrency", "1", "-l", "warning"]
    argv += ["--base-id", str(port), "--disable-hot-restart", "--file-flush-interval-msec", "100"]
    with (root / "envoy.log").open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out)
    wait_for_port(port)
    return Envoy(process, port, log)


def start_nodes(root: Path, count: int) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    """`count` fake nodes, each its own process, once they listen."""
    ports = [free_port() for _ in range(count)]
    processes = []
    for i, port in enumerate(ports):
        with (root / f"node-{i}.log").open("wb") as out:
            argv = [sys.executable, "-m", "bench.gateway_upstream", "--port", str(port)]
            processes.append(subprocess.Popen(argv, stdout=out, stderr=out))
    for port in ports:
        wait_for_port(port)
    return processes, ports


def chat(payload: bytes, chunks: int, pace_ms: float) -> bytes:
    body = json.loads(payload)
    return json.dumps({**body, "max_tokens": chunks, PACE_FIELD: pace_ms}).encode()


async def send_chats(
    port: int, bodies: list[tuple[str, bytes]], concurrency: int, stagger_s: float
) -> tuple[float, int]:
    """Every chat of `bodies` through Envoy, `concurrency` at once, the workers' starts spread
    over `stagger_s`; the seconds taken and the failures."""
    num = len(bodies)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    failed = 0
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal failed
        await asyncio.sleep(stagger_s * w / concurrency)
        for i in range(w, num, concurrency):
            salt, payload = bodies[i]
            headers = {"content-type": "application/json", CACHE_SALT_HEADER: salt}
            async with session.post(url, data=payload, headers=headers) as reply:
                await reply.read()
                failed += reply.status != 200

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
    return time.perf_counter() - started, failed


def read_log(log: Path, skip: int) -> list[dict[str, Any]]:
    """The access log's entries after the first `skip`."""
    lines = log.read_text().splitlines()
    return [json.loads(line) for line in lines[skip:]]


def summarize(entries: list[dict[str, Any]], seconds: float, failed: int) -> dict[str, Any]:
    """Envoy's view of `entries`: how long each waited before leaving for a node, and the
    picker's answers to its headers and its body (the one that names the node), p50 and p99
    over the requests that got them (Envoy logs none for a message it never sent: one behind a
    headers answer that timed out)."""

    def ms(field: str, q: float) -> float | None:
        values = [float(e[field]) for e in entries if e[field] not in (None, "-")]
        value = percentile(values, q)
        return None if value is None else round(value / 1000, 3)

    named = [e for e in entries if e["destination"] not in (None, "-", "")]
    summary: dict[str, Any] = {
        "requests": len(entries),
        "requests_per_s": round(len(entries) / seconds, 1),
        "failed": failed,
        "named_a_node": len(named),
        "went_where_named": sum(e["destination"] == e["upstream"] for e in named),
    }
    timings = (
        ("routed", "routed_us"),
        ("headers", "header_us"),
        ("body", "body_us"),
        ("response_headers", "response_us"),
    )
    for name, field in timings:
        summary[f"{name}_p50_ms"], summary[f"{name}_p99_ms"] = ms(field, 50), ms(field, 99)
    return summary


async def measure(
    envoy: Envoy, bodies: list[tuple[str, bytes]], concurrency: int, stagger_s: float
) -> dict[str, Any]:
    """The chats at `concurrency`, summarized from the access log's new entries."""
    num = len(bodies)
    before = len(envoy.log.read_text().splitlines()) if envoy.log.exists() else 0
    seconds, failed = await send_chats(envoy.port, bodies, concurrency, stagger_s)
    deadline = time.monotonic() + 10  # Envoy flushes its access log on a timer
    while time.monotonic() < deadline:
        entries = read_log(envoy.log, before) if envoy.log.exists() else []
        if len(entries) >= num:
            break
        await asyncio.sleep(0.1)
    return summarize(entries, seconds, failed)
