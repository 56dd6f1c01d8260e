"""The elementwise steps of a decoder layer: RMSNorm (with the residual add before it), RoPE
with the KV-cache write after it, and SiLU-times-up. On CPU each is one call into the native
kernels, which at decode batch sizes costs less than one of the 4-14 eager ops it replaces;
elsewhere (CUDA, or MERIDIAN_CPU_KERNELS=0) the eager PyTorch twin runs. Both round through the
model's dtype at the same points, so they agree to the bit in bf16 (fp32: within an FMA)."""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.model.kv_quant import write_slots
from engine.model.rope_scaling import scale_inv_freq
from engine.model_config import Llama3RopeScaling


def _kernels_for(x: torch.Tensor) -> ModuleType | None:
    return cpu_kernels() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, N) -> (T, N)."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    # Normalise in fp32 whatever the model dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the kernel updates `residual` in place."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.add_rms_norm(x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2 I), gate then up -> silu(gate) * up (T, I)."""
    kernels = _kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding:
    """cos/sin for every position up to the context length, computed once in fp32."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        device: torch.device,
        scaling: Llama3RopeScaling | None = None,
    ):
        inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        inv_freq = scale_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """The step's cos/sin, looked up once and shared by every layer."""
        return RotaryAngles(self.cos[positions].to(dtype), self.sin[positions].to(dtype))


class RotaryAngles(NamedTuple):
    cos: torch.Tensor  # (T, D), in the model's dtype, as the reference rounds them
    sin: torch.Tensor

    def rope_and_write_kv(
        self,
        qkv: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (T, (H + 2 KVH) D) -> q (T, H, D), k and v (T, KVH, D), q and k rotated
        (rotate-half RoPE at each token's position), k and v written to the cache slots."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[-2:]
        kernels = _kernels_for(qkv)
        if kernels is not None:  # rotates in place inside qkv
            kernels.rope_and_write_kv(
                qkv, self.cos, self.sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
            )
        q, k, v = _split_heads(qkv, num_heads, num_kv_heads, head_dim)
        if kernels is None:
            cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            write_slots(k_cache, slot_mapping, k)
            write_slots(v_cache, slot_mapping, v)
        return q, k, v


def _split_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
