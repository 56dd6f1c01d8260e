"""The dense matmul under every linear layer: `F.linear`, oneDNN's, or our bf16 GEMV kernel,
whichever is faster for the step.

bf16 on CPU: steps of few tokens take our GEMV kernel (engine/kernels/gemv_cpu.cpp
`bf16_linear`), which streams each weight row once; `F.linear`'s oneDNN GEMM is tiled for many
tokens. How many depends on the CPU (`bf16_gemv_max_tokens`): fixed by its flags where they
settle it, else measured once per process and weight shape, as the fp32 choice below is (so
two bf16 engines on one kind of CPU may round a step differently, as two fp32 ones may).

fp32 on CPU: torch's `F.linear` calls MKL's sgemm (bf16 already runs on oneDNN). On the AMD
EPYC of docs/benchmarks.md (AVX-512, no AMX) a layer's four projections took 0.72-0.79x MKL's
time from 4 to 1,000 tokens on SmolLM2's shapes, while MKL's GEMV won at one token. MKL picks its
code path by CPU vendor and model, so neither wins everywhere: the crossover is measured once
per process and weight shape (`onednn_min_tokens`), as an fp32 model loads on CPU.
fp32 is the dtype of CPUs without AVX-512 BF16 and of the exact-output runs (stream resume),
and the prefill of int8 and block weights dequantizes into it there.

MERIDIAN_MATMUL_CROSSOVER=N skips both measurements: oneDNN from N tokens a step, the bf16 kernel
up to N where the CPU's flags do not settle it. The test suite sets it: the probes cost 1-10 s
per engine start on a busy machine, in every process, and what they would find is not what
those tests test (tests/engine/test_dense_matmul.py measures).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels

logger = logging.getLogger(__name__)

_PROBE_TOKENS = (1, 2, 4, 8, 16, 64, 256)
_GEMV_PROBE_TOKENS = (8, 16, 32, 64)  # the bf16 kernel's: it won at 4 tokens on every CPU here
_GEMV_MIN_TOKENS = 4
_COLD_BYTES = 64 * 2**20  # twice the last-level cache of the AMD EPYC measured here
# F.linear takes the kernel's steps only when clearly faster: a probe's timings move by about this
# much on a busy machine (node agents that load at once probed 4-16 tokens on one shape), and
# where they are that close either path serves.
_GEMV_LOSS = 1.1
_MAX_PROBE_MACS = 2**29  # about 5 ms a product at this CPU's fp32 speed
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# The step size a packed weight's layout is chosen for (oneDNN's hint; any step can use it).
_PACKED_FOR_TOKENS = 32


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T + bias; `weight` plain, or `packed`."""
    if weight.is_mkldnn:
        return _onednn_linear(x, weight, bias)
    if (
        weight.dtype == torch.bfloat16
        and x.dim() == 2
        and (kernels := _kernels_for(x))
        and x.shape[0] <= bf16_gemv_max_tokens(*weight.shape)
    ):
        out = kernels.bf16_linear(x.contiguous(), weight)
        return out if bias is None else out + bias
    if _ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu":
        min_tokens = onednn_min_tokens(*weight.shape)
        if min_tokens is not None and x.numel() >= min_tokens * x.shape[-1]:
            return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def packed(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight kept for many CPU steps, in the blocked layout oneDNN's GEMM reads: given
    the plain one, it reorders the weight on every call (on AMX, 0.07 of a 0.16 ms product of 26
    tokens by a 1536x576 weight). Other weights as they are; `dense_linear` takes both."""
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and packs_bf16():
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_TOKENS)
    return weight


@functools.cache
def packs_bf16() -> bool:
    """Whether `packed` packs bf16 weights: where oneDNN multiplies bf16 on this CPU (AVX-512
    BW/VL/DQ or AMX); elsewhere F.linear keeps its own bf16 path."""
    return _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _kernels_for(x: torch.Tensor) -> ModuleType | None:
    return cpu_kernels() if x.device.type == "cpu" else None


@functools.cache
def bf16_gemv_max_tokens(out_features: int, in_features: int) -> int:
    """bf16 steps of up to this many tokens take the GEMV kernel on a weight of this shape.

    With AMX tiles (a Sapphire Rapids) oneDNN's GEMM overtook it from 8 tokens (1.1x its time
    there), and without AVX-512 BF16 bf16 is not the engine's dtype (the kernel's portable loop
    keeps the few tokens it was built for): 4 on both. With AVX-512 BF16 alone (an AMD EPYC)
    the crossover moved between sessions on one kind of CPU: the kernel took 0.55-0.95x
    F.linear's time on every shape of SmolLM2 up to 64 tokens on one day, 1.1-1.8x at 32 and
    1.6-2.2x at 64 on another (bench/linear_small_m.py, docs/benchmarks.md). So there it is
    measured: the largest probe up to which the kernel lost to F.linear at no probe by more
    than 10%, 4 at least. Probes stop where they would cost more than a few milliseconds (the
    LM head's steps multiply few rows)."""
    kernels = cpu_kernels()
    if (
        kernels is None
        or torch.cpu._is_amx_tile_supported()
        or not torch.cpu._is_avx512_bf16_supported()
    ):
        return _GEMV_MIN_TOKENS
    if (pinned := pinned_crossover()) is not None:
        return pinned
    # A step reads its weights from memory, not from a cache that one repeated call keeps warm
    # (warm, F.linear won from 8 tokens on three of SmolLM2's shapes where, cold, the kernel
    # won to 16): each call reads the next of enough copies to pass the caches. Ones, not
    # zeros: untouched zeroed pages may all map one page. The values do not change the time.
    numel = out_features * in_features
    copies = [
        torch.ones(out_features, in_features, dtype=torch.bfloat16)
        for _ in range(max(1, _COLD_BYTES // (2 * numel)))
    ]
    most = _GEMV_MIN_TOKENS
    for num_tokens in _GEMV_PROBE_TOKENS:
        if num_tokens * numel > _MAX_PROBE_MACS:
            break
        x = torch.randn(num_tokens, in_features, dtype=torch.bfloat16)
        kernel_s = median_s(_cycling(kernels.bf16_linear, x, copies))
        if kernel_s > _GEMV_LOSS * median_s(_cycling(F.linear, x, copies)):
            break
        most = num_tokens
    return most


def _cycling(
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
) -> Callable[[], object]:
    """A call of `linear` on x and the next of `weights` each time."""
    calls = itertools.cycle(functools.partial(linear, x, w) for w in weights)
    return lambda: next(calls)()


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_min_tokens(out_features: int, in_features: int) -> int | None:
    """The fewest tokens from which oneDNN's fp32 matmul beats `F.linear` at every probe on a
    weight of this shape on this CPU; None where it never does. Probes stop where they would
    cost more than a few milliseconds (the LM head: its steps multiply few rows)."""
    if (pinned := pinned_crossover()) is not None:
        return pinned
    weight = torch.zeros(out_features, in_features)  # values do not change the time
    probes = [n for n in _PROBE_TOKENS if n * weight.numel() <= _MAX_PROBE_MACS] or [1]
    wins = []
    for num_tokens in probes:
        x = torch.randn(num_tokens, in_features)
        mkl_s = median_s(functools.partial(F.linear, x, weight))
        wins.append(median_s(functools.partial(_onednn_linear, x, weight)) < mkl_s)
    # The smallest probe after which oneDNN loses no more; the last probe's verdict holds above.
    losses = [i for i, won in enumerate(wins) if not won]
    first = losses[-1] + 1 if losses else 0
    min_tokens = probes[first] if first < len(probes) else None
    logger.info(
        "fp32 matmuls of %dx%d: %s",
        out_features,
        in_features,
        "MKL (oneDNN was never faster)"
        if min_tokens is None
        else f"oneDNN from {min_tokens} tokens a step, MKL below",
    )
    return min_tokens


def pinned_crossover() -> int | None:
    """MERIDIAN_MATMUL_CROSSOVER as a number of tokens, or None where it is unset."""
    value = os.environ.get("MERIDIAN_MATMUL_CROSSOVER", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"MERIDIAN_MATMUL_CROSSOVER must be a number of tokens (1 or more), not {value!r}"
        )
    return int(value)


def median_s(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
