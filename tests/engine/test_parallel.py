"""Tensor and pipeline parallelism on CPU with gloo: the same tokens as one process, loud
failures, and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from real_model import KV_CACHE_GIB
from suite_env import child_env
from tiny_checkpoints import save_tiny_transformers_model

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError, UnsupportedModelError
from engine.loader import Checkpoint
from engine.model.block_weights import BlockWeight
from engine.model.parallel_layers import RowParallelLinear
from engine.pipeline import stage_layers

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
        ("qwen2", 2, {}),  # biases on Q, K, V are split with their rows; a tied LM head
        # 2 KV heads on 4 ranks (each replicated on two), an untied LM head and a padded
        # vocabulary shard (98 rows over 4 ranks)
        ("llama", 4, {"vocab_size": 98}),
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


@pytest.fixture(scope="module")
def real_prompts(smollm2_checkpoint: Checkpoint) -> list[list[int]]:
    tokenizer = smollm2_checkpoint.tokenizer
    return [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}]))
        for q in ("What is the capital of France?", "Write a haiku about the sea.", "Hi!")
    ]


# The real model as nodes serve it: Q4_1 weights, kept in their blocks on each rank.
REAL = {"dtype": "float32", "quantization": "q4_1", "cpu_kv_cache_gib": KV_CACHE_GIB}


@pytest.fixture(scope="module")
def one_process_tokens(smollm2_gguf: Path, real_prompts: list[list[int]]) -> list[list[int]]:
    """The real model's greedy tokens in one process: what TP and PP must equal."""
    single = LLM(str(smollm2_gguf), **REAL)
    try:
        return greedy_tokens(single, real_prompts)
    finally:
        single.shutdown()


def test_tp3_on_the_real_model_equals_one_process(
    smollm2_gguf: Path, real_prompts: list[list[int]], one_process_tokens: list[list[int]]
) -> None:
    """TP 3 (SmolLM2's 9 heads): the ranks keep Q4_1 blocks in row-parallel shards of 192 and
    512 input columns (whole blocks)."""
    parallel = LLM(str(smollm2_gguf), tensor_parallel_size=3, **REAL)
    try:
        model = parallel.engine.executor.runner.model
        [down] = [m for m in model.modules() if isinstance(m, RowParallelLinear)][1:2]
        assert isinstance(down.quantized, BlockWeight)  # layer 0's down_proj, after its o_proj
        assert down.quantized.in_features == 1536 // 3
        assert greedy_tokens(parallel, real_prompts) == one_process_tokens
    finally:
        parallel.shutdown()


def test_a_size_that_does_not_split_the_heads_names_the_valid_ones(smollm2_gguf: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"valid sizes: \[1, 3, 9\]"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("family", "tp_size", "pp_size", "overrides"),
    [
        ("qwen2", 1, 2, {}),  # a tied head: the last stage holds the embedding too
        # a middle stage (stages of 1, 2 and 2 layers), an untied LM head on the last
        ("llama", 1, 3, {"num_hidden_layers": 5}),
        ("llama", 2, 2, {}),  # composed: 2 stages of 2 TP ranks
    ],
)
def test_pp_greedy_equals_one_process(
    tmp_path: Path, family: str, tp_size: int, pp_size: int, overrides: dict[str, int]
) -> None:
    save_tiny_transformers_model(tmp_path, family, **overrides)
    single = greedy_tokens(LLM(str(tmp_path), dtype="float32"), PROMPTS)
    parallel = LLM(
        str(tmp_path), dtype="float32", tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
    )
    pids = worker_pids(parallel)
    assert len(pids) == tp_size * pp_size - 1
    try:
        assert greedy_tokens(parallel, PROMPTS) == single
    finally:
        parallel.shutdown()
    assert_gone(pids)


def test_pp2_on_the_real_model_equals_one_process(
    smollm2_gguf: Path, real_prompts: list[list[int]], one_process_tokens: list[list[int]]
) -> None:
    parallel = LLM(str(smollm2_gguf), pipeline_parallel_size=2, **REAL)
    try:
        runner = parallel.engine.executor.runner
        assert len(runner.model.layers) == 19  # the first stage: no LM head, more layers
        assert runner.model.norm is None
        assert greedy_tokens(parallel, real_prompts) == one_process_tokens
    finally:
        parallel.shutdown()


def test_more_stages_than_layers_is_refused(smollm2_gguf: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="between 1 and the model's 30 layers"):
        LLM(str(smollm2_gguf), pipeline_parallel_size=31)


@pytest.mark.parametrize(
    ("pp_size", "sizes"), [(1, [30]), (2, [19, 11]), (4, [9, 9, 10, 2]), (30, [1] * 30)]
)
def test_stages_hold_contiguous_runs_balanced_with_the_lm_head(
    smollm2_checkpoint: Checkpoint, pp_size: int, sizes: list[int]
) -> None:
    # SmolLM2's LM head (49152 x 576) weighs as much as 8 of its layers.
    stages = [stage_layers(smollm2_checkpoint.config, pp_size, s) for s in range(pp_size)]
    assert [len(s) for s in stages] == sizes
    assert [i for s in stages for i in s] == list(range(30))


def test_a_pipeline_keeps_one_batch_per_stage_in_flight(tmp_path: Path) -> None:
    save_tiny_transformers_model(tmp_path, "llama", num_hidden_layers=3)
    llm = LLM(str(tmp_path), dtype="float32", pipeline_parallel_size=3)
    engine = llm.engine
    try:
        for i, prompt in enumerate([*PROMPTS, [7, 8, 9], [10, 11], [12]]):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        assert engine.step() == [] and engine.step() == []  # filling: nothing comes back yet
        in_flight = [[s.request_id for s in b.batch.seqs] for b in engine.executor.in_flight]
        assert len(in_flight) == 2
        # Even batches of disjoint sequences: 6 requests over 3 stages.
        assert [len(ids) for ids in in_flight] == [2, 2]
        assert not set(in_flight[0]) & set(in_flight[1])
        assert {o.request_id for o in engine.step()} == set(in_flight[0])  # full: collects
        # Aborting a request whose batch is in flight drops its token and frees its blocks.
        engine.abort_request([in_flight[1][0]])
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
        assert in_flight[1][0] not in finished
        assert all(len(tokens) == 8 for tokens in finished.values()) and len(finished) == 5
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("tp_size", "pp_size"), [(2, 1), (1, 2)])
def test_a_killed_worker_fails_the_pending_request_within_seconds(
    tmp_path: Path, tp_size: int, pp_size: int
) -> None:
    save_tiny_transformers_model(tmp_path, "llama")
    llm = LLM(
        str(tmp_path), dtype="float32", tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
    )
    pids = worker_pids(llm)
    engine = llm.engine
    try:
        engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        os.kill(pids[0], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="parallel worker died: rank 1"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - started < 5
    finally:
        llm.shutdown()  # a failure here must not leave the process group to the next test
    assert_gone(pids)


SCRIPT_TIMEOUT_S = 240  # a start that hangs waits ten minutes for its rendezvous


def run_script(folder: Path, body: str) -> subprocess.CompletedProcess[str]:
    """`python script.py` in a fresh process: the way a user meets spawned workers."""
    script = folder / "script.py"
    script.write_text("from engine import LLM, SamplingParams\n\n" + textwrap.dedent(body))
    env = child_env()
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )


def test_a_script_without_the_main_guard_fails_naming_the_guard(tmp_path: Path) -> None:
    save_tiny_transformers_model(tmp_path / "model", "llama")
    done = run_script(
        tmp_path,
        f"""
        llm = LLM({str(tmp_path / "model")!r}, dtype="float32", tensor_parallel_size=2)
        print("built the engine")
    """,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("engine.errors.WorkerStartupError: parallel worker rank 1"), last
    assert "exited (code 1) while starting" in last
    assert 'Put that code under `if __name__ == "__main__":`' in last
    assert "built the engine" not in done.stdout


def test_the_same_script_with_the_main_guard_runs(tmp_path: Path) -> None:
    save_tiny_transformers_model(tmp_path / "model", "llama")
    done = run_script(
        tmp_path,
        f"""
        if __name__ == "__main__":
            llm = LLM({str(tmp_path / "model")!r}, dtype="float32", tensor_parallel_size=2)
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            [out] = llm.generate({{"prompt_token_ids": [5, 6, 7]}}, params)
            print("tokens:", len(out.outputs[0].token_ids))
            llm.shutdown()
    """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tokens: 3"
