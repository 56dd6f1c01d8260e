"""Tensor parallelism on CPU with gloo: the same tokens as one process, loud failures, and no
process left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tiny_checkpoints import save_tiny_transformers_model

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError, UnsupportedModelError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def worker_pids(llm: LLM) -> list[int]:
    workers = llm.engine.executor.workers
    assert workers is not None
    return [p.pid for p in workers.processes if p.pid is not None]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


PROMPTS = [[5, 17, 40, 2, 9, 33, 61], [70, 12, 3, 3, 3, 44, 18, 90, 21, 8, 11, 30], [50, 51]]


@pytest.mark.parametrize(
    ("family", "tp_size", "overrides"),
    [
        ("llama", 2, {}),
        ("llama", 4, {}),  # 2 KV heads on 4 ranks: each KV head replicated on two
        ("qwen2", 2, {}),  # biases on Q, K, V are split with their rows
        ("llama", 4, {"num_key_value_heads": 4, "vocab_size": 98}),  # a padded vocabulary shard
    ],
)
def test_tp_greedy_equals_one_process(
    tmp_path: Path, family: str, tp_size: int, overrides: dict[str, int]
) -> None:
    save_tiny_transformers_model(tmp_path, family, **overrides)
    single = greedy_tokens(LLM(str(tmp_path), dtype="float32"), PROMPTS)
    parallel = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=tp_size)
    pids = worker_pids(parallel)
    assert len(pids) == tp_size - 1
    try:
        assert greedy_tokens(parallel, PROMPTS) == single
    finally:
        parallel.shutdown()
    assert_gone(pids)


def test_tp3_on_the_real_model_equals_one_process(smollm2_gguf: Path) -> None:
    single = LLM(str(smollm2_gguf), dtype="float32")
    tokenizer = single.get_tokenizer()
    prompts = [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}]))
        for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    expected = greedy_tokens(single, prompts)
    parallel = LLM(str(smollm2_gguf), dtype="float32", tensor_parallel_size=3)
    try:
        assert greedy_tokens(parallel, prompts) == expected
    finally:
        parallel.shutdown()


def test_a_size_that_does_not_split_the_heads_names_the_valid_ones(smollm2_gguf: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"valid sizes: \[1, 3, 9\]"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2)


def test_a_killed_worker_fails_the_pending_request_within_seconds(tmp_path: Path) -> None:
    save_tiny_transformers_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2)
    pids = worker_pids(llm)
    engine = llm.engine
    engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel"):
        for _ in range(200):
            engine.step()
    assert time.monotonic() - started < 5
    llm.shutdown()
    assert_gone(pids)
