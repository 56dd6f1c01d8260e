"""A decode step's decoder layers as one call into the CPU kernels (`decode_layers`,
engine/kernels/decode_layers_cpu.cpp): the layers' own ops and kernels in their order, so the
same bits as the modules, without the Python between them.

At batch 1 a step's matmuls read their weights in ~6 ms here and the ~14 Python calls and
module dispatches of each of the 30 layers took another 2-2.5 ms (docs/benchmarks.md). The fused
call serves the steps where every layer would run only our kernels: CPU, kernels built, one
tensor-parallel rank, no biases, every projection Q4_1 blocks or dense bf16, and a step of up
to MAX_TOKENS tokens within the projections' kernel ranges, all decodes, attended by the decode
kernel. Every other step runs the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu_kernels
from engine.model.attention import AttentionMetadata
from engine.model.block_weights import Q4_1, BlockWeight
from engine.model.dense_matmul import bf16_gemv_max_tokens
from engine.model.layer_ops import RotaryAngles
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.parallel_layers import ColumnParallelLinear, RowParallelLinear

# Steps of up to this many tokens, and within every projection's kernel range (where the modules
# would call exactly these kernels: the bf16 kernel takes 4 tokens on any CPU unless
# MERIDIAN_MATMUL_CROSSOVER pins fewer, the blocks 16, 32 on AMX tiles). Up to 4 at first; to 32
# the c=32 mixed workload gained 5-8% output tok/s on a Sapphire Rapids (2 pairs of runs).
MAX_TOKENS = 32


@dataclass(frozen=True, slots=True)
class FusedDecode:
    weights: list[torch.Tensor]  # per layer: input norm, qkv, o, post-attention norm, gate-up, down
    num_heads: int
    eps: float
    scale: float
    max_tokens: int  # MAX_TOKENS, or the least of the projections' kernel ranges below it

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> FusedDecode | None:
        """The fused call for the model's layers, or None where some layer would not run our
        kernels alone at decode batch sizes."""
        layers = [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]
        if not layers or cpu_kernels() is None:
            return None
        weights: list[torch.Tensor] = []
        max_tokens = MAX_TOKENS
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            matrices = [_kernel_weight(p) for p in projections]
            if attention.qkv_proj.tp.size != 1 or any(m is None for m in matrices):
                return None
            qkv, o, gate_up, down = (m for m in matrices if m is not None)
            max_tokens = min(max_tokens, qkv[1], o[1], gate_up[1], down[1])
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            weights += [norms[0].weight, qkv[0], o[0], norms[1].weight, gate_up[0], down[0]]
        first = layers[0].self_attn
        head_dim = first.q_size // first.num_heads
        eps = layers[0].input_layernorm.eps
        return cls(weights, first.num_heads, eps, head_dim**-0.5, max_tokens)

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step is one the fused call serves: decodes only, few, on the kernel."""
        return (
            num_tokens <= self.max_tokens
            and meta.num_decode_tokens == num_tokens
            and meta.decode_mask is None
        )

    def run(
        self,
        x: torch.Tensor,
        angles: RotaryAngles,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden), the embedding's rows -> (x, residual) after the last layer."""
        kernels = cpu_kernels()
        assert kernels is not None, "FusedDecode.of checked the kernels"
        x, residual = kernels.decode_layers(
            x,
            self.weights,
            [cache for pair in kv_caches for cache in pair],
            angles.cos,
            angles.sin,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.num_heads,
            self.eps,
            self.scale,
        )
        return x, residual


def _kernel_weight(
    layer: ColumnParallelLinear | RowParallelLinear,
) -> tuple[torch.Tensor, int] | None:
    """What the decode kernels multiply by for this projection, Q4_1 blocks or the bf16 weight,
    and up to how many tokens a step's module calls the same kernel; None where a step of few
    tokens would take another path (int8, fp32 or Q8_0 weights, a bias)."""
    if getattr(layer, "bias", None) is not None or layer.weight.device.type != "cpu":
        return None
    quantized = layer.quantized
    if quantized is None and layer.weight.dtype == torch.bfloat16:
        return layer.weight, bf16_gemv_max_tokens(*layer.weight.shape)
    if isinstance(quantized, BlockWeight) and quantized.format is Q4_1:
        return quantized.blocks, quantized.max_kernel_tokens()
    return None
