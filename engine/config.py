"""Engine settings: one object, checked once, passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_QUANTIZATIONS = ("auto", "none", "int8", "q4_1")
# The KV cache's element type, by vLLM's names: "auto" is the model's dtype; "fp8" is
# float8_e4m3fn (engine/model/kv_quant.py), half of bf16's bytes.
KV_CACHE_DTYPES = ("auto", "fp8")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True, slots=True)
class WeightsFormat:
    """How a loaded engine keeps and computes its weights, "auto" resolved: what a node reports,
    since the same file kept otherwise writes other text."""

    dtype: str  # fp32, bf16, fp16
    quantization: str  # none, int8, q4_1
    kv_cache_dtype: str = "auto"  # auto, fp8

    @classmethod
    def of(
        cls, dtype: torch.dtype, quantization: str, kv_cache_dtype: str = "auto"
    ) -> WeightsFormat:
        return cls(_DTYPE_NAMES[dtype], quantization, kv_cache_dtype)

    @property
    def reported_quantization(self) -> str:
        """What a node reports as its quantization: the weights', and an 8-bit KV cache beside
        them (q4_1_kv_fp8), since that writes other text too."""
        if self.kv_cache_dtype == "auto":
            return self.quantization
        return f"{self.quantization}_kv_{self.kv_cache_dtype}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bf16 where the hardware computes in it natively, else fp32
    # Weights kept as "int8" (weight-only, one scale per row; CPU only), as the GGUF's own Q4_1
    # blocks ("q4_1": the linear layers of a Q4_1 GGUF; CPU only) or as `dtype` ("none").
    # auto, where dtype is auto on a CPU: q4_1 for a Q4_1 GGUF on an AVX-512 CPU (its kernels
    # built), else int8 where the CPU lacks native bf16 (it would read fp32), else none.
    quantization: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # KV cache size: on CUDA a share of the free memory, on CPU a fixed budget.
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    num_kv_blocks: int | None = None  # overrides both, for tests and tiny pools
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # a step's tokens: bounds the decodes' inter-token latency
    # A step's tokens while no running request decodes yet (a burst of prompts into an idle
    # engine): no stream waits on that step. None: max_num_batched_tokens.
    max_num_prefill_only_tokens: int | None = 2048
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Once running, a rank that keeps the others waiting this long in a collective or a receive
    # has died or hung; while starting, one silent this long (engine/worker_start.py).
    parallel_step_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(
                f"dtype must be auto or one of {sorted(_DTYPES)}, not {self.dtype!r}"
            )
        if self.quantization not in _QUANTIZATIONS:
            raise InvalidRequestError(
                f"quantization must be one of {list(_QUANTIZATIONS)}, not {self.quantization!r}"
            )
        if self.quantization in ("int8", "q4_1") and self.torch_device().type != "cpu":
            raise InvalidRequestError(f"quantization {self.quantization} runs on CPU only")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                f"not {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidRequestError(
                "block_size, max_num_seqs and max_num_batched_tokens must be >= 1"
            )
        if self.max_num_prefill_only_tokens is not None and self.max_num_prefill_only_tokens < 1:
            raise InvalidRequestError("max_num_prefill_only_tokens must be >= 1 or None")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise InvalidRequestError(
                "tensor_parallel_size and pipeline_parallel_size must be >= 1"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be >= 1")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        device = self.torch_device()
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def weight_quantization(self, keeps_q4_1: bool = False) -> str:
        """How the weights are kept: "none" (as `dtype`), "int8" or "q4_1"; auto resolved.
        `keeps_q4_1`: the checkpoint's projections are Q4_1 blocks this engine's shards can keep,
        and the CPU kernels that read them are built."""
        if self.quantization != "auto":
            return self.quantization
        on_cpu_as_auto = self.dtype == "auto" and self.torch_device().type == "cpu"
        if on_cpu_as_auto and keeps_q4_1 and torch.cpu._is_avx512_supported():
            return "q4_1"
        reads_fp32 = on_cpu_as_auto and not _cpu_has_native_bf16()
        return "int8" if reads_fp32 else "none"


def _cpu_has_native_bf16() -> bool:
    # bf16 matmuls are ~3x faster than fp32 with AVX-512 BF16 or AMX, and slower without.
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
