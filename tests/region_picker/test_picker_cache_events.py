"""The picker with the nodes' cache event streams: its decision follows what a node's stream
says it holds (over what the picker guessed from its own sends), with the tenant's salt as the
node derives it; the running service listens for the streams, feeds its index and exports
what it knows as metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from pydantic import SecretStr
from websockets.asyncio.client import connect

from engine.loader import Checkpoint
from region_picker.cache_index import SENT_RECENTLY_S, CacheIndex, ExactOrGuessed
from region_picker.metrics import PickerMetrics
from region_picker.node_book import REPORT_LAG_S, NodeBook
from region_picker.picker import Deflection, Picker
from region_picker.prompt_hashes import PromptHasher
from region_picker.routed_prefixes import RoutedPrefixes
from region_picker.scoring import Decision
from region_picker.service import start
from region_picker.settings import PickerSettings
from wire.cache_events import CACHE_EVENTS_PATH, CacheSnapshot
from wire.cache_salt import CACHE_SALT_HEADER, engine_cache_salt
from wire.deflection import ALTERNATIVE_HEADER
from wire.region_nodes import NodeLoad, RegionNodes

MODEL = "smollm2-135m-instruct"
SYSTEM = "You answer questions about the fleet's regions, briefly and precisely. " * 20
NODES = RegionNodes(
    index=1,
    region="us-east",
    nodes=tuple(
        NodeLoad(
            node_id=name,
            url=f"http://127.0.0.1:{port}",
            model=MODEL,
            block_size=16,
            kv_blocks_total=1000,
            kv_blocks_free=1000,
        )
        for name, port in (("node-a", 9001), ("node-b", 9002))
    ),
)


def snapshot(node_id: str, hashes: list[bytes]) -> CacheSnapshot:
    return CacheSnapshot(node_id=node_id, block_size=16, seq=0, hashes=[h.hex() for h in hashes])


def picker_over(
    book: NodeBook, index: CacheIndex, routed: RoutedPrefixes, hasher: PromptHasher
) -> Picker:
    """The picker as the service builds it, over these views, seeded."""
    view = ExactOrGuessed(index, routed)
    return Picker(book, {MODEL: hasher}, view, routed, PickerMetrics(), random.Random(0))


def test_a_prompt_goes_where_the_nodes_stream_says_it_is_cached(
    smollm2_checkpoint: Checkpoint,
) -> None:
    hasher = PromptHasher(smollm2_checkpoint.tokenizer, 16)
    system = [{"role": "system", "content": SYSTEM}]
    # The tenant's system prompt as the node cached it: salted as the node salts the header.
    held = hasher.chat_hashes(system, engine_cache_salt("tenant-1", None))
    now = [0.0]
    book, index = NodeBook(clock=lambda: now[0]), CacheIndex()
    routed = RoutedPrefixes(clock=lambda: now[0])
    book.adopt(NODES)
    index.apply_snapshot(snapshot("node-a", []))  # a's stream: it evicted them
    index.apply_snapshot(snapshot("node-b", held))
    routed.record("node-a", held)  # where the picker last sent the tenant, a while ago
    now[0] = SENT_RECENTLY_S + 1
    picker = picker_over(book, index, routed, hasher)
    body = {"model": MODEL, "messages": [*system, {"role": "user", "content": "Which region?"}]}
    decision = picker.decide({CACHE_SALT_HEADER: "tenant-1"}, json.dumps(body).encode())
    assert isinstance(decision, Decision)
    assert decision.chosen.candidate.node_id == "node-b"
    assert (
        decision.chosen.cached_blocks >= len(held) - 1 > 0
    )  # the template's last block may differ
    other = picker.decide({CACHE_SALT_HEADER: "tenant-2"}, json.dumps(body).encode())
    assert isinstance(other, Decision) and other.chosen.cached_blocks == 0  # another tenant's chain
    # A body `cache_salt` splits the tenant's partition further, at the node and here alike.
    split = hasher.chat_hashes(system, engine_cache_salt("tenant-1", "team-a"))
    index.apply_snapshot(snapshot("node-a", split))
    now[0] += REPORT_LAG_S + 1  # the reports count what was sent above
    salted = json.dumps(body | {"cache_salt": "team-a"}).encode()
    decision = picker.decide({CACHE_SALT_HEADER: "tenant-1"}, salted)
    assert isinstance(decision, Decision) and decision.chosen.candidate.node_id == "node-a"
    assert decision.chosen.cached_blocks >= len(split) - 1 > 0


def test_cold_prompts_spread_and_a_prompts_next_request_follows_it_before_its_events_come(
    smollm2_checkpoint: Checkpoint,
) -> None:
    """Both nodes stream and hold nothing yet, and no report counts the picker's sends: a
    tenant's second chat goes where its first is being prefilled, another tenant's to the
    other node (the prompt tokens just sent there are work ahead)."""
    hasher = PromptHasher(smollm2_checkpoint.tokenizer, 16)
    book, index, routed = NodeBook(), CacheIndex(), RoutedPrefixes()
    book.adopt(NODES)
    for load in NODES.nodes:
        index.apply_snapshot(snapshot(load.node_id, []))
    picker = picker_over(book, index, routed, hasher)

    def chat(tenant: str, question: str) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = json.dumps({"model": MODEL, "messages": messages, "stream": True}).encode()
        decision = picker.decide({CACHE_SALT_HEADER: tenant}, body)
        assert isinstance(decision, Decision)
        picker.started(decision.chosen.candidate.node_id)  # a stream's headers come at once
        return decision.chosen.candidate.node_id

    first = chat("tenant-1", "Which region?")
    assert chat("tenant-2", "Which region?") != first
    assert chat("tenant-1", "And the next one?") == first


def test_nodes_keeping_blocks_of_another_size_are_balanced_by_load_alone(
    smollm2_checkpoint: Checkpoint,
) -> None:
    """The picker's tokenizer hashes 32-token blocks, the nodes keep 16: their caches cannot be
    matched, so nothing counts as cached and the prompt's hashes are not remembered."""
    hasher = PromptHasher(smollm2_checkpoint.tokenizer, 32)
    book, index, routed = NodeBook(), CacheIndex(), RoutedPrefixes()
    book.adopt(NODES)
    index.apply_snapshot(
        snapshot("node-a", hasher.chat_hashes([{"role": "system", "content": SYSTEM}], None))
    )
    picker = picker_over(book, index, routed, hasher)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which?"}]
    decision = picker.decide({}, json.dumps({"model": MODEL, "messages": messages}).encode())
    assert isinstance(decision, Decision)
    assert [s.cached_blocks for s in decision.scored] == [0, 0]
    assert len(routed) == 0


def test_a_request_with_a_sooner_region_elsewhere_goes_back_and_costs_no_node_anything(
    smollm2_checkpoint: Checkpoint,
) -> None:
    hasher = PromptHasher(smollm2_checkpoint.tokenizer, 16)
    measured = NODES.model_copy(
        update={
            "nodes": tuple(
                n.model_copy(update={"prefill_tokens_per_s": 1000.0, "step_s": 0.02})
                for n in NODES.nodes
            )
        }
    )
    book, index, routed = NodeBook(), CacheIndex(), RoutedPrefixes()
    book.adopt(measured)
    metrics = PickerMetrics()
    view = ExactOrGuessed(index, routed)
    picker = Picker(book, {MODEL: hasher}, view, routed, metrics, random.Random(0))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which?"}]
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    kept = picker.decide({ALTERNATIVE_HEADER: "60"}, body)
    assert isinstance(kept, Decision) and kept.wait_s is not None and kept.wait_s > 0.02
    picker.started(kept.chosen.candidate.node_id)
    before, num_routed = book.candidates(MODEL), len(routed)
    # Any node's wait holds a step (20 ms) for the request's own first token.
    sent_back = picker.decide({ALTERNATIVE_HEADER: "0.015"}, body)
    assert isinstance(sent_back, Deflection)
    assert sent_back.wait_s >= 0.02 and sent_back.alternative_s == 0.015
    # Sent back, it is no work ahead on any node, and no prompt was routed anywhere.
    assert book.candidates(MODEL) == before and len(routed) == num_routed
    assert metrics.deflections._value.get() == 1
    # An alternative the picker cannot read is none.
    for header in ("soon", "-1", "nan", "1e400"):
        assert isinstance(picker.decide({ALTERNATIVE_HEADER: header}, body), Decision)


@pytest_asyncio.fixture
async def control_plane() -> AsyncIterator[str]:
    """A stand-in for the control plane's region nodes query: the document, then no change."""

    closing = asyncio.Event()

    async def nodes(request: web.Request) -> web.Response:
        if request.query.get("index") != "0":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), 30)
        return web.Response(text=NODES.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/regions/us-east/nodes", nodes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    closing.set()
    await runner.cleanup()


@pytest.mark.asyncio
async def test_the_running_picker_takes_the_nodes_streams_into_its_index(
    control_plane: str,
) -> None:
    settings = PickerSettings(
        region="us-east",
        port=0,
        metrics_port=0,
        cache_events_port=0,
        control_plane=control_plane,
        gateway_token=SecretStr("gateway-token-for-tests"),
    )
    running = await start(settings)
    try:
        url = f"ws://127.0.0.1:{running.cache_events_port}{CACHE_EVENTS_PATH}"
        async with connect(url) as stream:
            await stream.send(snapshot("node-b", [bytes(16)]).model_dump_json())
            for _ in range(500):
                if running.cache_index.is_known("node-b"):
                    break
                await asyncio.sleep(0.01)
            assert running.cache_index.hashes_of("node-b") == {bytes(16)}
            metrics_url = f"http://127.0.0.1:{running.metrics_port}/metrics"
            async with aiohttp.ClientSession() as session, session.get(metrics_url) as reply:
                exposed = set((await reply.text()).splitlines())
            assert {
                "meridian_picker_cache_nodes_known 1.0",
                'meridian_picker_cache_blocks{node="node-b"} 1.0',
                "meridian_picker_cache_stream_snapshots_total 1.0",
                "meridian_picker_cache_stream_gaps_total 0.0",
            } <= exposed
    finally:
        await running.stop()
