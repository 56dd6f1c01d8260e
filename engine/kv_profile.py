"""Sizing the KV cache after a profiling run, as vLLM does: the pool gets what is left of the
device's memory once the weights are loaded and the largest step has run once.

Without the run, the activations of a full step (a prefill of the largest token budget, the LM
head's logits) would come out of the share the pool was given, and the first long prompt
could run out of memory mid-serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class LargestStep:
    """The most one step computes: the token budget, the logits of every sequence slot."""

    num_tokens: int  # the largest token budget (SchedulerConfig.token_budget without decodes)
    num_logits_rows: int  # max_num_seqs
    max_seq_len: int  # the context length: longer budgets run as several sequences

    def sequence_lengths(self) -> list[int]:
        starts = range(0, self.num_tokens, self.max_seq_len)
        return [min(self.max_seq_len, self.num_tokens - start) for start in starts]

    def num_blocks(self, block_size: int) -> int:
        return sum(-(-n // block_size) for n in self.sequence_lengths())


def run_largest_step(runner: ModelRunner, step: LargestStep) -> None:
    """Run `step` on dummy prompt tokens into a throwaway cache, released afterwards."""
    runner.allocate_kv_cache(step.num_blocks(runner.block_size))
    try:
        seqs, first_block = [], 0
        lengths = step.sequence_lengths()
        for i, n in enumerate(lengths):
            seq = Sequence(f"kv-profile-{i}", [0] * n, SamplingParams(), max_tokens=1)
            num_blocks = -(-n // runner.block_size)
            seq.block_table = list(range(first_block, first_block + num_blocks))
            first_block += num_blocks
            seqs.append(seq)
        inputs, _ = runner.prepare(ScheduledBatch(seqs, lengths))
        rows = min(step.num_logits_rows, step.num_tokens)
        inputs.logits_rows = torch.arange(step.num_tokens - rows, step.num_tokens)
        runner.run(inputs)
    finally:
        runner.kv_caches = []


def peak_step_bytes(runner: ModelRunner, step: LargestStep) -> int:
    """CUDA: the bytes `step` allocates at its peak above what is already held (the weights),
    not counting its throwaway cache."""
    device = runner.device
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_step(runner, step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    num_layers = len(runner.model.layers)
    cache_bytes = step.num_blocks(runner.block_size) * runner.kv_bytes_per_block_per_layer
    torch.cuda.empty_cache()  # hand the step's memory back, so that mem_get_info sees it free
    return max(peak - held - cache_bytes * num_layers, 0)


def kv_budget_bytes(
    free_bytes: int, total_bytes: int, memory_utilization: float, peak_step_bytes: int
) -> float:
    """What the pool may take: of the `memory_utilization` share of the device, what neither
    is in use now (weights, CUDA context, other processes) nor a step needs at its peak."""
    return free_bytes - (1 - memory_utilization) * total_bytes - peak_step_bytes
