"""Node classes, and a GPU-class calibration from published figures (not a measurement).

`GPU_CLASS_CALIBRATION` is Llama 3.1 8B in BF16 on one H100 SXM, worked out from published
figures with stated assumptions; nobody ran it:
- weights: 8.03 B parameters x 2 bytes = 16.1 GB; KV cache per token: 2 (K, V) x 32 layers x
  8 KV heads x 128 dims x 2 bytes = 128 KiB (the model's published configuration);
- H100 SXM: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB (NVIDIA's datasheet);
- prefill: 2 FLOPs per parameter per token (16.1 GFLOP) at an assumed 50% of peak: 30,700 tokens/s;
- a decode step at batch 1 reads the weights once: 16.1 GB at an assumed 80% of peak bandwidth,
  6.0 ms; at batch 256 a step of ~20 ms (published vLLM throughput for this model on one H100:
  ~12,500 output tokens/s), so 0.055 ms more per sequence;
- KV blocks: vLLM's default 90% of memory, less the weights and ~2 GB of activations: 53.9 GB /
  128 KiB = 411,000 tokens, 25,700 blocks of 16; vLLM's default `max_num_seqs` 256 and chunked
  prefill's token budget 2,048.

`NODE_CLASSES` scale a world's calibration to slower hardware by the same published peaks
(A100 SXM 80 GB: 312 TFLOPS BF16, 2.04 TB/s; L40S: 362 TFLOPS BF16, 0.864 TB/s, 48 GB): prefill
by the ratio of TFLOPS, step times by the inverse ratio of bandwidth, KV blocks by the memory
left after the weights. With the CPU calibration they are three CPU boxes at those ratios.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from simulator.calibration import ServiceCalibration

H100_BF16_TFLOPS: Final = 989.0
H100_TB_S: Final = 3.35
WEIGHTS_AND_REST_GB: Final = 16.1 + 2.0  # the weights, and ~2 GB of activations and the rest
# GB of KV cache left on an 80 GB card at 90% use (48 GB for an L40S).
H100_KV_GB: Final = 80.0 * 0.9 - WEIGHTS_AND_REST_GB
L40S_KV_GB: Final = 48.0 * 0.9 - WEIGHTS_AND_REST_GB

GPU_CLASS_CALIBRATION: Final = ServiceCalibration(
    prefill_tokens_per_s=30700.0,
    step_base_s=0.0060,
    step_per_seq_s=0.000055,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    kv_blocks=25700,
)


@dataclass(frozen=True, slots=True)
class NodeClass:
    """Hardware relative to the world's calibration (which is the fastest class's)."""

    name: str
    prefill: float  # prefill rate, times the world's
    step: float  # decode step time, times the world's
    kv: float  # KV blocks, times the world's

    def of(self, base: ServiceCalibration) -> ServiceCalibration:
        return base.scaled(self.prefill, self.step, self.kv)


NODE_CLASSES: Final[Mapping[str, NodeClass]] = {
    c.name: c
    for c in (
        NodeClass("h100", 1.0, 1.0, 1.0),
        NodeClass("a100", 312.0 / H100_BF16_TFLOPS, H100_TB_S / 2.04, 1.0),
        NodeClass("l40s", 362.0 / H100_BF16_TFLOPS, H100_TB_S / 0.864, L40S_KV_GB / H100_KV_GB),
    )
}
