"""The approximate cache view: the prefixes the picker itself sent to each node.

Until a node streams its cache events, what it holds is guessed from where the picker routed:
a prompt's blocks are taken to be on the node that was sent them (it prefilled them, and its
prefix cache keeps them until pressure evicts them). A bounded LRU stands in for that eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 1_000_000  # (node, block) pairs: about 100 MB at most


class RoutedPrefixes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("the routed-prefix memory needs room for at least one block")
        self._capacity = capacity
        self._held: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        held = self._held
        for count, block_hash in enumerate(block_hashes):
            if (node_id, block_hash) not in held:
                return count
        return len(block_hashes)

    def record(self, node_id: str, block_hashes: Sequence[bytes]) -> None:
        """The prompt with these blocks was sent to `node_id`: it holds them now."""
        held = self._held
        # Leading blocks last, so that they are the last evicted: a chain is only as long as
        # its unbroken prefix.
        for block_hash in reversed(block_hashes):
            key = (node_id, block_hash)
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._capacity:
            held.popitem(last=False)

    def forget(self, node_id: str) -> None:
        """The node left the region's routes (its cache is gone or unreachable)."""
        for key in [key for key in self._held if key[0] == node_id]:
            del self._held[key]
