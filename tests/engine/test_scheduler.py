"""Continuous batching decisions, on real block pools with exact numbers."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16
) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget), KVCacheManager(num_blocks, block_size))


def seq(request_id: str, num_prompt: int, first_token: int = 0) -> Sequence:
    tokens = list(range(first_token, first_token + num_prompt))
    return Sequence(request_id, tokens, SamplingParams(), max_tokens=100)


def run_step(scheduler: Scheduler, next_token: int = 7) -> ScheduledBatch:
    """What the engine does around the model: schedule, advance, append sampled tokens."""
    batch = scheduler.schedule()
    scheduler.update_after_step(batch)
    for s in batch.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(next_token)
    return batch


def scheduled(batch: ScheduledBatch) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)}


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add(seq("a", 40))
    assert [scheduled(run_step(scheduler)) for _ in range(3)] == [{"a": 16}, {"a": 16}, {"a": 8}]
    assert scheduler.running[0].num_output_tokens == 1  # sampled only at the end of the prompt


def test_prompt_tokens_still_to_prefill_are_counted_waiting_and_running() -> None:
    scheduler = make_scheduler(max_num_seqs=1, budget=16)
    scheduler.add(seq("a", 40))
    scheduler.add(seq("b", 10, first_token=100))
    run_step(scheduler)  # a: 16 of 40 computed; b waits for the slot
    assert (scheduler.num_running_prefill_tokens, scheduler.num_waiting_tokens) == (24, 10)
    run_step(scheduler)
    run_step(scheduler)  # a prefilled: one token to decode is no prefill
    assert (scheduler.num_running_prefill_tokens, scheduler.num_waiting_tokens) == (0, 10)


def test_decodes_go_first_and_a_new_prompt_gets_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add(seq("a", 4))
    run_step(scheduler)
    scheduler.add(seq("b", 40, first_token=100))
    assert scheduled(run_step(scheduler)) == {"a": 1, "b": 15}
    assert scheduled(run_step(scheduler)) == {"a": 1, "b": 15}


def test_admission_stops_at_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        scheduler.add(seq(f"r{i}", 4, first_token=10 * i))
    assert set(scheduled(run_step(scheduler))) == {"r0", "r1"}
    assert [s.request_id for s in scheduler.waiting] == ["r2"]


def test_pool_exhaustion_preempts_the_newest_and_frees_its_blocks() -> None:
    # 4 blocks of 4 tokens: two 8-token prompts take 2 blocks each; the next decode of the
    # oldest needs a fifth block, so the newest is preempted and waits at the head of the queue.
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=100)
    scheduler.add(seq("old", 8))
    scheduler.add(seq("new", 8, first_token=50))
    run_step(scheduler)  # both prefilled, each sampled its 9th token
    batch = run_step(scheduler)  # "old" needs a third block for its 9th token
    assert scheduled(batch) == {"old": 1}
    new = scheduler.waiting[0]
    assert new.request_id == "new" and new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.token_ids[-1] == 7, "its generated token is kept and recomputed later"
    assert scheduler.stats.num_preemptions == 1
    assert batch.retired == [new], "its input-batch row is given back with this batch"


def test_preempted_request_resumes_with_its_prefix_from_the_cache() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=100)
    scheduler.add(seq("old", 8))
    scheduler.add(seq("new", 8, first_token=50))
    run_step(scheduler)
    run_step(scheduler)  # "new" preempted; "old" took the block freed from its tail
    old = scheduler.running[0]
    scheduler.finish(old, "stop")
    assert scheduler.kv_cache.num_free_blocks == 4
    batch = run_step(scheduler)
    # "new" (9 tokens) re-admits with its first block still cached: 5 tokens are recomputed.
    assert scheduled(batch) == {"new": 5}
    assert scheduler.running[0].num_cached_tokens == 4


def test_finish_returns_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add(seq("a", 10))
    run_step(scheduler)
    a = scheduler.running[0]
    assert scheduler.kv_cache.num_free_blocks == 8 - 3
    scheduler.finish(a, "abort")
    assert scheduler.kv_cache.num_free_blocks == 8 and a.is_finished and not scheduler.running


def test_a_batch_in_flight_keeps_its_sequences_out_of_the_next_batch() -> None:
    # A pipeline's view: batch A is submitted, and the next batch is scheduled before A's
    # result comes back. Capped at 2 sequences each, the batches are even and disjoint.
    scheduler = make_scheduler(budget=100)
    for i in range(4):
        scheduler.add(seq(f"r{i}", 4, first_token=10 * i))
    first = scheduler.schedule(max_batch_seqs=2)
    second = scheduler.schedule(max_batch_seqs=2)
    assert scheduled(first) == {"r0": 4, "r1": 4} and scheduled(second) == {"r2": 4, "r3": 4}
    assert not scheduler.schedule(max_batch_seqs=2)  # all four are in flight
    scheduler.update_after_step(first)
    for s in first.seqs:
        s.token_ids.append(7)
    assert scheduled(scheduler.schedule(max_batch_seqs=2)) == {"r0": 1, "r1": 1}


def test_a_sequence_in_flight_is_never_preempted() -> None:
    # 4 blocks: "new" is in flight when "old" needs a third block; "new" cannot be preempted,
    # so "old" gives way itself, and "new" keeps its blocks.
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=100)
    scheduler.add(seq("old", 8))
    scheduler.add(seq("new", 8, first_token=50))
    run_step(scheduler)
    old, new = scheduler.running
    new.in_flight = True
    assert not scheduler.schedule()
    assert old.status is SequenceStatus.WAITING and old.num_preemptions == 1
    assert new.status is SequenceStatus.RUNNING and len(new.block_table) == 2


def test_a_sequence_aborted_in_flight_is_not_advanced() -> None:
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add(seq("a", 10))
    batch = scheduler.schedule()
    a = batch.seqs[0]
    scheduler.finish(a, "abort")
    scheduler.update_after_step(batch)  # the batch's result arrives after the abort
    assert a.num_computed_tokens == 0 and not a.in_flight
    assert scheduler.kv_cache.num_free_blocks == 8


def test_steps_without_decodes_take_the_prefill_only_budget() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, max_num_batched_tokens=16, max_num_prefill_only_tokens=40),
        KVCacheManager(64, 4),
    )
    for i in range(4):
        scheduler.add(seq(f"p{i}", 24, first_token=100 * i))
    # Nothing decodes yet: 40 tokens (p0 whole, 16 of p1); then p0 decodes, so 16 again.
    assert scheduled(run_step(scheduler)) == {"p0": 24, "p1": 16}
    assert scheduled(run_step(scheduler)) == {"p0": 1, "p1": 8, "p2": 7}
    assert scheduled(run_step(scheduler)) == {"p0": 1, "p1": 1, "p2": 14}


def test_a_prefill_only_budget_below_the_step_budget_changes_nothing() -> None:
    config = SchedulerConfig(8, max_num_batched_tokens=16, max_num_prefill_only_tokens=4)
    assert config.token_budget(has_decodes=False) == config.token_budget(has_decodes=True) == 16
    assert SchedulerConfig(8, 16).token_budget(has_decodes=False) == 16


def test_retired_sequences_ride_with_the_next_batch_that_runs() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=16)
    a, b = seq("a", 4), seq("b", 4, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    assert run_step(scheduler).retired == []
    scheduler.finish(a, "abort")
    assert scheduler.schedule().retired == [a]  # b decodes into its second block
    scheduler.update_after_step(ScheduledBatch([b], [1]))
    b.token_ids.append(7)
    c = seq("c", 3, first_token=200)
    scheduler.add(c)
    scheduler.finish(c, "abort")  # never ran: holds no row
    scheduler.finish(b, "stop")
    assert not scheduler.schedule(), "nothing left to run"
    d = seq("d", 4, first_token=300)
    scheduler.add(d)
    assert scheduler.schedule().retired == [b], "kept until a batch runs"


def test_a_request_shares_the_blocks_another_fills_in_the_same_step() -> None:
    scheduler = make_scheduler(budget=64)
    scheduler.add(seq("a", 10))  # blocks of 4: its first two are full
    scheduler.add(seq("b", 10))  # the same prompt
    scheduler.add(seq("c", 10, first_token=100))
    first = run_step(scheduler)
    assert scheduled(first) == {"a": 10, "b": 2, "c": 10}  # b computes only its partial block
    a, b, _ = first.seqs
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8  # the two blocks `a` fills, not computed again
    assert scheduler.stats.num_prefix_hit_tokens == 8
    assert all(s.num_output_tokens == 1 for s in first.seqs)  # every prompt done in one step


def test_a_shared_block_aligned_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler(budget=64)
    scheduler.add(seq("a", 8))  # exactly two blocks of 4
    scheduler.add(seq("b", 8))  # the same prompt: its last token's logits are still needed
    first = run_step(scheduler)
    assert scheduled(first) == {"a": 8, "b": 4}
    a, b = first.seqs
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_output_tokens == 1


def test_requests_share_no_block_in_a_step_without_prefix_caching() -> None:
    config = SchedulerConfig(8, 64)
    scheduler = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=False))
    scheduler.add(seq("a", 10))
    scheduler.add(seq("b", 10))
    assert scheduled(run_step(scheduler)) == {"a": 10, "b": 10}


def test_a_chunked_shared_prefix_is_computed_once() -> None:
    scheduler = make_scheduler(budget=12)
    scheduler.add(seq("a", 20))
    scheduler.add(seq("b", 20))  # the same prompt, in blocks of 4
    assert scheduled(run_step(scheduler)) == {"a": 12}  # blocks 0-2, the budget spent
    # a's second chunk fills block 3; b takes its hits on blocks 0-2 and shares block 3.
    second = run_step(scheduler)
    assert scheduled(second) == {"a": 8, "b": 4}
    a, b = second.seqs
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
