"""Decode steps for CUDA graphs: the size buckets, when they are used, and the padding of a
batch to its bucket. Capturing needs CUDA; the padded static-buffer step runs eagerly here,
through the in-place CPU decode kernel, which reads the same metadata as the Triton one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoints import save_tiny_transformers_model

from engine.cuda_graphs import DecodeGraphs, batch_size_buckets, graphs_enabled
from engine.kernels import cpu_kernels
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner, RunnerShape, StepInputs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

BLOCK_SIZE, NUM_BLOCKS = 16, 12


def test_buckets_double_to_eight_then_step_by_eight() -> None:
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_size_buckets(10) == [1, 2, 4, 8, 16]
    assert batch_size_buckets(3) == [1, 2, 4]
    assert batch_size_buckets(1) == [1]


@pytest.fixture
def runner(tmp_path: Path) -> ModelRunner:
    if cpu_kernels() is None:
        pytest.skip("the in-place CPU decode kernel could not be built here")
    save_tiny_transformers_model(tmp_path, "qwen2")
    shape = RunnerShape(torch.device("cpu"), torch.float32, BLOCK_SIZE, max_model_len=128)
    runner = ModelRunner(load_checkpoint(tmp_path), shape)
    runner.allocate_kv_cache(NUM_BLOCKS + 1)  # the last one is the scratch block
    return runner


def decode_step(
    runner: ModelRunner, prompt_lens: list[int]
) -> tuple[StepInputs, list[tuple[int, int]]]:
    """Prefill each prompt in its own blocks, then prepare one decode step of all of them;
    also return the (block, offset) each decode writes its K/V to."""
    seqs, first_block = [], 0
    for i, n in enumerate(prompt_lens):
        seq = Sequence(f"s{i}", [(7 * i + j) % 90 + 3 for j in range(n)], SamplingParams(), 8)
        seq.block_table = list(range(first_block, first_block + -(-(n + 1) // BLOCK_SIZE)))
        first_block += len(seq.block_table)
        runner.run(runner.prepare(ScheduledBatch([seq], [n]))[0])
        seq.num_computed_tokens = n
        seq.token_ids.append(5 + i)
        seqs.append(seq)
    inputs, _ = runner.prepare(ScheduledBatch(seqs, [1] * len(seqs)))
    slots = [
        (s.block_table[n // BLOCK_SIZE], n % BLOCK_SIZE)
        for s, n in zip(seqs, prompt_lens, strict=True)
    ]
    return inputs, slots


@pytest.mark.slow  # seconds of CPU
def test_graphs_are_for_single_process_cuda_only(runner: ModelRunner) -> None:
    assert not graphs_enabled(runner, is_single_process=True)


def test_a_padded_decode_step_equals_the_eager_one_and_pads_only_into_the_scratch_block(
    runner: ModelRunner,
) -> None:
    inputs, written_slots = decode_step(runner, [5, 16, 33])  # 16: the decode opens a block
    graphs = DecodeGraphs(runner, max_num_seqs=8, max_model_len=128, scratch_block=NUM_BLOCKS)
    assert graphs.can_run(inputs)
    cache = runner.kv_caches[0][0].untyped_storage()
    before = torch.stack([k.clone() for k, _ in runner.kv_caches])
    padded = graphs.run(inputs).clone()  # 3 sequences in the bucket of 4: one padding row
    after = torch.stack([k for k, _ in runner.kv_caches])
    changed = (before != after).flatten(3).any(-1).any(0)  # (blocks, slots)
    assert {tuple(ix) for ix in changed.nonzero().tolist()} == {*written_slots, (NUM_BLOCKS, 0)}
    assert runner.kv_caches[0][0].untyped_storage().data_ptr() == cache.data_ptr()
    eager = runner.run(inputs)  # writes the same keys and values again
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    # A batch of 2 after the batch of 3: table columns left from the longer step do no harm.
    smaller, _ = decode_step(runner, [20, 2])
    torch.testing.assert_close(graphs.run(smaller).clone(), runner.run(smaller))


def test_prefills_and_oversized_batches_run_eagerly(runner: ModelRunner) -> None:
    graphs = DecodeGraphs(runner, max_num_seqs=2, max_model_len=128, scratch_block=NUM_BLOCKS)
    three, _ = decode_step(runner, [3, 4, 5])
    assert not graphs.can_run(three)
    seq = Sequence("p", [3, 4, 5], SamplingParams(), 4)
    seq.block_table = [0]
    prefill, _ = runner.prepare(ScheduledBatch([seq], [3]))
    assert not graphs.can_run(prefill)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_with_cuda_graphs_equals_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import LLM

    save_tiny_transformers_model(tmp_path, "llama")
    prompts = [{"prompt_token_ids": [3 + i, 40, 17 + 2 * i]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def greedy() -> tuple[list[list[int]], bool]:
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outs, llm.engine.executor.decode_graphs is not None

    with_graphs, captured = greedy()
    assert captured
    monkeypatch.setenv("MERIDIAN_CUDA_GRAPHS", "0")
    eager, captured = greedy()
    assert not captured and with_graphs == eager
