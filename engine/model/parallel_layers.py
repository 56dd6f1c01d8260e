"""Linear and embedding layers split across tensor-parallel ranks, nano-vllm style.

Column-parallel layers keep a slice of the output rows (no communication); row-parallel
layers keep a slice of the input columns and sum their partial results with one all-reduce.
Each layer knows how to cut its own slice out of a full checkpoint tensor, so a rank only
ever keeps its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup
from engine.model.block_weights import BlockFormat, BlockWeight
from engine.model.dense_matmul import dense_linear, packed
from engine.model.int8_weights import Int8Weight, linear


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows split across ranks. `part_sizes` names the logical parts fused
    into one matmul (Q, K, V or gate, up); each part is split on its own."""

    def __init__(self, in_features: int, part_sizes: dict[str, int], bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.part_rows: dict[str, tuple[int, int]] = {}  # local rows of each part
        self.part_shards: dict[str, tuple[int, int]] = {}  # rows of the full part this rank keeps
        offset = 0
        for name, size in part_sizes.items():
            start, stop = self._shard_of(name, size)
            self.part_rows[name] = (offset, offset + stop - start)
            self.part_shards[name] = (start, stop)
            offset += stop - start
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None
        # Set by the runner's int8 or block (Q4_1) loading, which frees `weight`.
        self.quantized: Int8Weight | BlockWeight | None = None

    def _shard_of(self, name: str, size: int) -> tuple[int, int]:
        shard = size // self.tp.size
        return self.tp.rank * shard, (self.tp.rank + 1) * shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.quantized)

    def load(self, part: str, param_name: str, full: torch.Tensor) -> None:
        start, stop = self.part_shards[part]
        rows = self.part_rows[part]
        target = getattr(self, param_name).data[rows[0] : rows[1]]
        _copy_checked(target, full[start:stop], f"{part}.{param_name}")

    def load_blocks(self, part: str, full: BlockWeight) -> None:
        """This rank's rows of `part` from the checkpoint's blocks."""
        assert isinstance(self.quantized, BlockWeight), "the runner sets up the blocks first"
        start, stop = self.part_shards[part]
        rows = self.part_rows[part]
        target = self.quantized.blocks[rows[0] : rows[1]]
        _copy_checked(target, full.blocks[start:stop], f"{part}.blocks")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused and split by heads. When there are fewer KV heads than
    ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TPGroup
    ):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        sizes = {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }
        super().__init__(hidden, sizes, bias, tp)

    def _shard_of(self, name: str, size: int) -> tuple[int, int]:
        if name == "q" or self.num_kv_heads >= self.tp.size:
            return super()._shard_of(name, size)
        kv_head = self.tp.rank * self.num_kv_heads // self.tp.size
        return kv_head * self.head_dim, (kv_head + 1) * self.head_dim


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns split across ranks: partial sums, then one all-reduce."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_shard = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard))
        self.quantized: Int8Weight | BlockWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, None, self.quantized))

    def load(self, full: torch.Tensor) -> None:
        start = self.tp.rank * self.in_shard
        _copy_checked(self.weight.data, full[:, start : start + self.in_shard], "weight")

    def load_blocks(self, full: BlockWeight) -> None:
        """This rank's input columns from the checkpoint's blocks: whole blocks only."""
        assert isinstance(self.quantized, BlockWeight), "the runner sets up the blocks first"
        start = self.tp.rank * self.in_shard
        _copy_checked(self.quantized.blocks, full.columns(start, start + self.in_shard), "blocks")


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary; ids outside it look up zeros, and the
    all-reduce assembles every token's row. The same slice serves as the tied LM head, whose
    steps of few tokens read `head_blocks` where the runner kept the file's blocks (Q8_0: about
    half of bf16's bytes); lookups and bigger steps read the float rows, so a prefill chunk does
    not dequantize the vocabulary. On a CPU the head multiplies a copy of the rows in oneDNN's
    blocked layout (`packed`), made at its first step: the lookups need the plain rows, so bf16
    keeps both (57 MB more for SmolLM2). The plain rows' best path took 1.1-1.5x its time on the
    vocabulary's 49152 rows at 1 to 32 tokens (AMD EPYC, `python -m bench.linear_small_m`)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.shard = -(-vocab_size // tp.size)  # the last shard is padded
        self.vocab_size = vocab_size
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden))
        self.int8: Int8Weight | None = None
        self.head_blocks: BlockWeight | None = None
        self._head_rows: torch.Tensor | None = None  # `weight` packed, from the first step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = self._rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is None:
            return F.embedding(local_ids, self.weight)
        return self.int8.rows(local_ids)

    def load(self, full: torch.Tensor) -> None:
        rows = full[self.start : self.start + self.shard]
        target = self.weight.data
        target[rows.shape[0] :].zero_()
        _copy_checked(target[: rows.shape[0]], rows, "weight")
        self._head_rows = None

    def keep_head_blocks(self, full: torch.Tensor, fmt: BlockFormat) -> None:
        """This rank's vocabulary rows of the file's blocks `full` (vocab, K / 32 * file bytes);
        the padding rows of the last shard stay zero blocks (zero weights)."""
        head = BlockWeight.empty(fmt, self.shard, self.weight.shape[1], self.weight.dtype, True)
        rows = BlockWeight.from_gguf(full[self.start : self.start + self.shard], fmt, head.dtype)
        _copy_checked(head.blocks[: rows.blocks.shape[0]], rows.blocks, "head blocks")
        self.head_blocks = head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 logits over the whole vocabulary (N, vocab)."""
        if self.head_blocks is not None and self.head_blocks.kernels_for(hidden):
            local = self.head_blocks.linear(hidden)
        elif self.int8 is not None:
            local = self.int8.linear(hidden)
        else:
            local = dense_linear(hidden, self.head_rows())
        return self.tp.all_gather_last_dim(local.float())[:, : self.vocab_size]

    def head_rows(self) -> torch.Tensor:
        """The float rows as the head's dense steps read them (see the class)."""
        if self._head_rows is None:
            self._head_rows = packed(self.weight.detach())
        return self._head_rows


def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: checkpoint slice {tuple(source.shape)} != {tuple(target.shape)}")
    target.copy_(source)
