"""The exact view of the region's prefix caches: what each node's engine holds, block by block,
as its event stream says (wire/cache_events.py).

A node is known from its snapshot on; each batch after it must carry the next sequence number.
A batch out of turn means one went missing: the node becomes unknown (it holds nothing, as far
as scoring goes) until its next snapshot, which the stream's receiver then asks for
(region_picker/cache_receiver.py). Both directions are kept: node -> hashes for scoring a
prompt on a node, hash -> nodes for which nodes hold a prefix at all. `ExactOrGuessed` is the
view the picker scores with: this index for the nodes that stream, a guess for the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from region_picker.routed_prefixes import RoutedPrefixes
from wire.cache_events import CacheDelta, CacheSnapshot


@dataclass(slots=True)
class _NodeCache:
    block_size: int
    seq: int
    hashes: set[bytes] = field(default_factory=set)
    is_known: bool = True


class CacheIndex:
    def __init__(self) -> None:
        self._nodes: dict[str, _NodeCache] = {}
        self._holders: dict[bytes, set[str]] = {}

    # --- the stream's side ---

    def apply_snapshot(self, snapshot: CacheSnapshot) -> None:
        """The node holds exactly these hashes now, as of batch `snapshot.seq`."""
        node_id = snapshot.node_id
        new = {bytes.fromhex(h) for h in snapshot.hashes}
        old = self._nodes.get(node_id)
        self._remove(node_id, old.hashes - new if old is not None else set())
        self._add(node_id, new - old.hashes if old is not None else new)
        self._nodes[node_id] = _NodeCache(snapshot.block_size, snapshot.seq, new)

    def apply_delta(self, delta: CacheDelta) -> bool:
        """Apply the batch if it is the node's next; False if it cannot be (the node is unknown
        now, or was already, and needs a snapshot)."""
        node = self._nodes.get(delta.node_id)
        if node is None or not node.is_known:
            return False
        if delta.seq != node.seq + 1:
            self._forget_contents(delta.node_id, node)
            return False
        removed = {bytes.fromhex(h) for h in delta.removed}
        stored = {bytes.fromhex(h) for h in delta.stored}
        self._remove(delta.node_id, removed & node.hashes)
        node.hashes -= removed
        self._add(delta.node_id, stored - node.hashes)
        node.hashes |= stored
        node.seq = delta.seq
        return True

    def forget(self, node_id: str) -> None:
        """The node's stream ended: nothing is known of its cache any more."""
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._remove(node_id, node.hashes)

    # --- the scorer's side ---

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks the node holds (0 for a node not known)."""
        node = self._nodes.get(node_id)
        if node is None or not node.is_known:
            return 0
        held = node.hashes
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in held:
                return count
        return len(block_hashes)

    def is_known(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.is_known

    def block_size(self, node_id: str) -> int | None:
        node = self._nodes.get(node_id)
        return node.block_size if node is not None else None

    def hashes_of(self, node_id: str) -> frozenset[bytes]:
        node = self._nodes.get(node_id)
        return frozenset(node.hashes) if node is not None else frozenset()

    def nodes_holding(self, block_hash: bytes) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, ()))

    @property
    def node_ids(self) -> frozenset[str]:
        return frozenset(self._nodes)

    # --- the two directions kept in step ---

    def _forget_contents(self, node_id: str, node: _NodeCache) -> None:
        self._remove(node_id, node.hashes)
        node.hashes = set()
        node.is_known = False

    def _add(self, node_id: str, hashes: set[bytes]) -> None:
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(node_id)

    def _remove(self, node_id: str, hashes: set[bytes]) -> None:
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(node_id)
                if not holders:
                    del self._holders[block_hash]


# How long a prompt sent to a node that streams counts as cached there before its events say so:
# longer than a long prompt's wait and prefill on a busy node (15 s measured at 3 nodes under
# interleaved tenants), short beside how long a prefix stays cached once it is there.
SENT_RECENTLY_S = 30.0


class ExactOrGuessed:
    """The index's exact answer for a node it knows, or the blocks the picker sent it in the
    last SENT_RECENTLY_S where more: a prompt being prefilled (or whose events are on the way)
    draws the same prefix's next request to it, instead of a second cold prefill elsewhere. The
    routed guess (the approximate view) for a node that does not stream, or whose snapshot is
    awaited."""

    def __init__(self, index: CacheIndex, routed: RoutedPrefixes) -> None:
        self._index = index
        self._routed = routed

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        if not self._index.is_known(node_id):
            return self._routed.cached_prefix_blocks(node_id, block_hashes)
        exact = self._index.cached_prefix_blocks(node_id, block_hashes)
        if exact == len(block_hashes):
            return exact
        return max(exact, self._routed.sent_prefix_blocks(node_id, block_hashes, SENT_RECENTLY_S))
