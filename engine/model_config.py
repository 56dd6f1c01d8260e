"""The shape of a decoder model, whatever file format it came from."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's long-context RoPE (`rope_type: llama3`): frequencies whose wavelength exceeds
    `original_max_position_embeddings / low_freq_factor` are slowed by `factor`, those shorter
    than `original_max_position_embeddings / high_freq_factor` are kept, and those between
    are blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 has biases on the Q, K and V projections; Llama and Mistral have none.
    attention_bias: bool = False
    rope_scaling: Llama3RopeScaling | None = None  # None: plain RoPE at `rope_theta`
