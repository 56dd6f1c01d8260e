"""CUDA graphs for decode steps: at decode batch sizes a step is hundreds of small kernel
launches, each costing more on the host than on the GPU, so each batch size bucket (1, 2, 4,
8, then multiples of 8, as in vLLM) is captured once and replayed.

A decode-only batch of n sequences is padded to its bucket: its inputs are copied into static
buffers, and the padding rows decode token 0 at position 0 into a scratch block that no
sequence owns (the executor allocates it beyond the pool), so they write and read nothing of
anyone's. Only single-process CUDA with the in-place decode kernel is captured (the portable
path's mask changes shape every step); prefills and larger batches run eagerly.

MERIDIAN_CUDA_GRAPHS=0 turns the graphs off, for comparisons.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.model.attention import AttentionMetadata
from engine.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first bucket that holds `max_num_seqs`."""
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] + 8)
    return buckets[: next(i for i, b in enumerate(buckets) if b >= max_num_seqs) + 1]


def graphs_enabled(runner: ModelRunner, is_single_process: bool) -> bool:
    """Whether decode steps are captured: CUDA, one process, the in-place decode kernel."""
    return (
        runner.device.type == "cuda"
        and is_single_process
        and runner.use_decode_kernel
        and os.environ.get("MERIDIAN_CUDA_GRAPHS", "1") != "0"
    )


class DecodeGraphs:
    """Static decode inputs for the largest bucket, and one captured graph per bucket.

    `capture=False` keeps the padding and the static buffers but runs the model eagerly on
    them: how the padding is checked on a machine without CUDA."""

    def __init__(
        self, runner: ModelRunner, max_num_seqs: int, max_model_len: int, scratch_block: int
    ):
        self.runner = runner
        self.buckets = batch_size_buckets(max_num_seqs)
        self.scratch_block = scratch_block
        size, device = self.buckets[-1], runner.device
        max_blocks = -(-max_model_len // runner.block_size)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions, self.slot_mapping = zeros(size), zeros(size), zeros(size)
        self.block_tables, self.context_lens = zeros(size, max_blocks), zeros(size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def can_run(self, inputs: StepInputs) -> bool:
        """A decode-only step (every token is one sequence's next, its logits sampled) that
        fits the largest bucket."""
        meta = inputs.meta
        return (
            not meta.prefills
            and meta.num_decode_tokens == inputs.num_tokens == len(inputs.logits_rows)
            and 0 < inputs.num_tokens <= self.buckets[-1]
            and meta.decode_mask is None
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (each replay's
        activations are dead once its logits are read)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._pad(size, 0)
            self._forward(size)  # warm up: Triton compiles and cuBLAS picks kernels here
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        logger.info("captured CUDA graphs for decode batches of %s", self.buckets)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (n, vocab) of a step that `can_run`: valid until the next run."""
        n = inputs.num_tokens
        size = next(b for b in self.buckets if b >= n)
        meta = inputs.meta
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        self._pad(size, n)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.logits[size][:n]

    def _pad(self, size: int, num_real: int) -> None:
        """Rows `num_real:size` decode token 0 at position 0 into the scratch block."""
        rows = slice(num_real, size)
        self.input_ids[rows] = 0
        self.positions[rows] = 0
        self.slot_mapping[rows] = self.scratch_block * self.runner.block_size
        self.block_tables[rows, 0] = self.scratch_block
        self.context_lens[rows] = 1

    def _forward(self, size: int) -> torch.Tensor:
        # Only the first `cdiv(context_len, block_size)` entries of a block-table row are
        # read, so columns left over from an earlier, longer step do no harm.
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            decode_mask=None,
            prefills=[],
        )
        runner = self.runner
        hidden = runner.model(
            self.input_ids[:size], self.positions[:size], runner.rope, runner.kv_caches, meta
        )
        return runner.model.compute_logits(hidden)
