"""The decoder's forward under `torch.compile` (inductor, CPU), for bench/engine_step.py's
`compile` variants: torch.compile measured against our fused C++ layer ops, in one process.

Dynamo cannot trace into a pybind call, so each C++ kernel the forward calls is registered here
as a torch custom op (namespace `meridian`) with a fake impl that gives its output's shape; while
a variant's `kernel_ops` context is active, the engine's kernel lookups answer with those ops
instead of the pybind module, and a decode step's whole forward is one graph. Two variants:
- `compile`: the layer ops (residual add + RMSNorm, RoPE + KV write, SiLU * up) run their eager
  PyTorch twins, which inductor fuses into loops of its own; the matmuls (bf16 GEMV, Q4_1/Q8_0
  block kernels) and the paged decode attention stay our kernels, as opaque ops;
- `compile-fused`: every kernel, the fused layer ops too, stays ours: compile only removes the
  Python between them.
Steps with a prefill chunk run eagerly, as CUDA graphs do: only decode steps are compiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType, SimpleNamespace
from unittest import mock

import torch
from torch import Tensor

from engine.kernels import cpu_kernels
from engine.model.attention import AttentionMetadata
from engine.model.layer_ops import RotaryEmbedding
from engine.model.llama import FusedLayers, LlamaForCausalLM


def _native() -> ModuleType:
    kernels = cpu_kernels()
    assert kernels is not None, "the compile variants need the CPU kernels"
    return kernels


# Schemas are inferred from the hints, which `from __future__ import annotations` keeps as
# strings: torch.library resolves them in this module's globals (hence `Tensor` imported).
@torch.library.custom_op("meridian::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    return _native().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


@torch.library.custom_op("meridian::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _native().rms_norm(x, weight, eps)


@torch.library.custom_op("meridian::add_rms_norm", mutates_args=("residual",))
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _native().add_rms_norm(x, residual, weight, eps)


@torch.library.custom_op("meridian::rope_and_write_kv", mutates_args=("qkv", "k_cache", "v_cache"))
def rope_and_write_kv(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    _native().rope_and_write_kv(
        qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
    )


@torch.library.custom_op("meridian::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: Tensor) -> Tensor:
    return _native().silu_and_mul(gate_up)


@torch.library.custom_op("meridian::bf16_linear", mutates_args=())
def bf16_linear(x: Tensor, weight: Tensor) -> Tensor:
    return _native().bf16_linear(x, weight)


@torch.library.custom_op("meridian::q4_1_linear", mutates_args=())
def q4_1_linear(x: Tensor, blocks: Tensor) -> Tensor:
    return _native().q4_1_linear(x, blocks)


@torch.library.custom_op("meridian::q8_0_linear", mutates_args=())
def q8_0_linear(x: Tensor, blocks: Tensor) -> Tensor:
    return _native().q8_0_linear(x, blocks)


@torch.library.custom_op("meridian::q4_1_dequantize", mutates_args=())
def q4_1_dequantize(blocks: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    return _native().q4_1_dequantize(blocks, in_features, dtype)


@torch.library.custom_op("meridian::q8_0_dequantize", mutates_args=())
def q8_0_dequantize(blocks: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    return _native().q8_0_dequantize(blocks, in_features, dtype)


def _same_rows(x: Tensor, *_: object) -> Tensor:
    return torch.empty_like(x)


def _matmul_rows(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _dequantized(blocks: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    return blocks.new_empty(blocks.shape[0], in_features, dtype=dtype)


for _op in (paged_decode_attention, rms_norm, add_rms_norm):
    _op.register_fake(_same_rows)
rope_and_write_kv.register_fake(lambda *_: None)
silu_and_mul.register_fake(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
for _op in (bf16_linear, q4_1_linear, q8_0_linear):
    _op.register_fake(_matmul_rows)
for _op in (q4_1_dequantize, q8_0_dequantize):
    _op.register_fake(_dequantized)

_MATMULS = SimpleNamespace(
    bf16_linear=torch.ops.meridian.bf16_linear,
    q4_1_linear=torch.ops.meridian.q4_1_linear,
    q8_0_linear=torch.ops.meridian.q8_0_linear,
    q4_1_dequantize=torch.ops.meridian.q4_1_dequantize,
    q8_0_dequantize=torch.ops.meridian.q8_0_dequantize,
)
_LAYER_OPS = SimpleNamespace(
    rms_norm=torch.ops.meridian.rms_norm,
    add_rms_norm=torch.ops.meridian.add_rms_norm,
    rope_and_write_kv=torch.ops.meridian.rope_and_write_kv,
    silu_and_mul=torch.ops.meridian.silu_and_mul,
)


# The lookups' stand-ins are module-level functions, not lambdas made per context: Dynamo
# guards on the identity of the globals it traced through, and a new object means a recompile.
def _fused_layer_ops(x: Tensor) -> SimpleNamespace:
    return _LAYER_OPS


def _eager_layer_ops(x: Tensor) -> None:
    return None


def _matmuls_for(x: Tensor) -> SimpleNamespace:
    return _MATMULS


def _matmuls() -> SimpleNamespace:
    return _MATMULS


def _decode_kernel(device: torch.device) -> object:
    return torch.ops.meridian.paged_decode_attention


@contextmanager
def kernel_ops(fused_layer_ops: bool) -> Iterator[None]:
    """While active, the model's kernel lookups answer with the custom ops; the layer ops with
    theirs where `fused_layer_ops`, else with None (their eager twins)."""
    with ExitStack() as stack:
        for target, value in (
            (
                "engine.model.layer_ops._kernels_for",
                _fused_layer_ops if fused_layer_ops else _eager_layer_ops,
            ),
            ("engine.model.dense_matmul._kernels_for", _matmuls_for),
            ("engine.model.block_weights.cpu_kernels", _matmuls),
            ("engine.model.attention.paged_decode_kernel", _decode_kernel),
        ):
            stack.enter_context(mock.patch(target, value))
        yield


def compile_decodes(model: LlamaForCausalLM) -> None:
    """Compile `model`'s forward for decode-only steps (dynamic in the batch and the block
    tables' width); steps with a prefill chunk keep the eager forward. Give each layer's K and
    V a tensor of its own first: views of one cache tensor are aliased graph inputs, whose
    mutation (the KV write) compiles into copies (bench/engine_step.py does)."""
    eager = model.forward
    compiled = torch.compile(eager, dynamic=True)

    def forward(
        input_ids: Tensor,
        positions: Tensor,
        rope: RotaryEmbedding,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        hidden: Tensor | None = None,
        fused_layers: FusedLayers | None = None,  # None: engine_step turns the fused call off
    ) -> Tensor:
        step = eager if meta.prefills else compiled
        return step(input_ids, positions, rope, kv_caches, meta, hidden, fused_layers)

    model.forward = forward  # type: ignore[method-assign]


def compile_stats() -> dict[str, int]:
    """Dynamo's counts so far: graphs compiled, recompiles, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(counters["graph_break"].values()),
    }
