"""The picker's listener for cache event streams, spoken to by raw websocket clients on
loopback: it feeds the index, answers a batch out of turn with one resync, lets a reconnected
node's new stream take over, holds a node whose stream broke out of the picker's choices until it
streams again, and refuses what is not the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from region_picker.cache_index import CacheIndex
from region_picker.cache_receiver import CacheEventReceiver
from region_picker.node_book import NodeBook
from region_picker.node_streams import NodeStreams
from wire.cache_events import (
    CACHE_EVENTS_PATH,
    MAX_SNAPSHOT_PARTS,
    CacheDelta,
    CacheResync,
    CacheSnapshot,
)
from wire.region_nodes import NodeLoad, RegionNodes

Scenario = Callable[[CacheIndex, CacheEventReceiver, str], Awaitable[None]]


def h(n: int) -> str:
    return n.to_bytes(16, "big").hex()


def snapshot(seq: int, *hashes: int, node: str = "n1", more: bool = False) -> str:
    message = CacheSnapshot(
        node_id=node, block_size=16, seq=seq, hashes=[h(x) for x in hashes], more=more
    )
    return message.model_dump_json()


def delta(seq: int, *stored: int, node: str = "n1") -> str:
    return CacheDelta(node_id=node, seq=seq, stored=[h(x) for x in stored]).model_dump_json()


def run(scenario: Scenario, streams: NodeStreams | None = None, token: str | None = None) -> None:
    async def main() -> None:
        index = CacheIndex()
        receiver = CacheEventReceiver(index, streams or NodeStreams(), token)
        server = await receiver.serve("127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await scenario(index, receiver, f"ws://127.0.0.1:{port}")
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not come true in time")


async def resync_of(socket: ClientConnection) -> CacheResync:
    return CacheResync.model_validate_json(await asyncio.wait_for(socket.recv(), 5.0))


def test_a_gap_is_answered_once_with_a_resync_and_the_snapshot_repairs() -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        async with connect(url + CACHE_EVENTS_PATH) as socket:
            await socket.send(snapshot(0, 1))
            await socket.send(delta(1, 2))
            await until(lambda: index.hashes_of("n1") == {bytes.fromhex(h(1)), bytes.fromhex(h(2))})
            await socket.send(delta(3, 4))  # batch 2 never came
            assert "batch 3" in (await resync_of(socket)).reason
            await socket.send(delta(4, 5))  # no second resync while the snapshot is on its way
            await socket.send(snapshot(4, 1, 2, 4, 5))
            await socket.send(delta(5, 6))
            await until(lambda: index.cached_prefix_blocks("n1", [bytes.fromhex(h(6))]) == 1)
            assert receiver.stats.num_gaps == 1 and receiver.stats.num_snapshots == 2
        await until(lambda: "n1" not in index.node_ids)  # its stream ended

    run(scenario)


def test_a_snapshot_in_parts_is_applied_whole_when_its_last_part_comes() -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        async with connect(url + CACHE_EVENTS_PATH) as socket:
            await socket.send(snapshot(0, 9))
            await until(lambda: index.hashes_of("n1") == {bytes.fromhex(h(9))})
            await socket.send(snapshot(3, 1, 2, more=True))
            await socket.send(snapshot(3, 3, more=True))
            await asyncio.sleep(0.05)  # parts alone change nothing
            assert index.hashes_of("n1") == {bytes.fromhex(h(9))}
            await socket.send(snapshot(3, 4))
            await socket.send(delta(4, 5))  # the snapshot was as of batch 3
            await until(lambda: len(index.hashes_of("n1")) == 5)
            assert index.hashes_of("n1") == {bytes.fromhex(h(n)) for n in (1, 2, 3, 4, 5)}
            assert receiver.stats.num_snapshots == 2 and receiver.stats.num_gaps == 0

    run(scenario)


def test_a_reconnected_node_takes_over_and_the_old_streams_end_forgets_nothing() -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        async with connect(url + CACHE_EVENTS_PATH) as old:
            await old.send(snapshot(0, 1))
            async with connect(url + CACHE_EVENTS_PATH) as new:
                await new.send(snapshot(0, 7))
                await until(lambda: index.hashes_of("n1") == {bytes.fromhex(h(7))})
                await old.send(delta(1, 2))  # the old stream's batch: not the node's stream now
                assert "out of turn" in (await resync_of(old)).reason
                await old.close()
                await new.send(delta(1, 8))
                await until(lambda: len(index.hashes_of("n1")) == 2)
                assert index.hashes_of("n1") == {bytes.fromhex(h(7)), bytes.fromhex(h(8))}

    run(scenario)


def node_load(node_id: str) -> NodeLoad:
    return NodeLoad(
        node_id=node_id,
        url="http://127.0.0.1:9001",
        model="m",
        block_size=16,
        kv_blocks_total=8,
        kv_blocks_free=8,
    )


def test_a_node_whose_stream_broke_is_held_out_until_it_streams_again() -> None:
    streams = NodeStreams()
    book = NodeBook(streams)
    load = node_load("n1")
    book.adopt(RegionNodes(index=1, region="r", nodes=(load,)))

    def picked() -> list[str]:
        return [candidate.node_id for candidate in book.candidates("m")]

    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        async with connect(url + CACHE_EVENTS_PATH) as socket:
            await socket.send(snapshot(0, 1))
            await until(lambda: "n1" in index.node_ids)
            assert picked() == ["n1"]
        await until(lambda: picked() == [])  # the node's socket closed: likely dead
        async with connect(url + CACHE_EVENTS_PATH) as socket:
            await socket.send(snapshot(0))
            await until(lambda: picked() == ["n1"])

    run(scenario, streams)


def test_a_held_out_node_comes_back_after_the_hold_or_when_the_control_plane_drops_it() -> None:
    now = [100.0]
    streams = NodeStreams(hold_out_s=10.0, clock=lambda: now[0])
    streams.lost("n1")
    now[0] += 9.9
    assert streams.is_held_out("n1")
    now[0] += 0.2
    assert not streams.is_held_out("n1")  # alive but not streaming: picked, its cache guessed
    streams.lost("n2")
    book = NodeBook(streams)
    book.adopt(RegionNodes(index=1, region="r", nodes=()))  # n2 was never listed: nothing to drop
    assert streams.is_held_out("n2")
    load = node_load("n2")
    book.adopt(RegionNodes(index=2, region="r", nodes=(load,)))
    book.adopt(RegionNodes(index=3, region="r", nodes=()))  # dropped: a later return starts clean
    assert not streams.is_held_out("n2")


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (["not json"], 1007),
        ([delta(1, 1).replace('"n1"', '"N 1"')], 1007),
        ([snapshot(0, 1), snapshot(0, 1, node="n2")], 1008),  # one stream carries one node
        ([snapshot(0, 1, more=True), delta(1, 2)], 1008),  # a batch amid a snapshot's parts
        ([snapshot(0, 1, more=True), snapshot(1, 2)], 1008),  # a part of another snapshot
        ([snapshot(0, n, more=True) for n in range(MAX_SNAPSHOT_PARTS)], 1008),  # no last part
    ],
)
def test_a_stream_that_breaks_the_protocol_is_closed(frames: list[str], code: int) -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        async with connect(url + CACHE_EVENTS_PATH) as socket:
            for frame in frames:
                await socket.send(frame)
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(socket.recv(), 5.0)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == code
        await until(lambda: not index.node_ids)

    run(scenario)


def test_only_the_streams_path_is_served() -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url + "/elsewhere"):
                pass
        assert refused.value.response.status_code == 404

    run(scenario)


def test_with_a_token_only_a_stream_that_presents_it_is_taken() -> None:
    async def scenario(index: CacheIndex, receiver: CacheEventReceiver, url: str) -> None:
        for headers in ({}, {"Authorization": "Bearer forged"}, {"Authorization": "secret"}):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url + CACHE_EVENTS_PATH, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
        assert (receiver.stats.num_connections, receiver.stats.num_refused) == (0, 3)
        headers = {"Authorization": "Bearer secret"}
        async with connect(url + CACHE_EVENTS_PATH, additional_headers=headers) as socket:
            await socket.send(snapshot(0, 1, 2))
            await until(lambda: index.hashes_of("n1") == {bytes.fromhex(h(1)), bytes.fromhex(h(2))})

    run(scenario, token="secret")
