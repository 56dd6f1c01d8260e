"""Benchmark: the region picker's `ext_proc` round trip at 1 and 32 concurrent requests (issue 34:
within 1 ms p50 at 32), from a Python client and as a real Envoy waits for it.

    python -m bench.picker_round_trip [--exchanges 1600] [--chats 1600] [--json out]

The picker runs as its own process (`python -m region_picker`, the default model's tokenizer),
watching a stand-in control plane that lists 3 fake nodes (`bench.gateway_upstream`, one process
each). Per request: the request's headers (the tenant's cache salt), its body (a chat with one of
8 tenants' ~1,500-token system prompts and a question of its own) and the response's headers.

First a gRPC client in this process plays Envoy, timed from sending the body to its answer (the
answer Envoy routes on). Two kinds of request alternate, on the same streams and bodies:
- decided: the body names the model the picker tokenizes for; it renders the chat, hashes its
  blocks (the system prompt's from the memo after its first time), scores the nodes and names one;
- floor: the body names a model no node serves; the picker parses it and lets Envoy balance it.
The difference is the decision; the floor is gRPC, protobuf and the body's parse on both sides.

Then the real thing: an Envoy with the ingress's ext_proc filter, picked route and clusters as
xDS builds them (bench/picker_envoy.py), chats sent through it to the nodes, and Envoy's own
timings from its access log: how long each request waited from its first byte to its first
byte sent to a node (`routed`), and the picker's answers to its headers, its body and the
response's headers (which Envoy holds from the client until then). Three loads: one chat at a
time, 32 back to back (the picker saturated: at c=32 a request waits for the 31 before it), and
32 concurrent chats paced like a model's decode (`--chunks` chunks, `--pace-ms` apart),
arriving at the rate a region's picker sees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench import picker_envoy
from bench.gateway_overhead import free_port
from bench.loadgen import percentile
from bench.report import load_average, machine, report_out
from stack.config import DEFAULT_MODEL
from wire.cache_salt import CACHE_SALT_HEADER
from wire.region_nodes import DESTINATION_HEADER, NodeLoad, RegionNodes

REGION = "us-east"
NUM_TENANTS = 8
WORDS = [
    "region",
    "node",
    "prefix",
    "cache",
    "block",
    "token",
    "prompt",
    "latency",
    "queue",
    "decode",
    "prefill",
]


def nodes_document(ports: list[int]) -> RegionNodes:
    return RegionNodes(
        index=1,
        region=REGION,
        nodes=tuple(
            NodeLoad(
                node_id=f"node-{i}",
                url=f"http://127.0.0.1:{port}",
                model=DEFAULT_MODEL,
                block_size=16,
                kv_blocks_total=5825,
                kv_blocks_free=5825,
            )
            for i, port in enumerate(ports)
        ),
    )


@contextlib.contextmanager
def standin_control_plane(node_ports: list[int]) -> Iterator[str]:
    """The region nodes query for nodes on `node_ports`, answered from a thread: the document,
    then no change."""
    loop = asyncio.new_event_loop()
    closing = asyncio.Event()
    runners: list[web.AppRunner] = []
    document = nodes_document(node_ports).model_dump_json()

    async def nodes(request: web.Request) -> web.Response:
        if request.query.get("index") != "0":  # a blocking query with nothing new
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), 30)
        return web.Response(text=document, content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        app.router.add_get(f"/v1/regions/{REGION}/nodes", nodes)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)

    async def stop() -> None:
        closing.set()
        await runners[0].cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{runners[0].addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def start_picker(control_plane: str, log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    port, metrics_port, events_port = free_port(), free_port(), free_port()
    env = {**os.environ, "MERIDIAN_GATEWAY_TOKEN": "gateway-" + "b" * 32}
    command = [sys.executable, "-m", "region_picker", "--region", REGION, "--port", str(port)]
    command += ["--metrics-port", str(metrics_port), "--cache-events-port", str(events_port)]
    command += ["--control-plane", control_plane, "--model", DEFAULT_MODEL]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=out)
    return process, port, metrics_port


def system_prompt(tenant: int) -> str:
    rng = random.Random(tenant)
    words = [f"You are the assistant of tenant {tenant}. Its handbook follows."]
    words += [f"{rng.choice(WORDS)} {rng.randint(0, 999)}" for _ in range(480)]  # ~1,500 tokens
    return " ".join(words)


def body(model: str, tenant: int, n: int) -> bytes:
    messages = [
        {"role": "system", "content": system_prompt(tenant)},
        {"role": "user", "content": f"Question {n}: which node holds my prompt?"},
    ]
    return json.dumps({"model": model, "messages": messages, "stream": True}).encode()


def headers_message(salt: str) -> pb.ProcessingRequest:
    values = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        (CACHE_SALT_HEADER, salt),
    ]
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))


RESPONSE_HEADERS = pb.ProcessingRequest(response_headers=pb.HttpHeaders())


async def exchange(
    stub: pb_grpc.ExternalProcessorStub, salt: str, payload: bytes
) -> tuple[float, bool]:
    """One request as Envoy sends it; the body's round trip in seconds, and whether a node was
    named."""
    call = stub.Process()
    await call.write(headers_message(salt))
    await call.read()
    started = time.perf_counter()
    await call.write(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=payload, end_of_stream=True))
    )
    answer = await call.read()
    elapsed = time.perf_counter() - started
    await call.write(RESPONSE_HEADERS)
    await call.read()
    await call.done_writing()
    mutation = answer.request_body.response.header_mutation.set_headers
    return elapsed, any(h.header.key == DESTINATION_HEADER for h in mutation)


async def measure(port: int, concurrency: int, exchanges: int) -> dict[str, Any]:
    """`exchanges` requests of each kind over `concurrency` workers, the kinds alternating."""
    bodies = {
        kind: [body(model, t, n) for t in range(NUM_TENANTS) for n in range(4)]
        for kind, model in (("decided", DEFAULT_MODEL), ("floor", "no-such-model"))
    }
    times: dict[str, list[float]] = {"decided": [], "floor": []}
    named = {"decided": 0, "floor": 0}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def worker(w: int) -> None:
            for i in range(w, exchanges, concurrency):
                for kind in ("decided", "floor") if i % 2 else ("floor", "decided"):
                    pool = bodies[kind]
                    index = i % len(pool)
                    elapsed, was_named = await exchange(stub, f"tenant-{index // 4}", pool[index])
                    times[kind].append(elapsed)
                    named[kind] += was_named

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    result: dict[str, Any] = {"concurrency": concurrency}
    for kind, values in times.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        assert p50 is not None and p99 is not None  # every worker timed its exchanges
        result[kind] = {
            "exchanges": len(values),
            "named_a_node": named[kind],
            "p50_ms": round(p50 * 1000, 3),
            "p99_ms": round(p99 * 1000, 3),
        }
    result["decision_p50_ms"] = round(result["decided"]["p50_ms"] - result["floor"]["p50_ms"], 3)
    return result


def wait_ready(port: int, metrics_port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the picker names a node for a request (its tokenizer loaded, the nodes known)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the picker exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)

            async def probe() -> bool:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.ExternalProcessorStub(channel)
                    return (await exchange(stub, "probe", body(DEFAULT_MODEL, 0, 0)))[1]

            with contextlib.suppress(grpc.aio.AioRpcError):
                if asyncio.run(probe()):
                    return
        time.sleep(0.5)
    raise SystemExit(f"the picker named no node in 120 s: {log.read_text()[-2000:]}")


def client_round_trips(port: int, exchanges: int) -> list[dict[str, Any]]:
    """Python's gRPC client playing Envoy, decided against the floor, at 1 and 32."""
    asyncio.run(measure(port, 8, 64))  # warm: every tenant's system prompt in the memo
    runs = []
    for concurrency in (1, 32):
        result = asyncio.run(measure(port, concurrency, exchanges))
        runs.append(result)
        d, f = result["decided"], result["floor"]
        print(
            f"client c={concurrency:>2}: decided p50 {d['p50_ms']:.3f} ms p99 {d['p99_ms']:.3f}"
            f" ({d['named_a_node']}/{d['exchanges']} named a node); floor p50"
            f" {f['p50_ms']:.3f} ms p99 {f['p99_ms']:.3f}; the decision's share of p50"
            f" {result['decision_p50_ms']:.3f} ms",
            flush=True,
        )
    return runs


def envoy_round_trips(envoy: picker_envoy.Envoy, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Chats through the real Envoy: back to back at 1 and 32 (the picker's saturation), then
    32 paced like a model's decode, each chat of a seeded length around `--chunks` and the
    workers' starts spread over one chat, so that they arrive apart (the rate and spread a
    region's picker sees at 32 concurrent chats)."""
    rng = random.Random(0)
    levels = [
        ("back to back", 1, args.chats // 4, 0.0),
        ("back to back", 32, args.chats, 0.0),
        ("paced", 32, args.chats, args.pace_ms),
    ]
    runs = []
    for kind, concurrency, num, pace_ms in levels:
        chats = []
        for i in range(num):
            tenant, chunks = i % NUM_TENANTS, rng.randint(args.chunks // 2, args.chunks * 3 // 2)
            payload = picker_envoy.chat(body(DEFAULT_MODEL, tenant, i % 4), chunks, pace_ms)
            chats.append((f"tenant-{tenant}", payload))
        stagger_s = args.chunks * pace_ms / 1000
        result = asyncio.run(picker_envoy.measure(envoy, chats, concurrency, stagger_s))
        result.update(kind=kind, concurrency=concurrency, pace_ms=pace_ms, chunks=args.chunks)
        runs.append(result)
        print(
            f"envoy c={concurrency:>2} {kind}: {result['requests_per_s']} chats/s; routed after"
            f" p50 {result['routed_p50_ms']} ms p99 {result['routed_p99_ms']}; the picker's"
            f" answers p50: to the headers {result['headers_p50_ms']} ms, to the body (naming"
            f" the node) {result['body_p50_ms']} ms, to the response's headers"
            f" {result['response_headers_p50_ms']} ms; {result['named_a_node']}/"
            f"{result['requests']} named a node, {result['went_where_named']} went there,"
            f" {result['failed']} failed",
            flush=True,
        )
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--exchanges", type=int, default=1600, help="of each kind, at each concurrency"
    )
    parser.add_argument("--chats", type=int, default=1600, help="through Envoy, at 32")
    parser.add_argument("--chunks", type=int, default=16, help="a chat's streamed chunks")
    parser.add_argument("--pace-ms", type=float, default=25.0, help="between a paced chat's chunks")
    parser.add_argument("--json", help="write the whole report here")
    args = parser.parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as directory:
        root = Path(directory)
        nodes, node_ports = picker_envoy.start_nodes(root, 3)
        envoy: picker_envoy.Envoy | None = None
        try:
            with standin_control_plane(node_ports) as cp:
                log = root / "picker.log"
                process, port, metrics_port = start_picker(cp, log)
                try:
                    wait_ready(port, metrics_port, process, log)
                    client = client_round_trips(port, args.exchanges)
                    envoy = picker_envoy.start_envoy(root, port, node_ports[0])
                    through_envoy = envoy_round_trips(envoy, args)
                finally:
                    process.terminate()
                    process.wait(timeout=30)
        finally:
            for child in [*nodes, *([envoy.process] if envoy else [])]:
                child.terminate()
                child.wait(timeout=30)
    report = {"client": client, "envoy": through_envoy, "machine": machine(load_before)}
    report_out(report, args.json, ("client", "envoy", "machine"))


if __name__ == "__main__":
    main()
