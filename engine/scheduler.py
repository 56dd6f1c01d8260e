"""Continuous batching: which requests run this step, and how many of their tokens.

Every step, running requests come first (oldest first), then waiting ones are admitted while
blocks, sequence slots and the step's token budget last. A request is scheduled for as many of
its uncomputed tokens as the budget allows, so a long prompt is prefilled in chunks beside the
decodes instead of stalling them. While no running request is decoding yet (a burst of prompts
into an idle engine), a step may take up to `max_num_prefill_only_tokens` instead: no stream's
inter-token latency waits on that step, and fewer, larger steps read the weights fewer times.
A waiting request whose next uncached blocks another request fills in this step shares them at
once: every layer writes the step's keys and values to the cache before any of its attention
reads them, so the request's own tokens after those blocks attend to them in the same step. A
burst of requests with one cold system prompt computes it once, not once per request, and none
of them waits a step for it. When the pool runs dry, the newest running request is
preempted: its blocks are freed and it is recomputed later from its tokens, which gives the
same output. A request whose previous batch is still in flight (in the pipeline) waits for it:
it is neither scheduled again nor preempted until `update_after_step` has seen that batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # The token budget of a step; it bounds the inter-token latency of the decodes in it.
    max_num_batched_tokens: int = 512
    # The budget of a step while no running request has sampled a token (every one is still
    # prefilling, or none runs); None: `max_num_batched_tokens`.
    max_num_prefill_only_tokens: int | None = None

    def token_budget(self, has_decodes: bool) -> int:
        if has_decodes or self.max_num_prefill_only_tokens is None:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_num_prefill_only_tokens)


@dataclass(slots=True)
class ScheduledBatch:
    """This step's work: `num_scheduled_tokens[i]` tokens of `seqs[i]`, starting at its
    `num_computed_tokens`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Sequences that left the running set (finished, aborted, preempted) since the batch
    # before: the persistent input batch gives their rows back.
    retired: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0


class Scheduler:
    """The only owner of the KV cache manager and of the waiting and running queues."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._retired: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_uncomputed_tokens for seq in self.waiting)

    @property
    def num_running_prefill_tokens(self) -> int:
        """Prompt tokens of running sequences still to prefill (a decoding one has 1 left)."""
        return sum(n for seq in self.running if (n := seq.num_uncomputed_tokens) > 1)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self, max_batch_seqs: int | None = None) -> ScheduledBatch:
        """The next batch: at most `max_batch_seqs` sequences (default: no cap beyond
        `max_num_seqs`), so that batches in flight together can be kept even."""
        cap = max_batch_seqs or self.config.max_num_seqs
        batch = ScheduledBatch()
        # In flight or not: a decode in flight comes back for its next token soon.
        budget = self.config.token_budget(any(s.num_output_tokens for s in self.running))
        num_preemptions = self.stats.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0 and len(batch) < cap:
            seq = self.running[index]
            if seq.in_flight:
                index += 1
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._allocate_preempting(seq, num_tokens, index):
                break
            self._add_to_batch(batch, seq, num_tokens)
            budget -= num_tokens
            index += 1
        # Admitting while preempting would only thrash: the pool is already too small.
        if self.stats.num_preemptions == num_preemptions:
            self._admit_waiting(batch, budget, cap)
        if batch:  # an empty batch is not run, so nobody would see them
            batch.retired, self._retired = self._retired, []
        return batch

    def _allocate_preempting(self, seq: Sequence, num_tokens: int, index: int) -> bool:
        """Allocate `seq`'s slots (it is `running[index]`), preempting the newest running
        sequences not yet in this batch nor in flight until they fit; False if `seq` itself
        had to go."""
        while not self.kv_cache.allocate_slots(seq, num_tokens):
            victim = next(s for s in reversed(self.running[index:]) if not s.in_flight)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, num_tokens: int) -> None:
        seq.in_flight = True
        batch.seqs.append(seq)
        batch.num_scheduled_tokens.append(num_tokens)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, cap: int) -> None:
        block_size = self.kv_cache.block_size
        filling = self._blocks_filled_by(batch)
        while (
            self.waiting
            and budget > 0
            and len(batch) < cap
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            computed = self.kv_cache.get_computed_blocks(seq)
            hashes = seq.block_hashes
            while len(computed) < len(hashes) and hashes[len(computed)] in filling:
                computed.append(filling[hashes[len(computed)]])  # filled in this very step
            num_cached = len(computed) * block_size
            num_tokens = min(seq.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(seq, num_tokens, computed):
                break
            self.waiting.popleft()
            self.stats.num_prefix_queried_tokens += seq.num_tokens
            self.stats.num_prefix_hit_tokens += num_cached
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            self._add_to_batch(batch, seq, num_tokens)
            budget -= num_tokens
            filling |= self._blocks_filled_by(batch, len(batch) - 1)

    def _blocks_filled_by(self, batch: ScheduledBatch, start: int = 0) -> dict[bytes, int]:
        """Hash -> block id of the prompt blocks that the batch's sequences from `start` on
        fill in this step."""
        block_size = self.kv_cache.block_size
        filling: dict[bytes, int] = {}
        seqs, num_scheduled = batch.seqs[start:], batch.num_scheduled_tokens[start:]
        for seq, num_tokens in zip(seqs, num_scheduled, strict=True):
            first = seq.num_computed_tokens // block_size
            last = (seq.num_computed_tokens + num_tokens) // block_size
            for index, block_hash in enumerate(seq.block_hashes[first:last], first):
                filling.setdefault(block_hash, seq.block_table[index])
        return filling

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        self._retired.append(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Advance each scheduled sequence past the tokens this batch computed (one finished,
        aborted, while its batch was in flight has nothing left to advance)."""
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            seq.in_flight = False
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_tokens
            self.kv_cache.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` now and give its blocks back."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._retired.append(seq)
        else:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
