"""Benchmark: the global front end of a running `meridian up` (issue 11's targets).

    meridian up --config bench/front_end.yaml --state-dir DIR --detach
    python -m bench.front_end --state-dir DIR [--light-requests 12] [--json out.json]

1. Catchments: from each client city, through the Anycast front and through the stack's DNS
   (ECS for the city's subnet), which PoP answers (`x-meridian-pop`), against the nearest.
2. Failover under load: 16 workers (the `openai` client, default retries) send non-streamed
   requests from one city's Anycast port; its PoP is withdrawn (`POST .../withdraw`), later
   announced again, then killed (SIGKILL of its gateway). Counted: failed requests; and, from a
   prober that opens a fresh connection every 20 ms, the time until new connections land on the
   next PoP.
3. The edge tier: light requests (a short prompt, max_tokens 8, streamed) from the city beside
   the edge PoP, alternately as `auto` (the edge) and naming the model (a region, far away),
   over kept-alive connections; TTFT p50 of each and their ratio; and the region's share of the
   `auto` traffic from the gateway's metrics.

Reports the load average (the machine is shared) beside every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import ssl
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from bench.loadgen import percentile
from gateway.anycast import Anycast, pops_at
from stack.front_cli import resolve
from stack.state import StackState, StateDir
from wire.geo import LOCATIONS, locate

NUM_WORKERS = 16
PROBE_INTERVAL_S = 0.02
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]


@dataclass
class Bench:
    state: StackState
    state_root: Path
    api_key: str
    model: str
    verify: ssl.SSLContext
    report: dict[str, Any] = field(default_factory=dict)

    def city_url(self, city: str) -> str:
        return self.state.clients[city]

    def pop_via(self, url: str) -> str:
        """The PoP a fresh connection to `url` lands on (its /health names it)."""
        with httpx.Client(verify=self.verify, timeout=5.0, trust_env=False) as client:
            pop: str = client.get(url + "/health").json()["pop"]
        return pop


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def make_bench(state_root: Path) -> Bench:
    state_dir = StateDir(state_root)
    state = state_dir.read()
    if state is None or not state.ready:
        raise SystemExit(
            f"no ready stack in {state_root}: meridian up --config bench/front_end.yaml"
        )
    admin = state_dir.read_tokens()["MERIDIAN_ADMIN_TOKEN"]
    headers = {"Authorization": f"Bearer {admin}"}
    created = httpx.post(
        f"{state.control_plane_url}/v1/keys",
        json={"name": "bench-front-end", "rpm": 100_000, "tpm": 100_000_000},
        headers=headers,
        trust_env=False,
    ).json()
    verify = ssl.create_default_context(cafile=state.ca_cert)
    models = httpx.get(
        state.gateway_url + "/v1/models",
        headers={"Authorization": f"Bearer {created['secret']}"},
        verify=verify,
        trust_env=False,
    )
    for _ in range(50):  # the key reaches the gateways within about a second
        if models.status_code == 200:
            break
        time.sleep(0.1)
        models = httpx.get(
            state.gateway_url + "/v1/models",
            headers={"Authorization": f"Bearer {created['secret']}"},
            verify=verify,
            trust_env=False,
        )
    model = next(m["id"] for m in models.json()["data"] if m["id"] != "auto")
    return Bench(state, state_root, created["secret"], model, verify)


# 1. Catchments.


def catchments(bench: Bench) -> None:
    table = Anycast(pops_at(list(bench.state.pops), LOCATIONS))
    rows = []
    for city in bench.state.clients:
        said: list[str] = []
        resolve(bench.state_root, city, True, said.append)
        address = said[0]
        port = bench.state.gateway_url.rsplit(":", 1)[1]
        rows.append(
            {
                "city": city,
                "nearest": table.reach(locate(city)).pop,
                "anycast": bench.pop_via(bench.city_url(city)),
                "dns": bench.pop_via(f"https://{address}:{port}"),
                "dns_address": address,
            }
        )
    bench.report["catchments"] = rows
    for row in rows:
        print(
            f"  {row['city']:<10} nearest {row['nearest']:<10} anycast → {row['anycast']:<10} "
            f"DNS → {row['dns']} ({row['dns_address']})"
        )


# 2. Failover under load.


@dataclass
class LoadRun:
    num_ok: int = 0
    num_failed: int = 0
    errors: list[str] = field(default_factory=list)
    pops: dict[str, int] = field(default_factory=dict)


async def _worker(bench: Bench, url: str, run: LoadRun, stop: asyncio.Event) -> None:
    http = httpx.AsyncClient(verify=bench.verify, timeout=60.0, trust_env=False)
    # The openai package types its client against its own httpx fork; httpx's works the same.
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=bench.api_key, http_client=http)  # type: ignore[arg-type]
    try:
        while not stop.is_set():
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=bench.model,
                    messages=QUESTION,
                    max_tokens=4,
                )
                pop = raw.headers.get("x-meridian-pop", "?")
                run.pops[pop] = run.pops.get(pop, 0) + 1
                run.num_ok += 1
            except openai.OpenAIError as exc:
                run.num_failed += 1
                run.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    finally:
        await client.close()


def _landed_after(bench: Bench, url: str, old_pop: str, since_s: float) -> float | None:
    """Seconds from `since_s` until a fresh connection to `url` lands on another PoP."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if bench.pop_via(url) != old_pop:
                return time.monotonic() - since_s
        time.sleep(PROBE_INTERVAL_S)
    return None


async def _under_load(bench: Bench, city: str, event: str, hold_s: float) -> dict[str, Any]:
    url = bench.city_url(city)
    pop = bench.pop_via(url)
    run, stop = LoadRun(), asyncio.Event()
    workers = [asyncio.create_task(_worker(bench, url, run, stop)) for _ in range(NUM_WORKERS)]
    await asyncio.sleep(hold_s)
    started_s = time.monotonic()
    if event == "withdraw":
        httpx.post(f"{bench.state.anycast_url}/v1/anycast/{pop}/withdraw", trust_env=False)
    else:
        record = next(r for r in bench.state.processes if r.name == f"gateway {pop}")
        os.kill(record.pid, signal.SIGKILL)
    moved_s = await asyncio.to_thread(_landed_after, bench, url, pop, started_s)
    await asyncio.sleep(hold_s)
    stop.set()
    await asyncio.gather(*workers)
    if event == "withdraw":
        httpx.post(f"{bench.state.anycast_url}/v1/anycast/{pop}/announce", trust_env=False)
    return {
        "city": city,
        "pop": pop,
        "event": event,
        "num_ok": run.num_ok,
        "num_failed": run.num_failed,
        "errors": run.errors[:5],
        "answered_by": run.pops,
        "new_connections_moved_after_s": None if moved_s is None else round(moved_s, 3),
        "load_average": load_average(),
    }


def failover(bench: Bench, city: str, hold_s: float) -> None:
    results = []
    for event in ("withdraw", "kill"):
        result = asyncio.run(_under_load(bench, city, event, hold_s))
        results.append(result)
        print(
            f"  {event:<8} {result['pop']} under {NUM_WORKERS} concurrent requests from {city}: "
            f"{result['num_ok']} ok, {result['num_failed']} failed; new connections on the next "
            f"PoP after {result['new_connections_moved_after_s']} s; answered by "
            f"{result['answered_by']} (load {result['load_average']})"
        )
        for error in result["errors"]:
            print(f"    {error}")
        time.sleep(2.0)  # the announced PoP back in the routes
    bench.report["failover"] = results


# 3. The edge tier.


def _ttft_s(client: openai.OpenAI, model: str) -> tuple[float, str]:
    started = time.monotonic()
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=QUESTION,
        max_tokens=8,
        stream=True,
    ) as response:
        tier = response.headers.get("x-meridian-tier", "?")
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", ""):
                return time.monotonic() - started, tier
    return time.monotonic() - started, tier


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def edge_tier(bench: Bench, city: str, num_requests: int) -> None:
    url = bench.city_url(city)
    pop = bench.pop_via(url)
    metrics_url = bench.state.pop_metrics[pop]
    http = httpx.Client(verify=bench.verify, timeout=60.0, trust_env=False)
    metrics_before = http.get(metrics_url).text
    client = openai.OpenAI(base_url=url + "/v1", api_key=bench.api_key, http_client=http)  # type: ignore[arg-type]
    _ttft_s(client, bench.model)  # warm: the connection, both paths
    _ttft_s(client, "auto")
    samples: dict[str, list[float]] = {"auto": [], "region": []}
    tiers: dict[str, set[str]] = {"auto": set(), "region": set()}
    for _ in range(num_requests):
        for label, model in (("auto", "auto"), ("region", bench.model)):
            ttft, tier = _ttft_s(client, model)
            samples[label].append(ttft)
            tiers[label].add(tier)
    metrics_after = http.get(metrics_url).text
    http.close()
    p50 = {label: statistics.median(values) for label, values in samples.items()}
    auto_at_edge = _metric(
        metrics_after, "meridian_gateway_auto_requests_total", tier="edge"
    ) - _metric(metrics_before, "meridian_gateway_auto_requests_total", tier="edge")
    auto_at_region = _metric(
        metrics_after, "meridian_gateway_auto_requests_total", tier="region"
    ) - _metric(metrics_before, "meridian_gateway_auto_requests_total", tier="region")
    ttft_p50_ms = {k: round(v * 1000, 1) for k, v in p50.items()}
    result: dict[str, Any] = {
        "city": city,
        "pop": pop,
        "num_requests_each": num_requests,
        "ttft_p50_ms": ttft_p50_ms,
        "ttft_p90_ms": {k: round((percentile(v, 90) or 0.0) * 1000, 1) for k, v in samples.items()},
        "ratio_region_over_edge": round(p50["region"] / p50["auto"], 2),
        "tiers_seen": {k: sorted(v) for k, v in tiers.items()},
        "auto_requests_at_edge": auto_at_edge,
        "auto_requests_at_regions": auto_at_region,
        "load_average": load_average(),
    }
    bench.report["edge"] = result
    print(
        f"  light requests from {city} (PoP {pop}): TTFT p50 auto {ttft_p50_ms['auto']} ms "
        f"(tier {result['tiers_seen']['auto']}), to a region {ttft_p50_ms['region']} ms: "
        f"{result['ratio_region_over_edge']}x; `auto` at the edge {auto_at_edge:g}, at regions "
        f"{auto_at_region:g} (load {result['load_average']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.front_end", description=__doc__)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--failover-city", default="paris")
    parser.add_argument("--edge-city", default="sydney")
    parser.add_argument("--light-requests", type=int, default=12)
    parser.add_argument("--hold", type=float, default=4.0, help="seconds of load around events")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bench = make_bench(args.state_dir)
    bench.report["load_average_before"] = load_average()
    print(f"front end of {args.state_dir} (load {load_average()}):")
    print("1. catchments")
    catchments(bench)
    print("3. the edge tier")
    edge_tier(bench, args.edge_city, args.light_requests)
    print("2. failover under load")
    failover(bench, args.failover_city, args.hold)
    if args.json is not None:
        args.json.write_text(json.dumps(bench.report, indent=2) + "\n")


if __name__ == "__main__":
    main()
