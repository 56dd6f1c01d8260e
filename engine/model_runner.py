"""Turns a scheduled batch into tensors and runs this rank's shard of the model (its TP share
of its pipeline stage's layers) over its share of the paged KV cache. The driver prepares the
inputs (engine/input_batch.py); every rank runs them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.kernels import cpu_kernels
from engine.loader import Checkpoint
from engine.model.attention import AttentionMetadata, PrefillChunk, paged_decode_kernel
from engine.model.block_weights import FORMATS, BlockWeight
from engine.model.dense_matmul import bf16_gemv_max_tokens, onednn_min_tokens
from engine.model.fused_decode import FusedDecode
from engine.model.int8_weights import Int8Weight, measure_max_gemv_tokens
from engine.model.layer_ops import RotaryEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_threads import StepThreadPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerShape:
    """What every rank must agree on to run the same steps."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    # How weights are kept (EngineConfig.weight_quantization): "none" (the model's dtype),
    # "int8" (model/int8_weights.py) or "q4_1" (the GGUF's blocks: model/block_weights.py).
    quantization: str = "none"
    # The KV cache's element type (EngineConfig.kv_cache_dtype resolved): dtype, or fp8.
    kv_dtype: torch.dtype | None = None  # None: dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


@dataclass(slots=True)
class StepInputs:
    """One step's tensors: what the driver sends to every other rank."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows whose logits are sampled: the last token of finished chunks

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to(self, device: torch.device) -> StepInputs:
        if self.input_ids.device == device:
            return self
        return StepInputs(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.meta.to(device),
            self.logits_rows.to(device, non_blocking=True),
        )


class ModelRunner:
    """Owns the model's weights and the KV cache tensors on one device."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        shape: RunnerShape,
        tp: TPGroup | None = None,
        layers: range | None = None,
    ):
        self.config = config = checkpoint.config
        self.device = device = shape.device
        self.dtype = shape.dtype
        self.quantization = shape.quantization  # as resolved (never "auto")
        self.block_size = shape.block_size
        self.kv_dtype = shape.cache_dtype
        self.tp = tp or TPGroup()
        self.num_kv_heads = max(config.num_kv_heads // self.tp.size, 1)
        with torch.device("meta"):
            model = LlamaForCausalLM(config, self.tp, layers)
        # What `to_empty` does, but through torch.empty: its empty_like on meta tensors imports
        # torch.fx's symbolic shapes on first use, 0.46 CPU-s of every engine's start.
        self.model = model.to(shape.dtype)._apply(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)
        )
        # q4_1: the projections' blocks are kept first, so the float load never reads them.
        kept = self._keep_q4_1(checkpoint) if shape.quantization == "q4_1" else set()
        self.model.load_weights(checkpoint.tensors(lambda n: model.wants(n) and n not in kept))
        self.model.eval()
        if shape.quantization == "int8":
            self._quantize_int8()
        elif shape.quantization == "q4_1":
            self._keep_head_blocks(checkpoint)
        if device.type == "cpu" and shape.dtype == torch.bfloat16 and cpu_kernels():
            # Measured now, not in a request.
            ranges = [(bf16_gemv_max_tokens(*s), s) for s in sorted(self._dense_shapes())]
            logger.info(
                "bf16 matmuls: the GEMV kernel for steps of up to %s tokens, F.linear above",
                ", ".join(f"{tokens} ({n}x{k})" for tokens, (n, k) in ranges),
            )
        if device.type == "cpu" and shape.dtype == torch.float32:
            for out_features, in_features in self._dense_shapes():
                onednn_min_tokens(out_features, in_features)  # measured now, not in a request
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, shape.max_model_len, device, config.rope_scaling
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Decodes read the paged cache in place where a kernel exists (C++ on CPU, Triton on CUDA).
        self.use_decode_kernel = paged_decode_kernel(device, self.kv_dtype) is not None
        # Alone on a CPU, each step picks its thread count (see step_threads.py); TP ranks
        # wait on each other in every all-reduce, so they keep the share they were given.
        self.step_threads = (
            StepThreadPolicy.for_this_process()
            if device.type == "cpu" and self.tp.size == 1
            else None
        )
        # Decode steps run the layers in one call where every layer would run only our kernels.
        self.fused_decode = FusedDecode.of(self.model) if device.type == "cpu" else None

    def _block_weights(self) -> list[BlockWeight]:
        return [
            layer.quantized
            for layer in self.model.modules()
            if isinstance(layer, ColumnParallelLinear | RowParallelLinear)
            and isinstance(layer.quantized, BlockWeight)
        ]

    def _dense_shapes(self) -> set[tuple[int, int]]:
        """(N, K) of every weight the model multiplies by in its dtype (quantized ones
        dequantized, in a prefill)."""
        shapes: set[tuple[int, int]] = set()
        for layer in self.model.modules():
            if isinstance(layer, ColumnParallelLinear | RowParallelLinear):
                quantized: Int8Weight | BlockWeight | None = layer.quantized
            elif isinstance(layer, VocabParallelEmbedding):
                quantized = layer.int8
            else:
                continue
            weight_shape = layer.weight.shape if quantized is None else quantized.shape
            shapes.add((weight_shape[0], weight_shape[1]))
        return shapes

    def _quantize_int8(self) -> None:
        c = self.config
        max_gemv_tokens = measure_max_gemv_tokens(
            c.hidden_size, 2 * c.intermediate_size, self.dtype
        )
        quantizable = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
        layers = [m for m in self.model.modules() if isinstance(m, quantizable)]
        for layer in layers:
            int8 = Int8Weight.quantize(layer.weight.data, max_gemv_tokens)
            if isinstance(layer, VocabParallelEmbedding):
                layer.int8 = int8
            else:
                layer.quantized = int8
            layer.weight = nn.Parameter(layer.weight.data.new_empty(0), requires_grad=False)
        logger.info(
            "weights: int8 weight-only in %d layers (int8 matmul up to %d tokens a step)",
            len(layers),
            max_gemv_tokens,
        )

    def _keep_q4_1(self, checkpoint: Checkpoint) -> set[str]:
        """Keep the projections as the GGUF's Q4_1 blocks; returns their names."""
        names = self.model.projection_weights()
        self.model.keep_projection_blocks(
            checkpoint.gguf_blocks(names.__contains__, "Q4_1"), "Q4_1"
        )
        return names

    def _keep_head_blocks(self, checkpoint: Checkpoint) -> None:
        """On the last stage, keep the LM head's blocks too where the file's are a format the
        kernels read (Q8_0 in the default file; llama.cpp keeps the head at 8 bits), for
        steps of few tokens; log what each part reads."""
        model = self.model
        head = model.lm_head or model.embed_tokens if model.is_last else None
        name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
        gguf_type = checkpoint.gguf_types.get(name)
        head_reads = f"{self.dtype}"
        if head is not None and gguf_type in FORMATS and cpu_kernels():
            [(_, blocks)] = checkpoint.gguf_blocks(name.__eq__, gguf_type)
            head.keep_head_blocks(blocks, FORMATS[gguf_type])
            assert head.head_blocks is not None
            head_reads = (
                f"its {gguf_type} blocks up to {head.head_blocks.max_kernel_tokens()} tokens a "
                f"step, {self.dtype} above"
            )
        most = sorted({w.max_kernel_tokens() for w in self._block_weights()})
        matmuls = (
            f"the GEMV kernel up to {'/'.join(map(str, most))} tokens a step, dequantized above"
            if cpu_kernels()
            else "dequantized every step: no CPU kernels"
        )
        logger.info(
            "weights: the GGUF's Q4_1 blocks in %d projections (%s); embedding in %s, "
            "LM head reads %s",
            len(model.projection_weights()),
            matmuls,
            self.dtype,
            head_reads if head is not None else "nothing (not on this stage)",
        )

    @property
    def kv_bytes_per_block_per_layer(self) -> int:
        c = self.config
        return 2 * self.num_kv_heads * c.head_dim * self.kv_dtype.itemsize * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        num_layers = len(self.model.layers)
        shape = (2, num_layers, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(cache[0, i], cache[1, i]) for i in range(num_layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
            num_blocks,
            self.block_size,
            cache.numel() * cache.element_size() / 2**30,
            self.kv_dtype,
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this rank's layers over the step, from the token ids on the first stage and from
        the previous stage's `hidden` on the others. The last stage returns fp32 logits (sampled
        rows, vocab), the same on each of its TP ranks; the others, what the next stage takes."""
        policy = self.step_threads
        if policy is None:
            return self._forward(inputs.to(self.device), hidden)
        threads = policy.apply(inputs.num_tokens)
        started = time.perf_counter()
        out = self._forward(inputs, hidden)
        policy.record(inputs.num_tokens, threads, time.perf_counter() - started)
        return out

    def _forward(self, inputs: StepInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        fused = self.fused_decode
        out = self.model(
            inputs.input_ids,
            inputs.positions,
            self.rope,
            self.kv_caches,
            inputs.meta,
            hidden,
            fused.run if fused and fused.can_run(inputs.num_tokens, inputs.meta) else None,
        )
        if not self.model.is_last:
            return out
        return self.model.compute_logits(out[inputs.logits_rows])

    def hidden_buffer(self, inputs: StepInputs) -> torch.Tensor:
        """Where a stage after the first receives the previous stage's output for `inputs`."""
        shape = (inputs.num_tokens, self.config.hidden_size)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """The step's tensors built from the sequences alone, for one-off steps (the KV
        profile, tests); the engine's steps come from the executor's persistent `InputBatch`,
        which gives the same tensors."""
        return build_step_inputs(batch, self.block_size, self.use_decode_kernel)


def build_step_inputs(
    batch: ScheduledBatch, block_size: int, use_decode_kernel: bool
) -> tuple[StepInputs, list[Sequence]]:
    """Flatten the step's tokens (single-token queries first, then multi-token chunks); also
    return the sequences owed a sampled token, in logits-row order. Without
    `use_decode_kernel`, decodes get the mask of the portable path."""
    bs = block_size
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
            block_ids = _long_tensor(table[:num_blocks])
            mask = prefill_mask(start, num_tokens)
            prefills.append(PrefillChunk(row, num_tokens, start, block_ids, mask))
        if end == seq.num_tokens:
            logits_rows.append(row + num_tokens - 1)
            sampling_seqs.append(seq)
    context_lens = _long_tensor(decode_lens)
    meta = AttentionMetadata(
        slot_mapping=_long_tensor(slots),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=_long_tensor(_pad(decode_tables)),
        decode_context_lens=context_lens,
        decode_mask=None if use_decode_kernel else decode_mask(context_lens, bs),
        prefills=prefills,
    )
    inputs = StepInputs(
        _long_tensor(input_ids), _long_tensor(positions), meta, _long_tensor(logits_rows)
    )
    return inputs, sampling_seqs


def _long_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
    # Built on the CPU: `run` moves them, on whichever rank runs them.
    return torch.tensor(values, dtype=torch.long)


def prefill_mask(num_context: int, num_tokens: int) -> torch.Tensor | None:
    """(num_tokens, num_context + num_tokens), True where a chunk's query may attend; None
    without context (plain causal attention)."""
    if not num_context:
        return None
    query_pos = torch.arange(num_context, num_context + num_tokens)
    key_pos = torch.arange(num_context + num_tokens)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)


def decode_mask(context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """(num_decodes, 1, 1, max_blocks * block_size) valid keys, for the portable decode path."""
    max_blocks = -(-int(context_lens.max()) // block_size) if len(context_lens) else 0
    key_pos = torch.arange(max_blocks * block_size)
    valid = key_pos.unsqueeze(0) < context_lens.unsqueeze(1)
    return valid[:, None, None, :]


def _pad(tables: list[list[int]]) -> list[list[int]]:
    # Padding points at block 0; the mask keeps those keys out of the softmax.
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]
