"""The approximate cache view: the prefixes the picker itself sent to each node.

Until a node streams its cache events, what it holds is guessed from where the picker routed:
a prompt's blocks are taken to be on the node that was sent them (it prefilled them, and its
prefix cache keeps them until pressure evicts them). A bounded LRU stands in for that eviction.

Each pair keeps when it was last sent, for the exact view's use: a node that streams its events
reports a prompt's blocks only once it has prefilled them, seconds after the picker sent it there
under load, and meanwhile the prompt's next request should follow it (`ExactOrGuessed`).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

DEFAULT_CAPACITY = 1_000_000  # (node, block) pairs: about 100 MB at most


class RoutedPrefixes:
    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError("the routed-prefix memory needs room for at least one block")
        self._capacity = capacity
        self._clock = clock
        self._held: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # -> when last sent

    def __len__(self) -> int:
        return len(self._held)

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        return self._leading_blocks(node_id, block_hashes, since=-math.inf)

    def sent_prefix_blocks(
        self, node_id: str, block_hashes: Sequence[bytes], within_s: float
    ) -> int:
        """How many of the prompt's leading blocks were sent to `node_id` in the last `within_s`."""
        return self._leading_blocks(node_id, block_hashes, since=self._clock() - within_s)

    def _leading_blocks(self, node_id: str, block_hashes: Sequence[bytes], since: float) -> int:
        held = self._held
        for count, block_hash in enumerate(block_hashes):
            sent = held.get((node_id, block_hash))
            if sent is None or sent < since:
                return count
        return len(block_hashes)

    def record(self, node_id: str, block_hashes: Sequence[bytes]) -> None:
        """The prompt with these blocks was sent to `node_id`: it holds them now."""
        held, now = self._held, self._clock()
        # Leading blocks last, so that they are the last evicted: a chain is only as long as
        # its unbroken prefix.
        for block_hash in reversed(block_hashes):
            key = (node_id, block_hash)
            held[key] = now
            held.move_to_end(key)
        while len(held) > self._capacity:
            held.popitem(last=False)

    def forget(self, node_id: str) -> None:
        """The node left the region's routes (its cache is gone or unreachable)."""
        for key in [key for key in self._held if key[0] == node_id]:
            del self._held[key]
