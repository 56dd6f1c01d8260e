"""Loading llama.cpp GGUF checkpoints: metadata -> ModelConfig, quantized tensors -> fp32 torch.

The file is memory-mapped; each tensor is dequantized only when `tensors()` reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.errors import UnsupportedModelError
from engine.gguf_file import GGUFTensor, read_gguf
from engine.gguf_metadata import GGUFMetadata
from engine.loader.checkpoint import Checkpoint, NamedTensors, check_shapes
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

# GGUF architectures with the Llama layout; llama.cpp permutes Q/K rows only for the first two
# (their RoPE rotates interleaved pairs), Qwen2 keeps Hugging Face's rotate-half order.
_PERMUTED_QK = ("llama", "mistral")
_ARCHITECTURES = (*_PERMUTED_QK, "qwen2")

_T = GGMLQuantizationType
# Every type gguf.quants can dequantize with numpy that we have checked against a reference.
_SUPPORTED_TYPES = frozenset({
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
})  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class _PlannedTensor:
    name: str  # Hugging Face name
    tensor: GGUFTensor
    # Heads whose rows llama.cpp interleaved (Q: attention heads, K: KV heads); None: as stored.
    unpermute_heads: int | None


def load_gguf(path: Path) -> Checkpoint:
    """Open a GGUF checkpoint: read its config and tokenizer, plan (not read) its tensors."""
    gguf = read_gguf(path)
    meta = GGUFMetadata(gguf)
    config = _config_from_metadata(meta, gguf.tensors)
    plan = [_plan_tensor(t, config) for t in gguf.tensors]
    shapes = {p.name: _torch_shape(p.tensor) for p in plan}
    check_shapes(shapes, config, path)
    tokenizer = Tokenizer.from_gguf(gguf)
    return Checkpoint(
        path,
        config,
        tokenizer,
        shapes,
        partial(_read_tensors, tuple(plan)),
        partial(_read_blocks, tuple(plan)),
        {p.name: p.tensor.tensor_type.name for p in plan},
    )


def _config_from_metadata(meta: GGUFMetadata, tensors: list[GGUFTensor]) -> ModelConfig:
    arch = meta.string("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    if meta.integer(f"{arch}.expert_count"):
        raise UnsupportedModelError(f"mixture-of-experts GGUF ({arch}) is not supported")
    scaling = meta.string(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF RoPE scaling {scaling!r} is not supported yet")

    def required(key: str) -> int:
        value = meta.integer(f"{arch}.{key}")
        if value is None or value <= 0:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    names = {t.name for t in tensors}
    embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
    vocab_size = meta.integer(f"{arch}.vocab_size")
    if vocab_size is None and embedding is not None:
        vocab_size = _torch_shape(embedding)[0]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size or 0,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_layers=required("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.integer(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=meta.integer(f"{arch}.attention.key_length") or hidden // num_heads,
        # Stored as float32; kept as read so it equals what transformers' GGUF path uses.
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5,
        rope_theta=meta.number(f"{arch}.rope.freq_base") or 10000.0,
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
    )


def _plan_tensor(tensor: GGUFTensor, config: ModelConfig) -> _PlannedTensor:
    if tensor.tensor_type not in _SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which is not supported"
        )
    if tensor.name in _GLOBAL_NAMES:
        return _PlannedTensor(_GLOBAL_NAMES[tensor.name], tensor, None)
    if tensor.name == "rope_freqs.weight":
        raise UnsupportedModelError("GGUF has rope_freqs (Llama 3 RoPE scaling), not supported yet")
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {tensor.name} is not part of a Llama layer")
    layer, kind, param = match.groups()
    heads = None
    if config.architecture in _PERMUTED_QK and param == "weight":
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(kind)
    return _PlannedTensor(f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{param}", tensor, heads)


def _torch_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first (ne0 = row length); torch lists rows first.
    return tuple(reversed(tensor.shape))


def _read_tensors(plan: tuple[_PlannedTensor, ...], wanted: Callable[[str], bool]) -> NamedTensors:
    for planned in plan:
        if wanted(planned.name):
            yield planned.name, _dequantize(planned)


def _read_blocks(plan: tuple[_PlannedTensor, ...], wanted: Callable[[str], bool]) -> NamedTensors:
    for planned in plan:
        if not wanted(planned.name):
            continue
        tensor = planned.tensor
        # (rows, bytes of a row's blocks), copied out of the read-only memory map.
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C"))
        if planned.unpermute_heads is not None:
            # A row's blocks move with it: the permutation is of whole rows.
            blocks = _unpermute_rows(blocks, planned.unpermute_heads)
        yield planned.name, blocks


def _dequantize(planned: _PlannedTensor) -> torch.Tensor:
    tensor = planned.tensor
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    array = array.reshape(_torch_shape(tensor))
    if not array.flags.writeable or not array.flags.c_contiguous:
        # F32 data is a view of the read-only memory map; copy so the tensor owns its memory.
        array = np.array(array, dtype=np.float32, order="C")
    weight = torch.from_numpy(array)
    if planned.unpermute_heads is not None:
        weight = _unpermute_rows(weight, planned.unpermute_heads)
    return weight


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head it interleaves the two rotate-half
    halves (rows 0, d/2, 1, d/2+1, ...); Hugging Face keeps the halves apart."""
    rows, *rest = weight.shape
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )
