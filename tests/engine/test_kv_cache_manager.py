"""The block pool's invariants under random workloads, and its prefix-cache behaviour."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(tokens: list[int], request_id: str = "r", cache_salt: str | None = None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), max_tokens=16, cache_salt=cache_salt)


def admit(kv: KVCacheManager, seq: Sequence, num_tokens: int | None = None) -> bool:
    """What the scheduler does on admission: reuse cached prefix blocks, allocate the rest."""
    computed = kv.get_computed_blocks(seq)
    cached = len(computed) * kv.block_size
    todo = seq.num_tokens - cached if num_tokens is None else num_tokens
    if not kv.allocate_slots(seq, todo, computed):
        return False
    seq.num_computed_tokens = cached + todo
    kv.cache_full_blocks(seq)
    return True


class BlockPoolMachine(RuleBasedStateMachine):
    """Sequences arrive (with prompts from a tiny alphabet so prefixes collide), grow, and
    leave; after every step the pool's books must balance."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
        self.live: list[Sequence] = []
        self.next_id = 0
        # What a watcher of the cache's events believes it holds.
        self.mirror = set(self.kv.watch_events().stored)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit_sequence(self, prompt: list[int]) -> None:
        seq = make_seq(prompt, f"r{self.next_id}")
        self.next_id += 1
        before = self._snapshot()
        if admit(self.kv, seq):
            self.live.append(seq)
            assert len(seq.block_table) == self.kv.blocks_needed(seq.num_tokens)
        else:
            assert seq.block_table == []
            assert self._snapshot() == before, "a refused allocation must change nothing"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.kv.allocate_slots(seq, 1):
            seq.num_computed_tokens += 1
            self.kv.cache_full_blocks(seq)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.kv.free(seq)
        assert seq.block_table == []

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def _snapshot(self) -> tuple[object, ...]:
        return (
            [(b.ref_count, b.block_hash) for b in self.kv.blocks],
            list(self.kv._free),
            dict(self.kv._cached),
        )

    @invariant()
    def refcounts_match_block_tables(self) -> None:
        held = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.kv.blocks:
            assert block.ref_count == held[block.block_id]

    @invariant()
    def free_queue_holds_exactly_the_unreferenced(self) -> None:
        free = list(self.kv._free)
        assert len(free) == len(set(free))
        assert set(free) == {b.block_id for b in self.kv.blocks if b.ref_count == 0}

    @invariant()
    def no_block_twice_in_one_table(self) -> None:
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table))

    @invariant()
    def cache_index_is_consistent(self) -> None:
        for block_hash, block_id in self.kv._cached.items():
            assert self.kv.blocks[block_id].block_hash == block_hash
        hashed = [b for b in self.kv.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.kv._cached)

    @invariant()
    def events_follow_the_prefix_cache_exactly(self) -> None:
        events = self.kv.take_events()
        if events is not None:
            assert not set(events.stored) & set(events.removed)
            assert set(events.removed) <= self.mirror
            assert not set(events.stored) & self.mirror
            self.mirror = (self.mirror - set(events.removed)) | set(events.stored)
        assert self.mirror == set(self.kv._cached)

    @invariant()
    def shared_blocks_hold_the_same_tokens(self) -> None:
        content: dict[int, list[int]] = {}
        for seq in self.live:
            for index, block_id in enumerate(seq.block_table):
                start = index * BLOCK_SIZE
                tokens = seq.token_ids[start : min(start + BLOCK_SIZE, seq.num_computed_tokens)]
                if len(tokens) == BLOCK_SIZE:
                    assert content.setdefault(block_id, tokens) == tokens


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_prefix_reuses_blocks_and_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq(list(range(10)), "a")
    assert admit(kv, first)
    second = make_seq(list(range(8)) + [99, 98], "b")
    assert kv.get_computed_blocks(second) == first.block_table[:2]
    # A prompt that is entirely cached still recomputes its last block's worth.
    exact = make_seq(list(range(8)), "c")
    assert kv.get_computed_blocks(exact) == first.block_table[:1]


def test_freed_blocks_stay_cached_until_the_pool_needs_them() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq(list(range(9)), "a")
    assert admit(kv, first)
    blocks = list(first.block_table)
    kv.free(first)
    again = make_seq(list(range(9)), "b")
    assert kv.get_computed_blocks(again) == blocks[:2]
    # Allocating the whole pool to unrelated tokens evicts them, oldest-freed tail first.
    other = make_seq([7] * 16, "c")
    assert admit(kv, other)
    assert kv.get_computed_blocks(make_seq(list(range(9)), "d")) == []


def test_eviction_takes_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    old = make_seq([1] * 4 + [0], "old")
    new = make_seq([2] * 4 + [0], "new")
    assert admit(kv, old) and admit(kv, new)
    kv.free(old)
    kv.free(new)
    assert admit(kv, make_seq([3] * 8, "filler"))  # needs 2 of the 4 free blocks
    assert kv.get_computed_blocks(make_seq([1] * 4 + [5], "x")) == []
    assert len(kv.get_computed_blocks(make_seq([2] * 4 + [5], "y"))) == 1


def test_refused_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    seq = make_seq(list(range(12)), "a")
    assert not kv.allocate_slots(seq, 12)
    assert seq.block_table == [] and kv.num_free_blocks == 2


def test_double_free_is_caught() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    seq = make_seq([1, 2, 3], "a")
    assert admit(kv, seq)
    table = list(seq.block_table)
    kv.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        kv.free(seq)


def test_without_prefix_caching_nothing_is_shared() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_seq(list(range(10)), "a")
    assert admit(kv, first)
    assert kv.get_computed_blocks(make_seq(list(range(10)), "b")) == []


def test_a_salt_changes_every_block_hash_and_shares_only_with_the_same_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    tokens = list(range(13))
    salted = make_seq(tokens, "a", cache_salt="tenant-a")
    assert admit(kv, salted)
    plain = make_seq(tokens, "p")
    assert kv.get_computed_blocks(plain) == []
    assert admit(kv, plain)
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    other = make_seq(tokens, "b", cache_salt="tenant-b")
    assert kv.get_computed_blocks(other) == []
    same = make_seq(tokens, "a2", cache_salt="tenant-a")
    assert kv.get_computed_blocks(same) == salted.block_table[:3]
    assert kv.get_computed_blocks(make_seq(tokens, "p2")) == plain.block_table[:3]
