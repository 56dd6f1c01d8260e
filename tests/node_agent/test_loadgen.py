"""The seeded workload and the load generator (against a node agent over the fake engine, with
the fake's tokenizer: fake_engine.py)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import byte_tokenizer
from node_helpers import MODEL_NAME, NodeHandle

from bench.loadgen import format_table, percentile, run_level
from bench.workload import make_workload


def test_workload_is_seeded_and_sized_with_the_tokenizer() -> None:
    tokenizer = byte_tokenizer()
    workload = make_workload(40, seed=7, tokenizer=tokenizer)
    assert workload == make_workload(40, seed=7, tokenizer=tokenizer)
    assert workload != make_workload(40, seed=8, tokenizer=tokenizer)
    for request in workload:
        assert 32 - 8 <= request.num_prompt_tokens <= 512
        assert 16 <= request.max_tokens <= 256
        rendered = tokenizer.render_chat(list(request.messages))
        assert tuple(tokenizer.encode(rendered)) == request.prompt_token_ids
    # Lengths fill the whole range rather than clustering at one end.
    lengths = sorted(r.num_prompt_tokens for r in workload)
    assert lengths[0] < 150 and lengths[-1] > 400


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_loadgen_reports_throughput_and_latency(node: NodeHandle) -> None:
    workload = make_workload(4, 0, byte_tokenizer(), prompt_tokens=(60, 90), output_tokens=(4, 8))
    summary = asyncio.run(
        run_level(node.base_url, MODEL_NAME, "unused", workload, concurrency=2, quiet=True)
    )
    assert summary.num_errors == 0, summary.errors
    assert summary.num_output_tokens == sum(r.max_tokens for r in workload)  # ignore_eos honoured
    assert summary.output_tokens_per_s > 0
    assert summary.ttft_p50_s is not None and summary.itl_p99_s is not None
    assert "out tok/s" in format_table([summary], None)
