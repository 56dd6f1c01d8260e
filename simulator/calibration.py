"""The node service model's parameters, and how to derive them from a measured engine.

    python -m bench.engine_throughput --json bench/results/engine_throughput.json
    python -m simulator calibrate bench/results/engine_throughput.json [--kv-blocks N] > cal.json
    python -m simulator run --scenario steady --calibration cal.json

From the benchmark's report:
- `step_per_seq_s`, `step_base_s`: a decode step at batch `c` (our engine's concurrency run) is its
  ITL p50; a step at batch 1 is the shared-prefix TTFT with the prefix cached (a step whose
  prefill is a few tokens). The step time is taken to be linear in the batch between the two.
- `prefill_tokens_per_s`: the shared-prefix TTFT without the cache minus with it is the time to
  prefill the part of the system prompt the cache saves (`BENCH_SHARED_PREFIX_TOKENS`).
- `kv_blocks`: the report does not carry it; the benchmark prints it ("KV cache: N blocks").
The defaults are the CPU run recorded in docs/benchmarks.md (2026-11-30, after the pipeline
rework: ITL p50 90 ms at c=32; shared-prefix TTFT 141 ms uncached, 49 ms cached).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

from wire.capacity import DEFAULT_MAX_NUM_WAITING_REQUESTS

# The benchmark's shared system prompt, in tokens, less the part the cached request still
# computes (its last partial block and the question, ~30 tokens): see bench/engine_throughput.py.
BENCH_SHARED_PREFIX_TOKENS: Final = 320


class CalibrationError(ValueError):
    """A benchmark report (or calibration file) that cannot give the model's parameters."""


@dataclass(frozen=True, slots=True)
class ServiceCalibration:
    prefill_tokens_per_s: float = 3478.0  # 320 tokens / (0.141 - 0.049) s
    step_base_s: float = 0.049  # one engine step at batch 1
    step_per_seq_s: float = 0.00132  # (0.090 - 0.049) s / 31 more sequences
    max_num_seqs: int = 64  # engine/config.py
    max_num_batched_tokens: int = 512  # engine/config.py: the token budget of one step
    kv_blocks: int = 2048
    block_size: int = 16
    # Prefixes a node's cache keeps (least recently used go first).
    max_cached_prefixes: int = 32
    max_num_waiting_requests: int = DEFAULT_MAX_NUM_WAITING_REQUESTS  # then 429

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            least = 0.0 if f.name == "step_per_seq_s" else 1e-12  # a flat step time is allowed
            if not is_number or value < least:
                raise CalibrationError(f"calibration {f.name} must be a positive number: {value!r}")

    def scaled(self, prefill: float, step: float, kv: float) -> ServiceCalibration:
        """This node's calibration on hardware `prefill` times as fast at prefill, with steps
        `step` times as long and `kv` times the KV blocks."""
        return replace(
            self,
            prefill_tokens_per_s=self.prefill_tokens_per_s * prefill,
            step_base_s=self.step_base_s * step,
            step_per_seq_s=self.step_per_seq_s * step,
            kv_blocks=max(1, round(self.kv_blocks * kv)),
        )

    def step_s(self, batch_size: int) -> float:
        """One decode step with `batch_size` sequences in it (no prefill)."""
        return self.step_base_s + self.step_per_seq_s * max(0, batch_size - 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ServiceCalibration:
        try:
            values: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"calibration is not JSON: {exc}") from exc
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CalibrationError(f"unknown calibration fields: {', '.join(unknown)}")
        return cls(**values)


def _concurrency_run(report: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    for run in report.get("runs", []):
        match = re.match(r"meridian c=(\d+)", str(run.get("name", "")))
        if match:
            return int(match.group(1)), run
    raise CalibrationError("the report has no 'meridian c=N' run")


def from_bench_report(report: dict[str, Any], kv_blocks: int | None = None) -> ServiceCalibration:
    """The service model of the engine that `python -m bench.engine_throughput` measured."""
    concurrency, run = _concurrency_run(report)
    try:
        itl_s = float(run["itl_p50_s"])
        cached_s = float(report["prefix_cache_ttft_p50_s"]["on"])
        uncached_s = float(report["prefix_cache_ttft_p50_s"]["off"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationError(f"the report lacks {exc}") from exc
    if concurrency < 2 or not 0.0 < cached_s < uncached_s or itl_s <= cached_s:
        raise CalibrationError(
            f"cannot fit a step time to ITL {itl_s} s at c={concurrency} and shared-prefix "
            f"TTFT {cached_s} s cached / {uncached_s} s uncached"
        )
    default = ServiceCalibration()
    return ServiceCalibration(
        prefill_tokens_per_s=round(BENCH_SHARED_PREFIX_TOKENS / (uncached_s - cached_s), 1),
        step_base_s=cached_s,
        step_per_seq_s=round((itl_s - cached_s) / (concurrency - 1), 6),
        kv_blocks=kv_blocks if kv_blocks is not None else default.kv_blocks,
    )


def load_bench_report(path: Path) -> dict[str, Any]:
    try:
        report: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"cannot read {path}: {exc}") from exc
    return report
