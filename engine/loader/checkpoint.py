"""What a loaded checkpoint is, whatever its format: a config, a tokenizer and lazy tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

NamedTensors = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint opened for loading: weights are read only when `tensors()` is iterated."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    # Hugging Face name -> torch shape of every tensor `tensors()` yields, checked at open time.
    tensor_shapes: Mapping[str, tuple[int, ...]]
    read_tensors: Callable[[Callable[[str], bool]], NamedTensors] = field(repr=False)
    # GGUF only: the wanted tensors' blocks as stored (see `gguf_blocks`), and each tensor's
    # GGMLQuantizationType name ("Q4_1", "Q8_0", "F32", ...) by Hugging Face name.
    read_blocks: Callable[[Callable[[str], bool]], NamedTensors] | None = field(
        default=None, repr=False
    )
    gguf_types: Mapping[str, str] = field(default_factory=dict)

    def tensors(self, wanted: Callable[[str], bool] = lambda _: True) -> NamedTensors:
        """Yield `(name, tensor)` one at a time (CPU; fp32 from GGUF, source dtype from
        safetensors), in Hugging Face Llama naming, so a caller can shard or move each tensor
        and drop it before the next is read. Tensors not `wanted` (another pipeline stage's)
        are never read."""
        return self.read_tensors(wanted)

    def gguf_blocks(self, wanted: Callable[[str], bool], gguf_type: str) -> NamedTensors:
        """Yield `(name, blocks)` for the `wanted` tensors as the GGUF stores them: uint8
        (rows, bytes of a row's blocks), rows in Hugging Face order. Refuses, before reading
        any, a checkpoint that is not a GGUF and a wanted tensor not of `gguf_type`."""
        if self.read_blocks is None:
            raise InvalidRequestError(
                f"quantization q4_1 keeps a GGUF file's quantized blocks; {self.path} is not a "
                "GGUF file (use quantization none or int8)"
            )
        other = sorted(n for n, t in self.gguf_types.items() if wanted(n) and t != gguf_type)
        if other:
            raise InvalidRequestError(
                f"quantization q4_1 keeps a GGUF's {gguf_type} weights, but {other[0]} is "
                f"{self.gguf_types[other[0]]} (use quantization none or int8)"
            )
        return self.read_blocks(wanted)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a Llama-family decoder with this config has, by Hugging Face name."""
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim, ffn = config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.attention_bias:
            shapes[f"{layer}.self_attn.q_proj.bias"] = (q_dim,)
            shapes[f"{layer}.self_attn.k_proj.bias"] = (kv_dim,)
            shapes[f"{layer}.self_attn.v_proj.bias"] = (kv_dim,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, ffn)
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def check_shapes(found: Mapping[str, tuple[int, ...]], config: ModelConfig, source: Path) -> None:
    """Fail at open time, not mid-load, when the tensors do not fit the config."""
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise UnsupportedModelError(
            f"{source}: tensors do not match a {config.architecture} model: "
            f"missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise UnsupportedModelError(
                f"{source}: tensor {name} has shape {tuple(found[name])}, expected {shape}"
            )


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - 5} more)" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more
