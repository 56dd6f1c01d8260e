"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.kernels import cpu_paged_attention
from engine.model.attention import AttentionMetadata, PrefillChunk
from engine.model.llama import LlamaForCausalLM, RotaryEmbedding
from engine.model_config import ModelConfig
from engine.sampler import SamplerOutput, SamplingRequest, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    """The sequences that reached the end of their tokens this step, each with its new token."""

    seqs: list[Sequence]
    sampled: SamplerOutput


@dataclass(slots=True)
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampling_seqs: list[Sequence]


class ModelRunner:
    """Owns the model's weights and the KV cache tensors on one device."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
    ):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        self.model = model.to(dtype).to_empty(device=device)
        self.model.load_weights(tensors)
        self.model.eval()
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, max_model_len, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Decodes read the paged cache in place where the native kernel exists (CPU).
        self.use_decode_kernel = device.type == "cpu" and cpu_paged_attention() is not None

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[0, i], cache[1, i]) for i in range(c.num_layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            cache.numel() * cache.element_size() / 2**30,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        inputs = self._prepare(batch)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.rope, self.kv_caches, inputs.meta
        )
        if not inputs.sampling_seqs:
            return StepOutput([], SamplerOutput([], []))
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        requests = [SamplingRequest(s.params, s.num_output_tokens) for s in inputs.sampling_seqs]
        return StepOutput(inputs.sampling_seqs, sample(logits, requests))

    def _prepare(self, batch: ScheduledBatch) -> _StepInputs:
        """Flatten the step's tokens: single-token queries first, then multi-token chunks."""
        bs = self.block_size
        entries = sorted(
            zip(batch.seqs, batch.num_scheduled_tokens, strict=True), key=lambda e: e[1] > 1
        )
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for seq, num_tokens in entries:
            start = seq.num_computed_tokens
            end = start + num_tokens
            row = len(input_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            num_blocks = -(-end // bs)
            if num_tokens == 1:
                decode_tables.append(table[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_chunk(row, num_tokens, start, table[:num_blocks]))
            if end == seq.num_tokens:
                logits_rows.append(row + num_tokens - 1)
                sampling_seqs.append(seq)
        context_lens = self._tensor(decode_lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self._tensor(_pad(decode_tables)),
            decode_context_lens=context_lens,
            decode_mask=None if self.use_decode_kernel else self._decode_mask(context_lens),
            prefills=prefills,
        )
        return _StepInputs(
            self._tensor(input_ids),
            self._tensor(positions),
            meta,
            self._tensor(logits_rows),
            sampling_seqs,
        )

    def _prefill_chunk(
        self, row: int, num_tokens: int, num_context: int, block_ids: list[int]
    ) -> PrefillChunk:
        mask = None
        if num_context:
            query_pos = torch.arange(num_context, num_context + num_tokens, device=self.device)
            key_pos = torch.arange(num_context + num_tokens, device=self.device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        return PrefillChunk(row, num_tokens, num_context, self._tensor(block_ids), mask)

    def _decode_mask(self, context_lens: torch.Tensor) -> torch.Tensor:
        max_blocks = -(-int(context_lens.max()) // self.block_size) if len(context_lens) else 0
        key_pos = torch.arange(max_blocks * self.block_size, device=self.device)
        valid = key_pos.unsqueeze(0) < context_lens.unsqueeze(1)
        return valid[:, None, None, :]

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


def _pad(tables: list[list[int]]) -> list[list[int]]:
    # Padding points at block 0; the mask keeps those keys out of the softmax.
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]
