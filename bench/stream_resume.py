"""Benchmark: streams resumed in another region when their region's node dies (issue 15).

    python -m bench.stream_resume [--rounds 2] [--streams 16] [--max-tokens 128]
        [--kill-after 16] [--dtype float32] [--failure kill|stop] [--prompt-notes N] [--prewarm]
        [--json out.json]

One run starts on 127.0.0.1: a real control plane (`python -m control_plane`), two regions of one
real node agent each (`python -m node_agent`, SmolLM2, `us-east` and `eu-west`, each behind the
stack's RTT proxy at its simulated distance from the `new-york` PoP) and one real gateway
process (`python -m gateway --plain`). Each round, `--streams` concurrent greedy chat streams of
`--max-tokens` tokens (`ignore_eos`) go through the gateway twice, each time through a fresh
gateway process (so that the second does not avoid us-east from what it learnt in the first),
with that round's own prompts (so that no round's continuations find an earlier round's blocks
in the far node's prefix cache):

1. unbroken: the baseline, every stream to its end;
2. broken: the same streams, and once every stream has had `--kill-after` content chunks the
   `us-east` node is SIGKILLed (`--failure kill`: its sockets close, the gateway sees the
   connection end) or SIGSTOPped (`--failure stop`: its sockets stay open and its heartbeats
   stop; the gateway, at its default settings, gives up on a stream silent for
   `unhealthy_node_silence_s` once the control plane reports the node unhealthy,
   not after its 60 s `stream_idle_timeout_s`).

The killed node is started again for the next round. Reported per run: streams completed of
`--streams`, texts identical to the unbroken run's, the longest gap between two content chunks of
each stream (p50 / max over the streams; the wait for the first token is TTFT, not a gap); for
the unbroken run the serving node's mean TTFT (all the prompts prefilled at once: the baseline
for the continuations'); for the broken run the resume latency: from the break being detected
to the first resumed chunk
(the gateway's `meridian_gateway_stream_resume_latency_seconds`, split at the continuation's
first byte), from the kill to each resumed stream's next chunk (as the client saw it), and the
continuing node's TTFT for the continuations (`meridian:time_to_first_token_seconds`, arrival to
first token: its queue and the prefill of prompt plus resumed tokens). With the load average
and the CPU's vector flags: the machine may be shared.

`--prewarm`: each round then makes a second pair of runs over prompts of its own, the broken one
through a gateway with `resume_prewarm` on (each stream's prompt sent to eu-west at its first
chunk, gateway/prewarm.py), and prints the longest gap of both broken runs and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chat_streams import TOPICS, StreamResult, read_streams
from bench.gateway_overhead import Processes, free_port, wait_for_port
from bench.report import cpu_vector_flags, load_average
from engine.model_store import DEFAULT_MODEL, pull
from wire.geo import locate, rtt_ms

POP = "new-york"
NEAR, FAR = "us-east", "eu-west"  # the streams begin near; the near node dies
NODE_START_TIMEOUT_S = 300.0  # the model loading (and maybe the kernels building) under load
RUN_TIMEOUT_S = 900.0
NODE_FLAGS = ["--heartbeat-interval", "0.5", "--num-kv-blocks", "512", "--max-model-len", "1024"]


@dataclass
class Fleet:
    directory: Path
    processes: Processes
    env: dict[str, str]
    cp_url: str
    admin_token: str
    node_ports: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    node_threads: int | None = None
    dtype: str = "float32"
    gateway: subprocess.Popen[bytes] | None = None
    gateway_url: str = ""
    gateway_metrics_url: str = ""  # its metrics listener's base URL
    api_key: str = ""

    def admin(self, method: str, path: str, body: object = None) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        response = httpx.request(
            method, self.cp_url + path, json=body, headers=headers, timeout=30.0, trust_env=False
        )
        response.raise_for_status()
        return response.json()

    def start_node(self, region: str) -> None:
        node_id = f"{region}-n1"
        minted = self.admin("POST", f"/v1/nodes/{node_id}/credential", {"region": region})
        env = self.env | {"MERIDIAN_NODE_TOKEN": minted["token"]}
        if self.node_threads is not None:
            threads = str(self.node_threads)
            env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        args = [
            sys.executable,
            "-m",
            "node_agent",
            "--model",
            DEFAULT_MODEL,
            "--port",
            str(self.node_ports[region]),
            "--region",
            region,
            "--node-id",
            node_id,
            "--control-plane",
            self.cp_url,
            "--dtype",
            self.dtype,
            *NODE_FLAGS,
        ]
        self.processes.start(f"node-{region}", args, env)
        self.nodes[region] = self.processes.started[-1]

    def start_gateway(self, prewarm: bool = False) -> None:
        self.stop_gateway()
        port, metrics_port = free_port(), free_port()
        args = [
            sys.executable,
            "-m",
            "gateway",
            "--pop",
            POP,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--control-plane",
            self.cp_url,
            "--plain",
            "--no-access-log",
        ]
        env = self.env | {"MERIDIAN_GATEWAY_RESUME_PREWARM": "true" if prewarm else "false"}
        self.processes.start("gateway", args, env)
        self.gateway = self.processes.started[-1]
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.gateway_metrics_url = f"http://127.0.0.1:{metrics_port}"
        wait_for_port(port)

    def stop_gateway(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            self.gateway.wait(timeout=10)

    def wait_until_ready(self) -> None:
        """Both regions with a healthy node in the gateway's view, and the key loaded."""
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        headers = {"Authorization": f"Bearer {self.api_key}"}
        while time.monotonic() < deadline:
            for region, node in self.nodes.items():
                if node.poll() is not None:
                    log = (self.directory / f"node-{region}.log").read_text(errors="replace")
                    raise SystemExit(f"the {region} node exited; its log ends:\n{log[-2000:]}")
            try:
                health = httpx.get(self.gateway_url + "/health", timeout=5.0, trust_env=False)
                regions = health.json()["regions"]
                models = httpx.get(
                    self.gateway_url + "/v1/models", headers=headers, timeout=5.0, trust_env=False
                )
                if models.status_code == 200 and all(
                    regions.get(r, {}).get("healthy_nodes", 0) > 0 for r in (NEAR, FAR)
                ):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"the fleet was not ready in {NODE_START_TIMEOUT_S:.0f} s")

    def metrics(self, url: str) -> str:
        return httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text


def start_fleet(directory: Path, args: argparse.Namespace) -> Fleet:
    processes = Processes(directory)
    names = ("admin", "gateway", "serving")
    tokens = {name: f"{name[:3]}-{secrets.token_urlsafe(24)}" for name in names}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    # The nodes take a resumed stream's tokens only from a gateway that presents the serving token.
    env |= {f"MERIDIAN_{name.upper()}_TOKEN": tokens[name] for name in names}
    cp_port = free_port()
    processes.start_control_plane(cp_port, env)
    wait_for_port(cp_port)
    fleet = Fleet(
        directory,
        processes,
        env,
        f"http://127.0.0.1:{cp_port}",
        tokens["admin"],
        node_threads=args.node_threads,
        dtype=args.dtype,
    )
    routes = []
    for region in (NEAR, FAR):
        place, listen_port = locate(region), free_port()
        fleet.node_ports[region] = free_port()
        routes += [
            "--route",
            f"127.0.0.1:{listen_port}=127.0.0.1:{fleet.node_ports[region]}"
            f"@{rtt_ms(locate(POP), place):.1f}",
        ]
        fleet.admin(
            "POST",
            "/v1/regions",
            {
                "name": region,
                "lat": place.lat,
                "lon": place.lon,
                "ingress_url": f"http://127.0.0.1:{listen_port}",
            },
        )
    processes.start(
        "rtt_proxy", [sys.executable, "-m", "stack.rtt_proxy", *routes, "--log-level", "WARNING"]
    )
    fleet.api_key = fleet.admin("POST", "/v1/keys", {"name": "bench", "rpm": 10**6, "tpm": 10**9})[
        "secret"
    ]
    for region in (NEAR, FAR):
        fleet.start_node(region)
    return fleet


def bodies(
    num_streams: int, max_tokens: int, round_index: int, notes: int = 0
) -> list[dict[str, object]]:
    """The round's streams. Each round's prompts are its own (the set named first), so that no
    round's continuations find blocks that an earlier round cached in the far node; `notes`
    numbered lines of the stream's own (about 12 tokens each) make a long prompt."""
    return [
        {
            "model": DEFAULT_MODEL,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": "".join(
                        f"Note {n} of stream {i} in set {round_index + 1}.\n" for n in range(notes)
                    )
                    + f"Essay set {round_index + 1}: write a long essay about "
                    f"{TOPICS[i % len(TOPICS)]}.",
                }
            ],
        }
        for i in range(num_streams)
    ]


async def run_streams(
    fleet: Fleet,
    streams: list[dict[str, object]],
    progress: tuple[int, Callable[[list[StreamResult]], None]] | None,
) -> list[StreamResult]:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(
        base_url=fleet.gateway_url,
        headers=headers,
        timeout=RUN_TIMEOUT_S,
        trust_env=False,
        limits=httpx.Limits(max_connections=len(streams)),
    ) as client:
        return await read_streams(client, streams, progress)


async def broken_run(
    fleet: Fleet, args: argparse.Namespace, streams: list[dict[str, object]]
) -> tuple[list[StreamResult], float | None]:
    broken_at: list[float] = []

    def break_near(_: list[StreamResult]) -> None:
        node = fleet.nodes[NEAR]
        node.send_signal(signal.SIGKILL if args.failure == "kill" else signal.SIGSTOP)
        broken_at.append(time.monotonic())

    results = await run_streams(fleet, streams, (args.kill_after, break_near))
    return results, (broken_at[0] if broken_at else None)


def histogram(text: str, name: str, **labels: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram's series with these labels (summed over others)."""
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in totals:
            if not line.startswith(name + suffix):
                continue
            series, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                totals[suffix] += float(value)
    return totals["_sum"], totals["_count"]


def mean_of(after: str, before: str, name: str, **labels: str) -> float | None:
    """The mean of the observations a histogram gained between two scrapes."""
    (s1, c1), (s0, c0) = histogram(after, name, **labels), histogram(before, name, **labels)
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 3), "max": round(max(values), 3)}


def summary(results: list[StreamResult], baseline: list[StreamResult] | None) -> dict[str, Any]:
    done = [r for r in results if r.error is None and len(r.ids) == 1]
    report: dict[str, Any] = {
        "completed": len(done),
        "streams": len(results),
        "began_near": sum(r.region == NEAR for r in results),
        "resumed": sum(r.num_resumes > 0 for r in results),
        "max_gap_s": spread([r.max_gap_s for r in results]),
        "errors": sorted({r.error for r in results if r.error}),
    }
    if baseline is not None:
        report["identical"] = sum(
            a.text == b.text and a.error is None for a, b in zip(results, baseline, strict=True)
        )
    return report


def one_round(fleet: Fleet, args: argparse.Namespace, round_index: int) -> dict[str, Any]:
    """The round's pass at the gateway's defaults; with `--prewarm` also one with
    `resume_prewarm` on, over prompts of its own (none cached anywhere yet)."""
    result = one_pass(fleet, args, round_index, prewarm=False)
    if args.prewarm:
        result["prewarm"] = one_pass(fleet, args, args.rounds + round_index, prewarm=True)
    return result


def one_pass(
    fleet: Fleet, args: argparse.Namespace, prompt_set: int, prewarm: bool
) -> dict[str, Any]:
    if fleet.nodes[NEAR].poll() is not None:
        fleet.start_node(NEAR)
    fleet.start_gateway()  # the unbroken run never prewarms: the far node stays cold
    fleet.wait_until_ready()
    near_url = f"http://127.0.0.1:{fleet.node_ports[NEAR]}"
    near_before = fleet.metrics(near_url)
    started_s = time.monotonic()
    streams = bodies(args.streams, args.max_tokens, prompt_set, args.prompt_notes)
    unbroken = asyncio.run(run_streams(fleet, streams, None))
    unbroken_s = time.monotonic() - started_s
    near_after = fleet.metrics(near_url)
    fleet.start_gateway(prewarm)  # fresh: no TTFT learnt from the unbroken run
    fleet.wait_until_ready()
    far_url = f"http://127.0.0.1:{fleet.node_ports[FAR]}"
    far_before = fleet.metrics(far_url)
    load_before = load_average()
    started_s = time.monotonic()
    broken, broken_at_s = asyncio.run(broken_run(fleet, args, streams))
    broken_s = time.monotonic() - started_s
    gateway_metrics, far_after = fleet.metrics(fleet.gateway_metrics_url), fleet.metrics(far_url)
    near = fleet.nodes[NEAR]
    if args.failure == "stop":
        near.send_signal(signal.SIGCONT)
    if near.poll() is None:
        near.kill()
        near.wait(timeout=10)
    latency = "meridian_gateway_stream_resume_latency_seconds"
    ttft = "meridian:time_to_first_token_seconds"
    after_kill = [
        g
        for r in broken
        if r.num_resumes
        and broken_at_s is not None
        and (g := r.gap_after_s(broken_at_s)) is not None
    ]
    return {
        "load_average": [load_before, load_average()],
        "unbroken": {
            **summary(unbroken, None),
            "wall_s": round(unbroken_s, 1),
            "node_ttft_mean_s": mean_of(near_after, near_before, ttft),
        },
        "broken": {
            **summary(broken, unbroken),
            "wall_s": round(broken_s, 1),
            "break_to_next_chunk_s": spread(after_kill),
            "gateway_resume_latency_mean_s": mean_of(
                gateway_metrics, "", latency, phase="first_chunk"
            ),
            "gateway_reopen_mean_s": mean_of(gateway_metrics, "", latency, phase="reopen"),
            "far_node_ttft_mean_s": mean_of(far_after, far_before, ttft),
            "far_node_queue_mean_s": mean_of(
                far_after, far_before, "meridian:request_queue_time_seconds"
            ),
        },
    }


def print_round(i: int, result: dict[str, Any], rtt_far_ms: float) -> None:
    print(f"round {i + 1}")
    print_pass(result, rtt_far_ms)
    warm = result.get("prewarm")
    if warm is not None:
        print("  with resume_prewarm:")
        print_pass(warm, rtt_far_ms)
        off, on = result["broken"]["max_gap_s"]["max"], warm["broken"]["max_gap_s"]["max"]
        if off and on:
            print(f"  longest gap, prewarm off / on: {off} / {on} s = {off / on:.2f}x")


def print_pass(result: dict[str, Any], rtt_far_ms: float) -> None:
    u, b = result["unbroken"], result["broken"]
    print(f"  load average {result['load_average'][0]} -> {result['load_average'][1]}")
    print(
        f"  unbroken: {u['completed']}/{u['streams']} completed in {u['wall_s']} s, longest "
        f"gap p50 {u['max_gap_s']['p50']} s, max {u['max_gap_s']['max']} s; {NEAR} node TTFT "
        f"{_s(u['node_ttft_mean_s'])} (mean, the prompts' prefill)"
    )
    print(
        f"  broken:   {b['completed']}/{b['streams']} completed in {b['wall_s']} s, "
        f"{b['identical']}/{b['streams']} identical, {b['resumed']} resumed "
        f"({b['began_near']} began in {NEAR}), longest gap p50 {b['max_gap_s']['p50']} s, "
        f"max {b['max_gap_s']['max']} s (target <= 1 s + {rtt_far_ms:.0f} ms RTT)"
    )
    print(
        f"  resume: break -> next chunk (client) p50 {b['break_to_next_chunk_s']['p50']} s, "
        f"max {b['break_to_next_chunk_s']['max']} s; gateway, break detected -> continuation "
        f"answered {_s(b['gateway_reopen_mean_s'])}, -> first resumed chunk "
        f"{_s(b['gateway_resume_latency_mean_s'])} (means); {FAR} node TTFT "
        f"{_s(b['far_node_ttft_mean_s'])} of which queued {_s(b['far_node_queue_mean_s'])}"
    )
    if b["errors"]:
        print(f"  errors: {b['errors']}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stream_resume", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kill-after", type=int, default=16, help="content chunks per stream")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--failure", default="kill", choices=["kill", "stop"])
    parser.add_argument("--node-threads", type=int, help="torch threads per node agent")
    parser.add_argument(
        "--prompt-notes",
        type=int,
        default=0,
        help="lines of its own (about 12 tokens each) before each stream's question",
    )
    parser.add_argument(
        "--prewarm",
        action="store_true",
        help="each round also breaks a run with the gateway's resume_prewarm on, and compares",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rtt_far_ms = rtt_ms(locate(POP), locate(FAR))
    report: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpu_flags": cpu_vector_flags(),
        "rounds": [],
    }
    pull(DEFAULT_MODEL)  # the node agents load it from the store and never fetch it
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        fleet = start_fleet(Path(tmp), args)
        try:
            for i in range(args.rounds):
                result = one_round(fleet, args, i)
                report["rounds"].append(result)
                print_round(i, result, rtt_far_ms)
        finally:
            fleet.processes.stop_all()
    print(f"CPU flags: {' '.join(report['cpu_flags']) or 'no AVX-512'}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=asdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
