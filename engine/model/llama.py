"""A Llama-family decoder (Llama, Mistral, Qwen2) whose attention reads and writes the paged
KV cache, split across tensor-parallel ranks (one rank: no communication at all). Q, K and V
are one matmul, gate and up another: fewer, larger matmuls are what the hardware is fast at.
`load_weights` routes each Hugging Face tensor to the layer that cuts out this rank's shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.loader.checkpoint import Checkpoint
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.block_weights import BLOCK_WEIGHTS, FORMATS, BlockWeight
from engine.model.layer_ops import (
    RotaryAngles,
    RotaryEmbedding,
    add_rms_norm,
    rms_norm,
    silu_and_mul,
)
from engine.model.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.model_config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
FusedLayers = Callable[
    [torch.Tensor, RotaryAngles, KVCaches, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]

_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def projection_names(layer_ids: range) -> set[str]:
    """The Hugging Face names of these layers' linear layers' weights."""
    return {f"model.layers.{i}.{p}.weight" for i in layer_ids for p in _PROJECTIONS}


def keeps_q4_1_blocks(checkpoint: Checkpoint, tensor_parallel_size: int) -> bool:
    """Whether a model of `checkpoint` split over `tensor_parallel_size` ranks can keep every
    projection as the file's Q4_1 blocks: all of them are Q4_1, and each row-parallel shard
    (o and down, split along K) falls on whole blocks."""
    config = checkpoint.config
    names = projection_names(range(config.num_layers))
    if any(checkpoint.gguf_types.get(name) != "Q4_1" for name in names):
        return False
    split_k = (config.num_heads * config.head_dim, config.intermediate_size)
    return all(k % (tensor_parallel_size * BLOCK_WEIGHTS) == 0 for k in split_k)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one fused step of the residual stream."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.num_heads = config.num_heads // tp.size
        self.q_size = self.num_heads * config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.attention_bias,
            tp,
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = rope.rope_and_write_kv(qkv, kv_cache, meta.slot_mapping, self.num_heads)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            {"gate": config.intermediate_size, "up": config.intermediate_size},
            bias=False,
            tp=tp,
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `residual + x` (just `x` before the first layer): carried
        in two parts, so that each add fuses with the norm after it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder, or one pipeline stage of it: the decoder layers in `layers`, the
    embedding on the first stage, the final norm and LM head on the last (a tied head is the
    embedding, so the last stage holds it too)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, layers: range | None = None):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.layer_ids = range(config.num_layers) if layers is None else layers
        self.is_first = self.layer_ids.start == 0
        self.is_last = self.layer_ids.stop == config.num_layers
        has_embedding = self.is_first or (self.is_last and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if has_embedding
            else None
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in self.layer_ids)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        self.lm_head = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if self.is_last and not config.tie_word_embeddings
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        fused_layers: FusedLayers | None = None,
    ) -> torch.Tensor:
        """positions (T,) and, on the first stage, input_ids (T,), on the others the previous
        stage's `hidden` (T, hidden) -> (T, hidden): final hidden states on the last stage.
        `fused_layers` runs the layers in one call instead (the runner's decode steps on CPU,
        model/fused_decode.py): (x, angles, kv_caches, meta) -> (x, residual)."""
        if hidden is None:
            assert self.embed_tokens is not None, "stages after the first start from `hidden`"
            hidden = self.embed_tokens(input_ids)
        x, residual = hidden, None
        angles = rope.at(positions, x.dtype)
        if fused_layers is not None:
            x, residual = fused_layers(x, angles, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, angles, kv_cache, meta)
        assert residual is not None, "every stage holds at least one layer"
        return x + residual if self.norm is None else self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 logits (N, vocab), on every TP rank of the last stage."""
        head = self.lm_head or self.embed_tokens
        assert head is not None and self.is_last, "only the last stage has the LM head"
        return head.logits(hidden)

    def wants(self, hf_name: str) -> bool:
        """Whether this stage holds (a shard of) the checkpoint tensor `hf_name`."""
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) in self.layer_ids
        if hf_name == "model.embed_tokens.weight":
            return self.embed_tokens is not None
        return self.is_last  # model.norm.weight, lm_head.weight

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's shard of every tensor this stage `wants` (but projections already
        kept as blocks); fail on a missing or extra one."""
        expected = self._expected_tensors() - self._projections_kept()
        for hf_name, tensor in tensors:
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # a checkpoint may carry a copy of the tied embedding
            if hf_name not in expected:
                raise KeyError(f"checkpoint tensor {hf_name} has no place in the model")
            self._load_one(hf_name.removeprefix("model."), tensor)
            expected.remove(hf_name)
        if expected:
            missing = sorted(expected)
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
            module = getattr(self, name.split(".")[0])
            if isinstance(module, RMSNorm):
                module.weight.data.copy_(tensor)
            else:
                module.load(tensor)
            return
        parts = name.split(".")
        layer = self.layers[int(parts[1]) - self.layer_ids.start]
        assert isinstance(layer, LlamaDecoderLayer)
        if len(parts) == 4:  # layers.3.input_layernorm.weight: replicated on every rank
            getattr(layer, parts[2]).weight.data.copy_(tensor)
            return
        module, part = self._projection(name)
        if isinstance(module, RowParallelLinear):
            module.load(tensor)
        else:
            assert part is not None
            module.load(part, parts[4], tensor)

    def keep_projection_blocks(
        self, blocks: Iterable[tuple[str, torch.Tensor]], gguf_type: str
    ) -> None:
        """Keep every projection of this stage as the checkpoint's `blocks` of `gguf_type`
        (this rank's shard of each), freeing the float weights; fail on a missing or extra
        one. Call before `load_weights`, which then skips the projections."""
        fmt = FORMATS[gguf_type]
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                weight = module.weight
                rows, columns = weight.shape
                module.quantized = BlockWeight.empty(fmt, rows, columns, weight.dtype)
                module.weight = nn.Parameter(weight.data.new_empty(0), requires_grad=False)
        expected = self.projection_weights()
        for hf_name, tensor in blocks:
            if hf_name not in expected:
                raise KeyError(f"checkpoint tensor {hf_name} is not a projection of this stage")
            module, part = self._projection(hf_name.removeprefix("model."))
            full = BlockWeight.from_gguf(tensor, fmt, module.weight.dtype)
            if isinstance(module, RowParallelLinear):
                module.load_blocks(full)
            else:
                assert part is not None
                module.load_blocks(part, full)
            expected.remove(hf_name)
        if expected:
            missing = sorted(expected)
            raise ValueError(
                f"checkpoint lacks {len(missing)} {gguf_type} tensors, e.g. {missing[:3]}"
            )

    def _projections_kept(self) -> set[str]:
        kept = any(
            isinstance(m, ColumnParallelLinear | RowParallelLinear)
            and isinstance(m.quantized, BlockWeight)
            for m in self.modules()
        )
        return self.projection_weights() if kept else set()

    def projection_weights(self) -> set[str]:
        """The Hugging Face names of this stage's linear layers' weights."""
        return projection_names(self.layer_ids)

    def _projection(self, name: str) -> tuple[ColumnParallelLinear | RowParallelLinear, str | None]:
        """The layer holding `layers.3.self_attn.q_proj.<param>`, and the part it is of a fused
        matmul (None: a row-parallel layer of its own)."""
        _, index, block, proj, _ = name.split(".")
        layer = self.layers[int(index) - self.layer_ids.start]
        assert isinstance(layer, LlamaDecoderLayer)
        if proj in ("q_proj", "k_proj", "v_proj"):
            return layer.self_attn.qkv_proj, proj[0]
        if proj in ("gate_proj", "up_proj"):
            return layer.mlp.gate_up_proj, proj.removesuffix("_proj")
        module = getattr(getattr(layer, block), proj)  # o_proj, down_proj
        assert isinstance(module, RowParallelLinear)
        return module, None

    def _expected_tensors(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        names |= self.projection_weights()
        for i in self.layer_ids:
            names |= {
                f"model.layers.{i}.input_layernorm.weight",
                f"model.layers.{i}.post_attention_layernorm.weight",
            }
            if c.attention_bias:
                names |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"}
        return {n for n in names if self.wants(n)}
