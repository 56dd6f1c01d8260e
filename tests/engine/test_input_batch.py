"""The persistent input batch: rows kept across steps give the tensors the one-off build gives.

The known-answer test drives a real scheduler over a small pool through random histories
(arrivals, aborts, chunked prefills, prefix-cache hits, preemptions, two batches in flight) and
compares every step's tensors with `build_step_inputs` over the same sequences.
"""

from __future__ import annotations

import copy
import random
from collections import deque

import numpy as np
import pytest
import torch

from engine.input_batch import InputBatch
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import StepInputs, build_step_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence

BLOCK_SIZE = 4


def assert_same_inputs(expected: StepInputs, actual: StepInputs) -> None:
    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)

    same(expected.input_ids, actual.input_ids)
    same(expected.positions, actual.positions)
    same(expected.logits_rows, actual.logits_rows)
    e, a = expected.meta, actual.meta
    same(e.slot_mapping, a.slot_mapping)
    assert e.num_decode_tokens == a.num_decode_tokens
    same(e.decode_context_lens, a.decode_context_lens)
    if e.num_decode_tokens:  # an empty table's shape is read by nothing
        same(e.decode_block_tables, a.decode_block_tables)
    same(e.decode_mask, a.decode_mask)
    assert len(e.prefills) == len(a.prefills)
    for ec, ac in zip(e.prefills, a.prefills, strict=True):
        assert (ec.start, ec.num_tokens, ec.num_context_tokens) == (
            ac.start,
            ac.num_tokens,
            ac.num_context_tokens,
        )
        same(ec.block_ids, ac.block_ids)
        same(ec.mask, ac.mask)


def prepare_both(rows: InputBatch, batch: ScheduledBatch, use_decode_kernel: bool) -> StepInputs:
    """The persistent batch's inputs for `batch`, checked against the one-off build's."""
    expected, expected_seqs = build_step_inputs(batch, BLOCK_SIZE, use_decode_kernel)
    actual, actual_seqs = rows.prepare(batch)
    assert_same_inputs(expected, actual)
    assert len(actual_seqs) == len(expected_seqs)
    assert all(a is b for a, b in zip(actual_seqs, expected_seqs, strict=True))
    return actual


@pytest.mark.parametrize("use_decode_kernel", [True, False])
@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_random_histories_give_the_tensors_of_the_one_off_build(
    seed: int, pipeline_depth: int, use_decode_kernel: bool
) -> None:
    rng = random.Random(seed)
    max_num_seqs = 6
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens=20, max_num_prefill_only_tokens=40),
        KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE),
    )
    rows = InputBatch(max_num_seqs, 128, BLOCK_SIZE, use_decode_kernel)
    shared_prefix = [rng.randrange(3, 90) for _ in range(12)]
    # Each batch in flight with its inputs and a copy of them taken when they were made.
    in_flight: deque[tuple[ScheduledBatch, StepInputs, StepInputs]] = deque()
    num_requests = 0
    for _ in range(300):
        if num_requests < 40 and rng.random() < 0.3:
            head = shared_prefix[: rng.randrange(13)]
            prompt = head + [rng.randrange(3, 90) for _ in range(rng.randrange(1, 25))]
            max_tokens = rng.randrange(1, 20)
            scheduler.add(Sequence(f"r{num_requests}", prompt, SamplingParams(), max_tokens))
            num_requests += 1
        if scheduler.running and rng.random() < 0.04:
            scheduler.finish(rng.choice(scheduler.running), "abort")
        if len(in_flight) < pipeline_depth:
            batch = scheduler.schedule(-(-scheduler.num_unfinished // pipeline_depth))
            if batch:
                inputs = prepare_both(rows, batch, use_decode_kernel)
                assert rows.num_rows == len(scheduler.running), "a row per running sequence"
                in_flight.append((batch, inputs, copy.deepcopy(inputs)))
                if len(in_flight) < pipeline_depth:
                    continue
        if not in_flight:
            continue
        batch, inputs, made = in_flight.popleft()
        assert_same_inputs(made, inputs)  # later steps moved the rows, not these tensors
        scheduler.update_after_step(batch)
        for seq in batch.seqs:
            if not seq.is_finished and seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(3, 90))
                if seq.num_output_tokens >= seq.max_tokens:
                    scheduler.finish(seq, "length")
    assert num_requests >= 30
    assert scheduler.stats.num_preemptions > 0, "the history should preempt"
    assert scheduler.stats.num_prefix_hit_tokens > 0, "and hit the prefix cache"


def make_seq(request_id: str, num_prompt: int, block_table: list[int]) -> Sequence:
    seq = Sequence(request_id, list(range(3, 3 + num_prompt)), SamplingParams(), max_tokens=64)
    seq.block_table = block_table
    return seq


def decode(rows: InputBatch, seqs: list[Sequence], retired: tuple[Sequence, ...] = ()) -> None:
    """One decode step of `seqs` (each has sampled the token it decodes), then advance them."""
    prepare_both(rows, ScheduledBatch(seqs, [1] * len(seqs), list(retired)), True)
    for seq in seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)


def test_a_row_takes_in_only_the_blocks_its_steps_reach() -> None:
    rows = InputBatch(4, 64, BLOCK_SIZE, use_decode_kernel=True)
    seq = make_seq("a", 6, [5, 9, 2])  # a third block allocated ahead of need
    prepare_both(rows, ScheduledBatch([seq], [6]), True)
    seq.num_computed_tokens, seq.token_ids = 6, [*seq.token_ids, 7]
    assert rows.block_tables[0, :3].tolist() == [5, 9, 0]
    decode(rows, [seq])  # position 6: still the second block
    assert rows.block_tables[0, :3].tolist() == [5, 9, 0]
    decode(rows, [seq])  # position 7
    decode(rows, [seq])  # position 8 opens the third block
    assert rows.block_tables[0, :4].tolist() == [5, 9, 2, 0]


def test_a_retired_sequence_gives_back_a_zeroed_row_that_the_next_one_takes() -> None:
    rows = InputBatch(4, 64, BLOCK_SIZE, use_decode_kernel=True)
    a, b = make_seq("a", 9, [1, 2, 3]), make_seq("b", 2, [4])
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens - 1
    decode(rows, [a, b])
    assert rows.num_rows == 2 and rows.block_tables[0, :3].tolist() == [1, 2, 3]
    c = make_seq("c", 2, [6])
    c.num_computed_tokens = 1
    decode(rows, [b, c], retired=(a,))
    assert rows.num_rows == 2
    assert rows.block_tables[0, :3].tolist() == [6, 0, 0], "c took a's row, zeroed past c's blocks"
    assert rows.block_tables[1, :1].tolist() == [4]


def test_a_preempted_sequence_comes_back_with_its_new_blocks() -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fit, their decodes into the next blocks do not.
    scheduler = Scheduler(SchedulerConfig(4, 32), KVCacheManager(4, BLOCK_SIZE, False))
    rows = InputBatch(4, 64, BLOCK_SIZE, use_decode_kernel=True)
    a = Sequence("a", list(range(3, 10)), SamplingParams(), max_tokens=8)
    b = Sequence("b", list(range(20, 27)), SamplingParams(), max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    seen_preemption = False
    for _ in range(30):
        batch = scheduler.schedule()
        if not batch:
            break
        seen_preemption |= any(s is b for s in batch.retired)
        prepare_both(rows, batch, True)
        assert rows.num_rows == len(scheduler.running)
        scheduler.update_after_step(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(11)
                if seq.num_output_tokens == seq.max_tokens:
                    scheduler.finish(seq, "length")
    assert seen_preemption and b.num_preemptions > 0
    assert a.is_finished and b.is_finished


def test_a_request_id_used_again_by_a_new_request_gets_a_fresh_row() -> None:
    rows = InputBatch(2, 64, BLOCK_SIZE, use_decode_kernel=True)
    old = make_seq("x", 9, [1, 2, 3])
    old.num_computed_tokens = 8
    decode(rows, [old])
    new = make_seq("x", 2, [5])
    new.num_computed_tokens = 1
    decode(rows, [new])  # the old one's retirement was never seen
    assert rows.num_rows == 1
    assert rows.block_tables[:, :3].tolist() == [[5, 0, 0], [0, 0, 0]]


def test_the_rows_are_numpy_and_the_step_tensors_are_not_views_of_them() -> None:
    rows = InputBatch(2, 64, BLOCK_SIZE, use_decode_kernel=True)
    seq = make_seq("a", 5, [3, 4])
    seq.num_computed_tokens = 4
    inputs, _ = rows.prepare(ScheduledBatch([seq], [1]))
    rows.block_tables[:] = 99
    assert isinstance(rows.block_tables, np.ndarray)
    assert inputs.meta.decode_block_tables.tolist() == [[3, 4]]
