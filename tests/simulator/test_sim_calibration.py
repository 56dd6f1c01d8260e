"""Deriving the service model from `python -m bench.engine_throughput --json` output."""

from __future__ import annotations

import pytest

from simulator.calibration import (
    BENCH_SHARED_PREFIX_TOKENS,
    CalibrationError,
    ServiceCalibration,
    from_bench_report,
)

REPORT = {
    "runs": [
        {"name": "transformers sequential", "itl_p50_s": 0.046},
        {"name": "meridian c=32 (torch.bfloat16)", "itl_p50_s": 0.090},
    ],
    "prefix_cache_ttft_p50_s": {"on": 0.049, "off": 0.141},
}


def test_the_fit_goes_through_both_measured_steps() -> None:
    cal = from_bench_report(REPORT, kv_blocks=4096)
    assert cal.step_s(1) == pytest.approx(0.049)
    assert cal.step_s(32) == pytest.approx(0.090, abs=1e-4)
    assert cal.prefill_tokens_per_s == pytest.approx(BENCH_SHARED_PREFIX_TOKENS / 0.092, rel=1e-3)
    assert cal.kv_blocks == 4096


def test_the_defaults_are_the_recorded_cpu_run() -> None:
    cal = from_bench_report(REPORT)
    default = ServiceCalibration()
    assert cal.step_base_s == default.step_base_s
    assert cal.step_per_seq_s == pytest.approx(default.step_per_seq_s, rel=1e-2)
    assert cal.prefill_tokens_per_s == pytest.approx(default.prefill_tokens_per_s, rel=1e-3)


def test_a_calibration_file_round_trips() -> None:
    cal = from_bench_report(REPORT)
    assert ServiceCalibration.from_json(cal.to_json()) == cal


@pytest.mark.parametrize(
    "report",
    [
        {"runs": []},
        {"runs": REPORT["runs"], "prefix_cache_ttft_p50_s": {"on": 0.2, "off": 0.1}},
        {"runs": REPORT["runs"]},
    ],
)
def test_a_report_that_cannot_be_fitted_is_refused(report: dict) -> None:
    with pytest.raises(CalibrationError):
        from_bench_report(report)


def test_unknown_fields_in_a_calibration_file_are_refused() -> None:
    with pytest.raises(CalibrationError, match="prefil_tokens_per_s"):
        ServiceCalibration.from_json('{"prefil_tokens_per_s": 1.0}')


@pytest.mark.parametrize(
    "text",
    ['{"prefill_tokens_per_s": 0}', '{"kv_blocks": -1}', '{"max_num_seqs": "64"}'],
)
def test_a_calibration_value_that_is_not_a_positive_number_is_refused(text: str) -> None:
    with pytest.raises(CalibrationError, match="must be a positive number"):
        ServiceCalibration.from_json(text)
