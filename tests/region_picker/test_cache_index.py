"""The exact cache index: snapshots replace, batches apply in turn, a batch out of turn makes the
node unknown until its next snapshot; both directions (node -> hashes, hash -> nodes) agree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from region_picker.cache_index import SENT_RECENTLY_S, CacheIndex, ExactOrGuessed
from region_picker.routed_prefixes import RoutedPrefixes
from wire.cache_events import CacheDelta, CacheSnapshot, parse_node_message, stream_url


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def snapshot(node: str, seq: int, *hashes: int) -> CacheSnapshot:
    return CacheSnapshot(node_id=node, block_size=16, seq=seq, hashes=[h(x).hex() for x in hashes])


def delta(
    node: str, seq: int, stored: tuple[int, ...] = (), removed: tuple[int, ...] = ()
) -> CacheDelta:
    return CacheDelta(
        node_id=node,
        seq=seq,
        stored=[h(x).hex() for x in stored],
        removed=[h(x).hex() for x in removed],
    )


def test_batches_in_turn_follow_the_snapshot() -> None:
    index = CacheIndex()
    index.apply_snapshot(snapshot("a", 4, 1, 2, 3))
    assert index.apply_delta(delta("a", 5, stored=(4,), removed=(3,)))
    assert index.apply_delta(delta("a", 6, stored=(3,)))
    assert index.hashes_of("a") == {h(1), h(2), h(3), h(4)}
    assert index.block_size("a") == 16 and index.is_known("a")


def test_the_prefix_count_stops_at_the_first_block_not_held() -> None:
    index = CacheIndex()
    index.apply_snapshot(snapshot("a", 0, 1, 2, 4))
    assert index.cached_prefix_blocks("a", [h(1), h(2), h(3), h(4)]) == 2
    assert index.cached_prefix_blocks("a", [h(1), h(2)]) == 2
    assert index.cached_prefix_blocks("a", [h(9), h(1)]) == 0
    assert index.cached_prefix_blocks("a", []) == 0
    assert index.cached_prefix_blocks("nobody", [h(1)]) == 0


def test_a_batch_out_of_turn_makes_the_node_unknown_until_its_snapshot() -> None:
    index = CacheIndex()
    index.apply_snapshot(snapshot("a", 1, 1, 2))
    index.apply_snapshot(snapshot("b", 0, 2))
    assert not index.apply_delta(delta("a", 3, stored=(5,)))  # batch 2 is missing
    assert not index.is_known("a")
    assert index.cached_prefix_blocks("a", [h(1)]) == 0
    assert index.nodes_holding(h(2)) == {"b"}
    assert not index.apply_delta(delta("a", 4, stored=(6,)))  # still waiting for the snapshot
    index.apply_snapshot(snapshot("a", 4, 1, 5, 6))
    assert index.is_known("a") and index.cached_prefix_blocks("a", [h(1), h(5)]) == 2
    assert index.apply_delta(delta("a", 5, removed=(1,)))
    assert index.hashes_of("a") == {h(5), h(6)}


def test_a_batch_before_any_snapshot_cannot_apply() -> None:
    assert not CacheIndex().apply_delta(delta("a", 1, stored=(1,)))


def test_hash_to_nodes_agrees_with_node_to_hashes() -> None:
    index = CacheIndex()
    index.apply_snapshot(snapshot("a", 0, 1, 2))
    index.apply_snapshot(snapshot("b", 0, 2, 3))
    assert index.nodes_holding(h(2)) == {"a", "b"}
    index.apply_snapshot(snapshot("a", 7, 3))  # a snapshot replaces what was known
    assert index.nodes_holding(h(1)) == frozenset()
    assert index.nodes_holding(h(2)) == {"b"}
    assert index.nodes_holding(h(3)) == {"a", "b"}
    index.forget("b")
    assert index.nodes_holding(h(3)) == {"a"} and index.node_ids == {"a"}
    assert index.hashes_of("b") == frozenset() and index.block_size("b") is None


def test_messages_are_checked_at_the_boundary() -> None:
    ok = parse_node_message(snapshot("a", 0, 1).model_dump_json())
    assert isinstance(ok, CacheSnapshot)
    for bad in (
        '{"kind": "delta", "node_id": "a", "seq": 0}',  # batches count from 1
        '{"kind": "delta", "node_id": "a", "seq": 1, "stored": ["zz"]}',
        '{"kind": "snapshot", "node_id": "A B", "seq": 0, "block_size": 16, "hashes": []}',
        '{"kind": "resync", "reason": "only the picker sends this"}',
        '{"kind": "snapshot", "schema_version": 2, "node_id": "a", "seq": 0, "block_size": 1, '
        '"hashes": []}',
    ):
        with pytest.raises(ValidationError):
            parse_node_message(bad)


def test_the_stream_url_comes_from_the_pickers_address() -> None:
    assert stream_url("http://10.0.0.5:9100") == "ws://10.0.0.5:9100/v1/cache-events"
    assert stream_url("https://picker:443/") == "wss://picker:443/v1/cache-events"
    assert stream_url("ws://p:1/v1/cache-events") == "ws://p:1/v1/cache-events"
    with pytest.raises(ValueError, match="picker URL"):
        stream_url("picker:9100")


def test_the_pickers_view_is_exact_where_a_node_streams_and_guessed_elsewhere() -> None:
    now = [0.0]
    index, routed = CacheIndex(), RoutedPrefixes(clock=lambda: now[0])
    routed.record("a", [h(1), h(2)])  # sent there, but its stream says it evicted 2
    routed.record("b", [h(1), h(2)])
    index.apply_snapshot(snapshot("a", 0, 1))
    view = ExactOrGuessed(index, routed)
    now[0] = SENT_RECENTLY_S + 1
    assert view.cached_prefix_blocks("a", [h(1), h(2)]) == 1
    assert view.cached_prefix_blocks("b", [h(1), h(2)]) == 2  # no stream: the guess
    index.apply_delta(delta("a", 2))  # a gap: "a" is unknown until its snapshot
    assert view.cached_prefix_blocks("a", [h(1), h(2)]) == 2


def test_a_prompt_just_sent_to_a_streaming_node_counts_as_cached_there_until_it_is_late() -> None:
    """Its events come only once the node has prefilled it (seconds, under load): meanwhile the
    same prefix's next request is drawn to it, not to a second cold prefill elsewhere."""
    now = [100.0]
    index, routed = CacheIndex(), RoutedPrefixes(clock=lambda: now[0])
    index.apply_snapshot(snapshot("a", 0, 1))
    index.apply_snapshot(snapshot("b", 0))
    view = ExactOrGuessed(index, routed)
    prompt = [h(1), h(2), h(3)]
    routed.record("b", prompt[:2])
    assert view.cached_prefix_blocks("b", prompt) == 2  # sent, not yet reported
    assert view.cached_prefix_blocks("a", prompt) == 1  # its stream's answer, nothing sent
    now[0] += SENT_RECENTLY_S - 1
    assert view.cached_prefix_blocks("b", prompt) == 2
    now[0] += 2  # its events never said so: the stream is the truth again
    assert view.cached_prefix_blocks("b", prompt) == 0
    index.apply_delta(delta("b", 1, stored=(1, 2, 3)))
    assert view.cached_prefix_blocks("b", prompt) == 3
