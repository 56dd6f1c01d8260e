"""Benchmark: the region's KV-cache-aware endpoint picker against Envoy's least request (issue 34).

    python -m bench.endpoint_picker [--requests-per-tenant 6] [--kv-cache-gib 0.11] [--json out]

One run brings up a real `meridian up` (stack/, config written here: one region of 3 node agents
of the default model, its Envoy and picker, one gateway in front, no RTT delays) and, in it:

1. The picker killed mid-run: short chats at 4 at once through the gateway; the picker is
   killed (SIGKILL) after the first few. Counted: failed requests (Envoy goes on without it).
2. Least request: the workload with the picker down (Envoy's fallback cluster).
3. The picker started again: seconds until every node streams its cache to it again, then one
   chat per tenant of phase 2, whose cached tokens it must predict exactly (each node's snapshot
   resynchronised its index).
4. Picker: the same workload, each tenant under a fresh API key (its own cache salt, so nothing
   cached in phase 2 is of use).
5. A node killed (SIGKILL, with its engine) under short chats: seconds from the kill until the
   picker's last decision for it, against the heartbeat interval; failed requests.

The workload: `--tenants` tenants (each its own API key, so its own cache salt, as the gateway
sets it), each with its own system prompt of about `--system-tokens` tokens, each sending
`--requests-per-tenant` chats (its own questions, the same in both phases), streamed, greedy:
one after another (`--arrival per-tenant`, the default), or taken by as many workers from one
queue in rounds (`--arrival interleaved`: a tenant's next chat does not wait for its last; one
after another, least request sends a tenant back to the node that just answered it, the one with
the fewest requests in flight: an accidental affinity, docs/benchmarks.md). Reported per phase:
prompt tokens served from cache (`usage.prompt_tokens_details.cached_tokens`) as a share of the
ideal (every prompt's system part, in whole blocks, cached after the tenant's first request),
TTFT p50 / p99, throughput; and the ratios picker / least request. CPU flags and load average
beside them (bench/report.py).

KV cache per node (`--kv-cache-gib`): the default 0.11 GiB holds 320 blocks of 16 tokens, 3.3 of
the 8 tenants' ~1,500-token (96-block) prefixes: each node can keep the 2-3 tenants the picker
gives it, the region (10 prefixes) every tenant once, but no node every tenant, which least
request, spreading tenants over nodes at random, would need. Tenant t starts `t * --stagger-s`
after the first (tenants arrive one by one, not in one cold burst).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import percentile
from bench.report import load_average, machine, report_out
from stack import commands
from stack.config import DEFAULT_MODEL, parse_config
from stack.layout import plan_layout
from stack.processes import send_signal, spawn
from stack.state import ProcessRecord, StackState, StateDir

REGION = "us-east"
NUM_NODES = 3
BLOCK_SIZE = 16
PORTS = {  # away from the defaults, so a developer's own `meridian up` does not clash
    "control_plane": 28080,
    "xds": 28000,
    "dns": 28053,
    "gateway": 28443,
    "gateway_metrics": 29464,
    "anycast_base": 28601,
    "anycast_admin": 28600,
    "redis": 28390,
    "postgres": 28433,
    "edge_base": 29501,
    "node_base": 29001,
    "envoy_base": 30001,
    "envoy_admin_base": 30101,
    "rtt_proxy_base": 30201,
    "picker_base": 30701,
    "picker_metrics_base": 30801,
    "picker_events_base": 30901,
}
WORDS_TEXT = (
    "river stone lantern orchard copper meadow harbour violet ledger canyon ember falcon "
    "glacier hollow island juniper kettle marble nectar oasis pepper quartz saddle thistle "
    "umber velvet willow yarrow zephyr anchor bramble cobalt dune fennel garnet heron indigo"
)
TOPICS = (
    "a lighthouse",
    "photosynthesis",
    "a sonnet",
    "the moon",
    "a compass",
    "rainfall",
    "a violin",
    "bread",
    "a glacier",
    "gravity",
    "a bridge",
    "tea",
)


def stack_yaml(kv_cache_gib: float, picker: bool) -> str:
    ports = "\n".join(f"  {name}: {port}" for name, port in PORTS.items())
    return (
        f"model: {DEFAULT_MODEL}\n"
        f"regions: [{{name: {REGION}, nodes: {NUM_NODES}}}]\n"
        "pops: [new-york]\nclients: [chicago]\nlimits: local\nenvoy: 'on'\n"
        f"simulate_rtt: false\npicker: {'on' if picker else 'off'}\n"
        f"node: {{kv_cache_gib: {kv_cache_gib}, max_num_seqs: 16}}\n"
        "api_key: {name: bench, rpm: 100000, tpm: 100000000}\n"
        f"ports:\n{ports}\n"
    )


@dataclass(frozen=True, slots=True)
class Tenant:
    system: str
    prefix_tokens: int  # its chats' shared prompt tokens, in whole blocks (what can be cached)


@dataclass(slots=True)
class Answer:
    ok: bool
    ttft_s: float = 0.0
    end_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class Stack:
    root: Path
    state: StackState
    tokens: dict[str, str]
    verify: ssl.SSLContext
    picker: ProcessRecord
    nodes: list[ProcessRecord]
    config_text: str
    extra: list[ProcessRecord] = field(default_factory=list)  # what the bench itself started

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens['MERIDIAN_ADMIN_TOKEN']}"}


def make_tenants(num_tenants: int, system_tokens: int) -> list[Tenant]:
    """Each tenant's system prompt (words drawn from its own seed) and its cacheable prefix,
    measured with the model's tokenizer as the node renders the chat."""
    from engine.loader import load_checkpoint  # torch: only here
    from engine.model_store import resolve_model
    from region_picker.prompt_hashes import PromptHasher

    hasher = PromptHasher(load_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer, BLOCK_SIZE)
    tenants = []
    for t in range(num_tenants):
        rng, vocabulary = random.Random(t), WORDS_TEXT.split()
        words = [f"You are the assistant of tenant {t}. Its handbook follows."]
        while len(hasher.tokenizer.encode(" ".join(words))) < system_tokens:
            words += [f"{rng.choice(vocabulary)} {rng.randint(0, 999)}" for _ in range(16)]
        system = " ".join(words)
        a, b = (hasher.chat_hashes(_messages(system, question(t, j)), None) for j in (0, 1))
        shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        tenants.append(Tenant(system, shared * BLOCK_SIZE))
    return tenants


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def question(tenant: int, j: int) -> str:
    return f"Request {j} of tenant {tenant}: in one sentence, what is {TOPICS[j % len(TOPICS)]}?"


# The stack.


def stack_up(root: Path, config_text: str) -> Stack:
    config_path = root / "stack.yaml"
    config_path.write_text(config_text)
    argv = [sys.executable, "-m", "stack", "up", "--config", str(config_path)]
    argv += ["--state-dir", str(root / "state"), "--detach"]
    print(f"meridian up (3 nodes, Envoy, picker) in {root} ...", flush=True)
    with (root / "up.log").open("wb") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    state_dir = StateDir(root / "state")
    state = state_dir.read()
    if done.returncode != 0 or state is None or not state.ready:
        raise SystemExit(f"meridian up failed ({done.returncode}): see {root / 'up.log'}")
    picker = next(p for p in state.processes if p.kind == "picker")
    nodes = sorted((p for p in state.processes if p.kind == "node"), key=lambda p: p.name)
    verify = ssl.create_default_context(cafile=state.ca_cert)
    return Stack(root, state, state_dir.read_tokens(), verify, picker, nodes, config_text)


def stack_down(stack: Stack) -> None:
    for record in stack.extra:
        send_signal(record, signal.SIGTERM)
    argv = [sys.executable, "-m", "stack", "down", "--state-dir", str(stack.root / "state")]
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)


def restart_picker(stack: Stack) -> ProcessRecord:
    """The region's picker started again, exactly as `up` starts it."""
    config = parse_config(stack.config_text)
    layout = plan_layout(config, use_envoy=True)
    command = commands.picker(config, layout, layout.regions[0], stack.tokens)
    log = stack.root / "picker-restarted.log"
    record, _ = spawn(command.name, command.kind, command.argv, command.env, log, command.url)
    stack.extra.append(record)
    return record


def picker_metrics(stack: Stack) -> dict[str, float]:
    """The picker's metrics (name{labels} -> value); empty while it does not answer."""
    assert stack.picker.url is not None
    try:
        text = httpx.get(stack.picker.url, timeout=2.0, trust_env=False).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def create_keys(stack: Stack, names: list[str]) -> list[str]:
    secrets = []
    for name in names:
        body = {"name": name, "rpm": 100_000, "tpm": 100_000_000}
        reply = httpx.post(
            f"{stack.state.control_plane_url}/v1/keys",
            json=body,
            headers=stack.admin,
            trust_env=False,
        )
        reply.raise_for_status()
        secrets.append(reply.json()["secret"])
    for secret in secrets:  # each reaches the gateway within about a second
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            reply = httpx.get(
                stack.state.gateway_url + "/v1/models",
                headers={"Authorization": f"Bearer {secret}"},
                verify=stack.verify,
                trust_env=False,
            )
            if reply.status_code == 200:
                break
            time.sleep(0.2)
    return secrets


# Requests.


async def chat(
    client: httpx.AsyncClient, url: str, key: str, messages: list[dict[str, str]], max_tokens: int
) -> Answer:
    body = {
        "model": DEFAULT_MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    answer = Answer(ok=False)
    try:
        return await _read_stream(client, url, key, body, answer, started)
    finally:  # a failed request's TTFT is its time until it failed (no first token by then)
        answer.ttft_s = answer.ttft_s or time.monotonic() - started


async def _read_stream(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    body: dict[str, Any],
    answer: Answer,
    started: float,
) -> Answer:
    try:
        async with client.stream(
            "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}
        ) as reply:
            if reply.status_code != 200:
                answer.error = f"{reply.status_code}: {(await reply.aread())[:200]!r}"
                return answer
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = str(chunk["error"])[:200]
                    return answer
                if not answer.ttft_s and any(c["delta"].get("content") for c in chunk["choices"]):
                    answer.ttft_s = time.monotonic() - started
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    answer.prompt_tokens = usage["prompt_tokens"]
                    answer.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    answer.cached_tokens = details.get("cached_tokens") or 0
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
        return answer
    answer.end_s = time.monotonic()
    answer.ok = answer.prompt_tokens > 0
    answer.error = "" if answer.ok else "no usage"
    return answer


def client_for(stack: Stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=stack.verify, timeout=300.0, trust_env=False)


def completions_url(stack: Stack) -> str:
    return stack.state.gateway_url + "/v1/chat/completions"


async def workload(
    stack: Stack, name: str, keys: list[str], tenants: list[Tenant], args: argparse.Namespace
) -> dict[str, Any]:
    """per-tenant: every tenant sends its chats one after another, all tenants at once (tenant t
    from `t * stagger_s`). interleaved: as many workers as tenants take the chats from one queue
    (`interleaved_order`), so that a tenant's next chat does not wait for its last one."""
    answers: list[list[Answer]] = [[] for _ in tenants]
    num_total = len(tenants) * args.requests_per_tenant
    started = time.monotonic()

    async def send(client: httpx.AsyncClient, t: int, j: int) -> None:
        messages = _messages(tenants[t].system, question(t, j))
        answers[t].append(
            await chat(client, completions_url(stack), keys[t], messages, args.max_tokens)
        )
        num_done = sum(map(len, answers))
        if num_done % len(tenants) == 0:
            print(f"  [{name}] {num_done}/{num_total} ({time.monotonic() - started:.0f} s)")

    async def tenant_loop(client: httpx.AsyncClient, t: int) -> None:
        await asyncio.sleep(t * args.stagger_s)  # tenants arrive one by one, not in one burst
        for j in range(args.requests_per_tenant):
            await send(client, t, j)

    queue = interleaved_order(len(tenants), args.requests_per_tenant)

    async def queue_worker(client: httpx.AsyncClient) -> None:
        while queue:
            await send(client, *queue.pop(0))

    async with client_for(stack) as client:
        if args.arrival == "per-tenant":
            await asyncio.gather(*(tenant_loop(client, t) for t in range(len(tenants))))
        else:
            await asyncio.gather(*(queue_worker(client) for _ in tenants))
    return summarize(name, answers, tenants, time.monotonic() - started)


def interleaved_order(num_tenants: int, per_tenant: int, seed: int = 0) -> list[tuple[int, int]]:
    """(tenant, chat) pairs: round j holds every tenant's chat j, tenants in a seeded order."""
    rng, order = random.Random(seed), []
    for j in range(per_tenant):
        tenants = list(range(num_tenants))
        rng.shuffle(tenants)
        order += [(t, j) for t in tenants]
    return order


def summarize(
    name: str, answers: list[list[Answer]], tenants: list[Tenant], wall_s: float
) -> dict[str, Any]:
    done = [a for row in answers for a in row if a.ok]
    ideal = sum(tenants[t].prefix_tokens * (len(row) - 1) for t, row in enumerate(answers))
    cached = sum(a.cached_tokens for a in done)
    ttfts = sorted(a.ttft_s for row in answers for a in row)
    return {
        "phase": name,
        "requests": sum(map(len, answers)),
        "failed": sum(not a.ok for row in answers for a in row),
        "errors": sorted({a.error for row in answers for a in row if not a.ok})[:3],
        "prompt_tokens": sum(a.prompt_tokens for a in done),
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "cache_share_of_ideal": round(cached / ideal, 4) if ideal else None,
        "ttft_p50_ms": round((percentile(ttfts, 50) or 0.0) * 1000, 1),
        "ttft_p99_ms": round((percentile(ttfts, 99) or 0.0) * 1000, 1),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(done) / wall_s, 3),
        "output_tokens_per_s": round(sum(a.completion_tokens for a in done) / wall_s, 2),
    }


class ShortChats:
    """Short chats, `concurrency` at once, until stopped: traffic under which to break things."""

    def __init__(self, stack: Stack, key: str) -> None:
        self._stack, self._key = stack, key
        self.answers: list[Answer] = []
        self.stop = asyncio.Event()

    async def run(self, concurrency: int) -> None:
        async with client_for(self._stack) as client:
            await asyncio.gather(*(self._worker(client, w) for w in range(concurrency)))

    async def _worker(self, client: httpx.AsyncClient, w: int) -> None:
        url = completions_url(self._stack)
        while not self.stop.is_set():
            j = len(self.answers)
            messages = [{"role": "user", "content": f"Say a word about {TOPICS[j % 12]} ({w})."}]
            self.answers.append(await chat(client, url, self._key, messages, 4))

    async def until(self, num_answers: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < num_answers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def failures(self) -> dict[str, Any]:
        failed = [a for a in self.answers if not a.ok]
        errors = sorted({a.error for a in failed})[:3]
        return {"requests": len(self.answers), "failed": len(failed), "errors": errors}


def envoy_stat(stack: Stack, name: str) -> int:
    """A counter of the region's Envoy (its admin listener), 0 if absent."""
    url = f"http://127.0.0.1:{PORTS['envoy_admin_base']}/stats?filter={name}"
    for line in httpx.get(url, timeout=5.0, trust_env=False).text.splitlines():
        key, _, value = line.partition(": ")
        if key.endswith(name) and value.strip().isdigit():
            return int(value)
    return 0


async def picker_killed(stack: Stack, key: str) -> dict[str, Any]:
    """The picker killed under traffic: every request must still be answered."""
    print("picker killed mid-run ...", flush=True)
    traffic = ShortChats(stack, key)
    running = asyncio.create_task(traffic.run(concurrency=4))
    await traffic.until(8)
    allowed_before = envoy_stat(stack, "failure_mode_allowed")
    send_signal(stack.picker, signal.SIGKILL)
    await traffic.until(len(traffic.answers) + 16)
    traffic.stop.set()
    await running
    result = traffic.failures()
    allowed = envoy_stat(stack, "failure_mode_allowed") - allowed_before
    result["envoy_failure_mode_allowed"] = allowed
    return result


async def picker_restarted(
    stack: Stack, keys: list[str], tenants: list[Tenant], timeout_s: float = 120.0
) -> dict[str, Any]:
    """The picker started again: how long until every node streams to it (each opens with a
    snapshot), then whether it predicts each tenant's cached tokens exactly (one chat each, on
    the caches the phase before left)."""
    print("picker started again ...", flush=True)
    started = time.monotonic()
    stack.picker = restart_picker(stack)
    resync_s = None
    while time.monotonic() - started < timeout_s:
        known = picker_metrics(stack).get("meridian_picker_cache_nodes_known", 0)
        if known >= NUM_NODES:
            resync_s = round(time.monotonic() - started, 2)
            break
        await asyncio.sleep(0.1)
    metric = "meridian_picker_predicted_cached_tokens_total"
    pairs = []
    async with client_for(stack) as client:
        for key, tenant in zip(keys, tenants, strict=True):
            before = picker_metrics(stack).get(metric, 0.0)
            messages = _messages(tenant.system, "One more question: what is a kite?")
            answer = await chat(client, completions_url(stack), key, messages, 1)
            predicted = int(picker_metrics(stack).get(metric, 0.0) - before)
            pairs.append((predicted, answer.cached_tokens if answer.ok else -1))
    return {
        "all_nodes_streaming_after_s": resync_s,
        "predicted_vs_reported_cached_tokens": pairs,
        "exact": sum(predicted == reported for predicted, reported in pairs),
        "of": len(pairs),
    }


async def node_killed(stack: Stack, key: str, watch_s: float) -> dict[str, Any]:
    """A node killed (with its engine) under traffic: seconds until the picker's last decision
    for it."""
    victim = stack.nodes[-1]
    metric = f'meridian_picker_decisions_total{{node="{victim.name.split()[-1]}"}}'
    print(f"{victim.name} killed ...", flush=True)
    traffic = ShortChats(stack, key)
    running = asyncio.create_task(traffic.run(concurrency=3))
    await traffic.until(6)
    before = picker_metrics(stack).get(metric, 0.0)
    await traffic.until(len(traffic.answers) + 12)
    last_count, last_change_s = picker_metrics(stack).get(metric, 0.0), 0.0
    killed_at = time.monotonic()
    send_signal(victim, signal.SIGKILL)
    while time.monotonic() - killed_at < watch_s:
        await asyncio.sleep(0.05)
        count = picker_metrics(stack).get(metric, last_count)
        if count != last_count:
            last_count, last_change_s = count, time.monotonic() - killed_at
    traffic.stop.set()
    await running
    return traffic.failures() | {
        "its_decisions_in_the_12_requests_before": int(last_count - before),
        "last_decision_for_it_after_s": round(last_change_s, 2),
    }


def ratios(picker: dict[str, Any], least: dict[str, Any]) -> dict[str, float | None]:
    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "cache_share": over(picker["cache_share_of_ideal"], least["cache_share_of_ideal"]),
        "ttft_p50_lower_x": over(least["ttft_p50_ms"], picker["ttft_p50_ms"]),
        "ttft_p99_lower_x": over(least["ttft_p99_ms"], picker["ttft_p99_ms"]),
        "throughput": over(picker["requests_per_s"], least["requests_per_s"]),
    }


async def run(stack: Stack, tenants: list[Tenant], args: argparse.Namespace) -> dict[str, Any]:
    n = len(tenants)
    names = [f"lr-{t}" for t in range(n)] + [f"picker-{t}" for t in range(n)] + ["chaos"]
    keys = create_keys(stack, names)
    least_keys, picker_keys, chaos_key = keys[:n], keys[n : 2 * n], keys[-1]
    report: dict[str, Any] = {}
    warm = ShortChats(stack, chaos_key)  # every node's first requests pay for warm-up
    warming = asyncio.create_task(warm.run(concurrency=NUM_NODES))
    await warm.until(4 * NUM_NODES)
    warm.stop.set()
    await warming
    report["picker_killed"] = await picker_killed(stack, chaos_key)
    print("least request (picker down) ...", flush=True)
    allowed_before = envoy_stat(stack, "failure_mode_allowed")
    report["least_request"] = await workload(stack, "least request", least_keys, tenants, args)
    allowed = envoy_stat(stack, "failure_mode_allowed") - allowed_before
    report["least_request"]["envoy_failure_mode_allowed"] = allowed
    report["picker_restarted"] = await picker_restarted(stack, least_keys, tenants)
    print("picker ...", flush=True)
    report["picker"] = await workload(stack, "picker", picker_keys, tenants, args)
    report["ratios"] = ratios(report["picker"], report["least_request"])
    if not args.skip_node_kill:
        report["node_killed"] = await node_killed(stack, chaos_key, args.node_watch_s)
        report["node_killed"]["heartbeat_interval_s"] = 1.0
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.endpoint_picker", description=__doc__)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--requests-per-tenant", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--arrival", choices=("per-tenant", "interleaved"), default="per-tenant")
    parser.add_argument("--stagger-s", type=float, default=1.0)
    parser.add_argument("--kv-cache-gib", type=float, default=0.11)
    parser.add_argument("--node-watch-s", type=float, default=6.0)
    parser.add_argument("--skip-node-kill", action="store_true")
    parser.add_argument("--json", help="write the whole report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = load_average()
    tenants = make_tenants(args.tenants, args.system_tokens)
    print(f"{len(tenants)} tenants, cacheable prefixes {[t.prefix_tokens for t in tenants]}")
    root = Path(tempfile.mkdtemp(prefix="bench-endpoint-picker-"))
    stack = stack_up(root, stack_yaml(args.kv_cache_gib, picker=True))
    try:
        report = asyncio.run(run(stack, tenants, args))
    finally:
        stack_down(stack)
    report["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    report["machine"] = machine(load_before)
    for phase in ("least_request", "picker"):
        print(json.dumps(report[phase]))
    report_out(report, args.json, ("ratios", "picker_killed", "picker_restarted", "node_killed"))


if __name__ == "__main__":
    main()
