"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, refcounts, and the prefix cache.

Blocks whose refcount drops to zero go to the tail of a free queue but keep their contents and
hash, so the free queue doubles as the prefix cache: allocation takes from the head (least
recently used) and only then forgets what the block held. Once watched, it records each hash
that enters or leaves the prefix cache (engine/cache_events.py); until then it records nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.cache_events import CacheEventRecorder, CacheEvents
from engine.sequence import Sequence


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Set while the block is the prefix cache's copy of a full block of tokens.
    block_hash: bytes | None = None


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """A full block's identity: its tokens and, through the parent's hash, every token before."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_root(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: nothing, or a digest of its salt, so that the
    whole hash chain of a salted request differs from any other salt's."""
    if cache_salt is None:
        return b""
    salt = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(salt, digest_size=16, person=b"meridian-salt").digest()


class KVCacheManager:
    """Owns the block pool. Only the scheduler calls it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._events: CacheEventRecorder | None = None

    def watch_events(self) -> CacheEvents:
        """Start recording the prefix cache's changes (again: from now on only); returns what it
        holds now, which those changes follow."""
        self._events = CacheEventRecorder()
        return CacheEvents(tuple(self._cached), is_snapshot=True)

    def take_events(self) -> CacheEvents | None:
        """The changes since the last call (None: none, or nobody watches)."""
        return self._events.take() if self._events is not None else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold a prefix of `seq`, longest first match.

        At least the last token is left to compute: its logits are what the request needs next.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:num_full]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()
    ) -> bool:
        """Give `seq` blocks for `computed_blocks` plus `num_new_tokens` more tokens.

        Returns False, changing nothing, when the pool cannot hold them: the caller preempts.
        """
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens += num_new_tokens
        num_new_blocks = (
            self.blocks_needed(num_tokens) - len(seq.block_table) - len(computed_blocks)
        )
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - num_revived:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that `seq` has filled since the last call to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        for index in range(num_full):
            block = self.blocks[seq.block_table[index]]
            block_hash = seq.block_hashes[index]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                if self._events is not None:
                    self._events.stored(block_hash)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Its last blocks are queued first, so they are evicted first:
        a later request is likelier to share a sequence's head than its tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
            self.blocks[block_id].block_hash = None
            if self._events is not None:
                self._events.removed(block_hash)
        self._cached.clear()

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self._events is not None:
                self._events.removed(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        for index in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[index - 1] if index else chain_root(seq.cache_salt)
            tokens = seq.token_ids[index * bs : (index + 1) * bs]
            seq.block_hashes.append(hash_block(parent, tokens))
