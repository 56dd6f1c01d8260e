"""The profiling run that sizes the KV cache: the largest step it runs, and that it leaves the
runner as it found it. (Its memory measurement needs CUDA; the step itself runs anywhere.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoints import save_tiny_transformers_model

from engine.kv_profile import LargestStep, kv_budget_bytes, run_largest_step
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner, RunnerShape
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


def test_a_budget_longer_than_the_context_runs_as_several_sequences() -> None:
    step = LargestStep(num_tokens=300, num_logits_rows=64, max_seq_len=128)
    assert step.sequence_lengths() == [128, 128, 44]
    assert step.num_blocks(16) == 8 + 8 + 3
    assert LargestStep(512, 64, 8192).sequence_lengths() == [512]


def test_the_budget_leaves_the_unused_share_and_the_step_peak() -> None:
    gib = 2**30
    assert kv_budget_bytes(60 * gib, 100 * gib, 0.9, 5 * gib) == 45 * gib


def prompt_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    runner.allocate_kv_cache(16)
    seq = Sequence("probe", token_ids, SamplingParams(), max_tokens=1)
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    inputs, _ = runner.prepare(ScheduledBatch([seq], [len(token_ids)]))
    return runner.run(inputs)


@pytest.mark.parametrize("num_tokens", [40, 300])
def test_the_profiling_run_leaves_the_runner_as_it_found_it(
    tmp_path: Path, num_tokens: int
) -> None:
    save_tiny_transformers_model(tmp_path, "qwen2")
    checkpoint = load_checkpoint(tmp_path)
    shape = RunnerShape(torch.device("cpu"), torch.float32, block_size=16, max_model_len=128)
    profiled, fresh = ModelRunner(checkpoint, shape), ModelRunner(checkpoint, shape)
    run_largest_step(profiled, LargestStep(num_tokens, num_logits_rows=8, max_seq_len=128))
    assert profiled.kv_caches == [], "the throwaway cache is released"
    ids = list(range(3, 60))
    torch.testing.assert_close(prompt_logits(profiled, ids), prompt_logits(fresh, ids))
