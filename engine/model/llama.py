"""A Llama-family decoder (Llama, Mistral, Qwen2) whose attention reads and writes the paged
KV cache, split across tensor-parallel ranks (one rank: no communication at all). Q, K and V
are one matmul, gate and up another: fewer, larger matmuls are what the hardware is fast at.
`load_weights` routes each Hugging Face tensor to the layer that cuts out this rank's shard."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding:
    """cos/sin for every position up to the context length, computed once in fp32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """The step's cos/sin, looked up once and shared by every layer."""
        return RotaryAngles(
            self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)
        )


class RotaryAngles(NamedTuple):
    cos: torch.Tensor  # (T, 1, D)
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D), k (T, KVH, D): rotate-half RoPE at each token's position."""
        cos, sin = self.cos, self.sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = max(config.num_kv_heads // tp.size, 1)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
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
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            {"gate": config.intermediate_size, "up": config.intermediate_size},
            bias=False,
            tp=tp,
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions (T,) and, on the first stage, input_ids (T,), on the others the previous
        stage's `hidden` (T, hidden) -> (T, hidden): final hidden states on the last stage."""
        if hidden is None:
            assert self.embed_tokens is not None, "stages after the first start from `hidden`"
            hidden = self.embed_tokens(input_ids)
        x = hidden
        angles = rope.at(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, angles, kv_cache, meta)
        return x if self.norm is None else self.norm(x)

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
        """Copy this rank's shard of every tensor this stage `wants`; fail on a missing or extra
        one."""
        expected = self._expected_tensors()
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
        _, _, block, proj, param = parts  # layers.3.self_attn.q_proj.weight
        if proj in ("q_proj", "k_proj", "v_proj"):
            layer.self_attn.qkv_proj.load(proj[0], param, tensor)
        elif proj in ("gate_proj", "up_proj"):
            layer.mlp.gate_up_proj.load(proj.removesuffix("_proj"), param, tensor)
        else:  # o_proj, down_proj
            getattr(getattr(layer, block), proj).load(tensor)

    def _expected_tensors(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        projections = [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ]
        for i in self.layer_ids:
            names |= {f"model.layers.{i}.{p}.weight" for p in projections}
            names |= {
                f"model.layers.{i}.input_layernorm.weight",
                f"model.layers.{i}.post_attention_layernorm.weight",
            }
            if c.attention_bias:
                names |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"}
        return {n for n in names if self.wants(n)}
