"""The driver's persistent input batch (vLLM v1's `InputBatch`, in small): one row per running
sequence, kept from step to step, so that a step's tensors come from what changed rather than
from every sequence's whole block table again.

A row holds the block ids of its sequence that steps have needed so far; a step copies in only
the blocks its sequences newly reached (one every `block_size` decodes). Decode block tables,
context lengths and slots then come from numpy index arithmetic over the rows in the step, so a
steady decode step does a few reads per sequence in Python and nothing per block. Rows are
taken when a sequence is first scheduled and given back when the scheduler retires it (finished,
aborted or preempted: `ScheduledBatch.retired`); a preempted sequence that comes back gets a row
again, filled from its new blocks. Each step's tensors are copies, never views of the rows, so
the batches a pipeline keeps in flight do not change under it when later steps move the rows on.

The tensors equal `build_step_inputs`' (the one-off build that the KV profile and tests use)
for every batch: the known-answer test in tests/engine/test_input_batch.py holds them to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention import AttentionMetadata, PrefillChunk
from engine.model_runner import StepInputs, decode_mask, prefill_mask
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass(slots=True)
class _Row:
    seq: Sequence
    index: int  # into InputBatch.block_tables
    num_blocks: int  # of `seq.block_table` copied into the row so far


class InputBatch:
    """Rows of block ids for up to `max_num_seqs` running sequences, on the CPU."""

    def __init__(
        self, max_num_seqs: int, max_model_len: int, block_size: int, use_decode_kernel: bool
    ):
        self.block_size = block_size
        self.use_decode_kernel = use_decode_kernel
        max_blocks = -(-max_model_len // block_size)
        # Zero past each row's blocks: those are the padding of a decode table.
        self.block_tables = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self._arange = np.arange(max_num_seqs)
        self._rows: dict[str, _Row] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() takes the lowest

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """The step's tensors (decodes first, then multi-token chunks, as `build_step_inputs`)
        and the sequences owed a sampled token, in logits-row order."""
        for seq in batch.retired:
            self._release(seq)
        bs = self.block_size
        decode_rows: list[int] = []
        decode_positions: list[int] = []
        input_ids: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        chunks: list[tuple[Sequence, int, int]] = []  # (sequence, tokens, row index)
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            start = seq.num_computed_tokens
            index = self._sync(seq, -(-(start + num_tokens) // bs))
            if num_tokens > 1:
                chunks.append((seq, num_tokens, index))
                continue
            if start + 1 == seq.num_tokens:
                logits_rows.append(len(decode_rows))
                sampled.append(seq)
            decode_rows.append(index)
            decode_positions.append(start)
            input_ids.append(seq.token_ids[start])
        positions = np.array(decode_positions, dtype=np.int64)
        decode_tables, context_lens, slots = self._decode_arrays(decode_rows, positions)
        all_positions, all_slots = [positions], [slots]
        prefills: list[PrefillChunk] = []
        row = len(decode_rows)
        for seq, num_tokens, index in chunks:
            start = seq.num_computed_tokens
            end = start + num_tokens
            chunk_positions = np.arange(start, end, dtype=np.int64)
            block_ids = self.block_tables[index, : -(-end // bs)].copy()
            all_positions.append(chunk_positions)
            all_slots.append(block_ids[chunk_positions // bs] * bs + chunk_positions % bs)
            input_ids += seq.token_ids[start:end]
            mask = prefill_mask(start, num_tokens)
            prefills.append(PrefillChunk(row, num_tokens, start, torch.from_numpy(block_ids), mask))
            if end == seq.num_tokens:
                logits_rows.append(row + num_tokens - 1)
                sampled.append(seq)
            row += num_tokens
        lens = torch.from_numpy(context_lens)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(all_slots) if chunks else slots),
            num_decode_tokens=len(decode_rows),
            decode_block_tables=torch.from_numpy(decode_tables),
            decode_context_lens=lens,
            decode_mask=None if self.use_decode_kernel else decode_mask(lens, bs),
            prefills=prefills,
        )
        inputs = StepInputs(
            torch.tensor(input_ids, dtype=torch.long),
            torch.from_numpy(np.concatenate(all_positions) if chunks else positions),
            meta,
            torch.tensor(logits_rows, dtype=torch.long),
        )
        return inputs, sampled

    def _decode_arrays(
        self, rows: list[int], positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The decodes' block tables (padded with block 0), context lengths and slots."""
        bs = self.block_size
        context_lens = positions + 1
        width = -(-int(context_lens.max()) // bs) if len(context_lens) else 0
        tables = self.block_tables[rows, :width]  # a copy: fancy indexing
        slots = tables[self._arange[: len(rows)], positions // bs] * bs
        slots += positions % bs
        return tables, context_lens, slots

    def _sync(self, seq: Sequence, num_blocks: int) -> int:
        """`seq`'s row index, its first `num_blocks` block ids in it (a row is taken for a
        sequence not seen before)."""
        row = self._rows.get(seq.request_id)
        if row is None or row.seq is not seq:
            if row is not None:  # its id reused by a new request: the old one is gone
                self._release(row.seq)
            assert self._free_rows, "more running sequences than rows (max_num_seqs)"
            row = self._rows[seq.request_id] = _Row(seq, self._free_rows.pop(), 0)
        if num_blocks > row.num_blocks:
            self.block_tables[row.index, row.num_blocks : num_blocks] = seq.block_table[
                row.num_blocks : num_blocks
            ]
            row.num_blocks = num_blocks
        return row.index

    def _release(self, seq: Sequence) -> None:
        row = self._rows.get(seq.request_id)
        if row is None or row.seq is not seq:  # never scheduled, or already released
            return
        del self._rows[seq.request_id]
        self.block_tables[row.index, : row.num_blocks] = 0
        self._free_rows.append(row.index)
