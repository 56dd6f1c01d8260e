"""A node agent streams its engine's prefix cache to the picker's index over real sockets: the
index ends up holding exactly what the cache holds, after a lost batch (the picker asks for a
snapshot), after the picker restarts (the node reconnects with one), and never at the cost of
serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fake_engine import BLOCK_SIZE, FakeEngine
from node_helpers import (
    MODEL_NAME,
    BackgroundLoop,
    NodeHandle,
    free_port,
    start_fake_engine,
    start_node,
    wait_until,
)
from pydantic import ValidationError
from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve

from engine.async_engine import AsyncEngine
from engine.cache_events import CacheEvents
from engine.kv_cache_manager import chain_root, hash_block
from engine.tokenizer import Tokenizer
from node_agent.cache_buffer import CacheEventBuffer, Delta, Snapshot
from node_agent.cache_stream import snapshot_frames
from node_agent.settings import NodeAgentSettings
from region_picker.cache_index import CacheIndex
from region_picker.cache_receiver import CacheEventReceiver
from region_picker.node_streams import NodeStreams
from region_picker.prompt_hashes import PromptHasher
from wire.cache_events import CACHE_EVENTS_PATH, CacheSnapshot, parse_node_message
from wire.cache_salt import CACHE_SALT_HEADER, engine_cache_salt

WAIT_S = 10.0


def port_of(server: Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


@dataclass
class Picker:
    """The picker's cache index and receiver, listening on the servers' loop."""

    loop: BackgroundLoop
    token: str | None = None  # the serving token it asks of a node's stream
    index: CacheIndex = field(default_factory=CacheIndex)
    receiver: CacheEventReceiver = field(init=False)
    server: Server | None = None

    def __post_init__(self) -> None:
        self.receiver = CacheEventReceiver(self.index, NodeStreams(), self.token)

    def start(self, port: int = 0) -> int:
        self.server = self.loop.run(self.receiver.serve("127.0.0.1", port))
        return port_of(self.server)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.loop.run(self.server.wait_closed())
            self.server = None

    def holds(self, node_id: str) -> frozenset[bytes]:
        return self.loop.call(lambda: self.index.hashes_of(node_id))


@pytest.fixture
def picker(server_loop: BackgroundLoop) -> Iterator[Picker]:
    picker = Picker(server_loop)
    yield picker
    picker.stop()


@pytest.fixture
def small_engine(server_loop: BackgroundLoop) -> Iterator[FakeEngine]:
    """A fake engine whose pool of 12 blocks the prompts below overflow: it evicts."""
    llm = start_fake_engine(server_loop, num_kv_blocks=12)
    yield llm
    server_loop.run(llm.shutdown())


def prompt_text(index: int) -> str:
    return f"You are assistant number {index % 3}, and you answer briefly. Question {index}?"


def send_prompts(
    node: NodeHandle, start: int, count: int, headers: dict[str, str] | None = None
) -> None:
    with node.client(headers=headers) as client:
        for index in range(start, start + count):
            response = client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt_text(index), "max_tokens": 2},
                headers={CACHE_SALT_HEADER: f"tenant-{index % 2}"},
            )
            assert response.status_code == 200, response.text


def follows(picker: Picker, llm: FakeEngine, node: NodeHandle, loop: BackgroundLoop) -> bool:
    """The index holds exactly what the node's engine holds (and that is not nothing)."""
    actual = loop.call(llm.cached_hashes)
    return bool(actual) and picker.holds(node.runtime.node_id) == actual


def wait_for(predicate: Callable[[], bool]) -> None:
    assert wait_until(predicate, WAIT_S), "the condition did not come true in time"


def test_the_index_follows_a_nodes_cache_exactly_as_it_fills_and_evicts(
    server_loop: BackgroundLoop, picker: Picker, small_engine: FakeEngine
) -> None:
    port = picker.start()
    node = start_node(server_loop, small_engine, picker_url=f"http://127.0.0.1:{port}")
    try:
        for start in range(0, 12, 4):
            send_prompts(node, start, 4)
            wait_for(lambda: follows(picker, small_engine, node, server_loop))
        stats = picker.receiver.stats
        assert stats.num_snapshots == 1 and stats.num_gaps == 0 and stats.num_deltas > 1
        with node.client() as client:
            exposed = set(client.get("/metrics").text.splitlines())
        label = f'{{model_name="{MODEL_NAME}"}}'
        assert {
            f"meridian:cache_events_connected{label} 1.0",
            f"meridian:cache_events_snapshots_total{label} 1.0",
            f"meridian:cache_events_overflows_total{label} 0.0",
        } <= exposed
        # Every hash's holders are this node, both directions agree.
        node_id = node.runtime.node_id
        held = picker.holds(node_id)
        holders = server_loop.call(lambda: {picker.index.nodes_holding(h) for h in held})
        assert holders == {frozenset({node_id})}
        # The last prompt's blocks, hashed as a picker hashes them (the engine's chain, salted
        # as the node salts a header's tenant), are the ones the index holds.
        ids = small_engine.tokenizer.encode(prompt_text(11))
        parent = chain_root(engine_cache_salt("tenant-1", None))
        for start in range(0, len(ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash_block(parent, ids[start : start + BLOCK_SIZE])
            assert parent in held
    finally:
        node.stop()


class DroppingProxy:
    """Relays the stream between node and picker, dropping the node's `drop_delta`-th batch
    (counting from 1): a batch lost on the way."""

    def __init__(self, upstream_port: int, drop_delta: int) -> None:
        self._upstream = f"ws://127.0.0.1:{upstream_port}{CACHE_EVENTS_PATH}"
        self._drop_delta = drop_delta
        self.num_deltas = 0

    async def serve(self) -> Server:
        return await serve(self._relay, "127.0.0.1", 0)

    async def _relay(self, downstream: ServerConnection) -> None:
        async with connect(self._upstream) as upstream:

            async def forward() -> None:
                async for frame in downstream:
                    if json.loads(frame)["kind"] == "delta":
                        self.num_deltas += 1
                        if self.num_deltas == self._drop_delta:
                            continue
                    await upstream.send(frame)

            async def back() -> None:
                async for frame in upstream:
                    await downstream.send(frame)

            tasks = [asyncio.create_task(forward()), asyncio.create_task(back())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def test_a_lost_batch_is_noticed_and_a_snapshot_repairs_the_index(
    server_loop: BackgroundLoop, picker: Picker, small_engine: FakeEngine
) -> None:
    picker_port = picker.start()
    proxy = DroppingProxy(picker_port, drop_delta=2)
    proxy_server = server_loop.run(proxy.serve())
    node = start_node(
        server_loop, small_engine, picker_url=f"ws://127.0.0.1:{port_of(proxy_server)}"
    )
    try:
        send_prompts(node, 0, 6)
        # Each prompt caches a block of its own: every batch changes what the node holds, so
        # the index cannot follow it again before the snapshot that the gap asked for.
        wait_for(lambda: proxy.num_deltas >= 3 and follows(picker, small_engine, node, server_loop))
        stats = picker.receiver.stats
        assert stats.num_gaps == 1 and stats.num_snapshots >= 2
    finally:
        node.stop()
        proxy_server.close()
        server_loop.run(proxy_server.wait_closed())


def test_a_restarted_picker_gets_a_snapshot_when_the_node_reconnects(
    server_loop: BackgroundLoop, picker: Picker, small_engine: FakeEngine
) -> None:
    port = picker.start()
    node = start_node(server_loop, small_engine, picker_url=f"http://127.0.0.1:{port}")
    try:
        send_prompts(node, 0, 4)
        wait_for(lambda: follows(picker, small_engine, node, server_loop))
        picker.stop()
        assert picker.holds(node.runtime.node_id) == frozenset()  # its stream ended
        send_prompts(node, 4, 6)  # served while no picker listens; the cache moves on
        picker.start(port)
        wait_for(lambda: follows(picker, small_engine, node, server_loop))
        assert picker.receiver.stats.num_snapshots == 2
    finally:
        node.stop()


def test_a_picker_that_asks_for_the_serving_token_takes_only_the_nodes_that_have_it(
    server_loop: BackgroundLoop, small_engine: FakeEngine
) -> None:
    token, other = "serving-secret-0123456789", "another-token-0123456789"
    picker = Picker(server_loop, token=token)
    url = f"http://127.0.0.1:{picker.start()}"
    node = start_node(server_loop, small_engine, picker_url=url, serving_token=token)
    stranger = start_node(server_loop, small_engine, picker_url=url, serving_token=other)
    try:
        send_prompts(node, 0, 4, {"Authorization": f"Bearer {token}"})
        wait_for(lambda: follows(picker, small_engine, node, server_loop))
        # The stranger's stream is refused (and retried) while it serves as ever.
        send_prompts(stranger, 4, 2, {"Authorization": f"Bearer {other}"})
        wait_for(lambda: picker.receiver.stats.num_refused >= 2)  # refused, retried, refused
        assert picker.receiver.stats.num_connections == 1
        assert picker.loop.call(lambda: picker.index.node_ids) == {node.runtime.node_id}
    finally:
        node.stop()
        stranger.stop()
        picker.stop()


def test_a_node_whose_picker_is_unreachable_serves_as_ever(
    server_loop: BackgroundLoop, small_engine: FakeEngine
) -> None:
    node = start_node(server_loop, small_engine, picker_url=f"http://127.0.0.1:{free_port()}")
    try:
        send_prompts(node, 0, 3)
        with httpx.Client(base_url=node.base_url) as client:
            assert client.get("/ready").status_code == 200
    finally:
        node.stop()


def test_an_overflowing_buffer_drops_its_batches_for_one_snapshot() -> None:
    async def scenario() -> None:
        buffer = CacheEventBuffer(max_pending_batches=2)
        buffer.apply(CacheEvents((b"a",), is_snapshot=True))
        assert buffer.next_message() == Snapshot(0, (b"a",))
        buffer.apply(CacheEvents((b"a",), is_snapshot=True))  # another watcher: nothing new
        assert buffer.next_message() is None
        buffer.apply(CacheEvents((b"b",)))
        buffer.apply(CacheEvents((b"c",), (b"a",)))
        assert buffer.next_message() == Delta(1, CacheEvents((b"b",)))
        for name in (b"d", b"e", b"f"):  # c and d fill the queue, e overflows it
            buffer.apply(CacheEvents((name,)))
        message = buffer.next_message()
        assert isinstance(message, Snapshot) and message.seq == 5
        assert set(message.hashes) == {b"b", b"c", b"d", b"e", b"f"}
        assert buffer.next_message() is None
        buffer.apply(CacheEvents((), (b"f",)))
        assert buffer.next_message() == Delta(6, CacheEvents((), (b"f",)))
        assert buffer.stats.num_overflows == 1

    asyncio.run(scenario())


def test_a_snapshot_past_a_frames_share_goes_in_parts_and_an_empty_one_in_one() -> None:
    hashes = tuple(bytes([n]) * 16 for n in range(5))
    frames = [parse_node_message(f) for f in snapshot_frames("n1", 16, Snapshot(7, hashes), 2)]
    assert all(isinstance(f, CacheSnapshot) and f.seq == 7 for f in frames)
    parts = [f for f in frames if isinstance(f, CacheSnapshot)]
    assert [len(p.hashes) for p in parts] == [2, 2, 1]
    assert [p.more for p in parts] == [True, True, False]
    assert [bytes.fromhex(x) for p in parts for x in p.hashes] == list(hashes)
    (empty,) = [parse_node_message(f) for f in snapshot_frames("n1", 16, Snapshot(0, ()), 2)]
    assert isinstance(empty, CacheSnapshot) and empty.hashes == [] and not empty.more


def test_a_picker_url_that_is_not_one_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="picker URL"):
        NodeAgentSettings(picker_url="picker:9100")


@pytest.mark.slow
def test_a_real_engines_cache_reaches_the_index_as_the_picker_hashes_its_prompts(
    server_loop: BackgroundLoop, picker: Picker, shared_llm: AsyncEngine, tokenizer: Tokenizer
) -> None:
    """The real model in its core process: the chat's blocks, hashed by the picker's own hasher
    with the tenant's salt, are what the node's stream says it holds."""
    port = picker.start()
    node = start_node(server_loop, shared_llm, picker_url=f"http://127.0.0.1:{port}")
    messages = [
        {"role": "system", "content": "You are tenant seven's assistant; be brief. " * 8},
        {"role": "user", "content": "Which region is closest to Lisbon?"},
    ]
    try:
        with node.client() as client:
            response = client.post(
                "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2},
                headers={CACHE_SALT_HEADER: "tenant-7"},
            )
            assert response.status_code == 200, response.text
        salt = engine_cache_salt("tenant-7", None)
        hashes = PromptHasher(tokenizer, shared_llm.stats().block_size).chat_hashes(messages, salt)
        node_id = node.runtime.node_id
        assert len(hashes) >= 4
        wait_for(
            lambda: (
                server_loop.call(lambda: picker.index.cached_prefix_blocks(node_id, hashes))
                == len(hashes)
            )
        )
    finally:
        node.stop()
