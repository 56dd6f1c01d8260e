"""A step's sampled tokens into outputs (engine/output_processor.py), on a real scheduler and
block pool with a tiny byte-level tokenizer: stop checks, finishing, aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_checkpoints import write_tiny_tokenizer

from engine.executor import StepOutput
from engine.kv_cache_manager import KVCacheManager
from engine.output_processor import OutputProcessor
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(), KVCacheManager(NUM_BLOCKS, block_size=4))


@pytest.fixture
def processor(scheduler: Scheduler, tokenizer: Tokenizer) -> OutputProcessor:
    return OutputProcessor(scheduler, tokenizer, max_model_len=32)


def prefilled(
    processor: OutputProcessor, scheduler: Scheduler, request_id: str, params: SamplingParams
) -> Sequence:
    """A request whose prompt has just been computed: its next token is due."""
    seq = Sequence(request_id, [1, 2, 3], params, max_tokens=params.max_tokens or 29)
    processor.add(seq, None)
    scheduler.add(seq)
    scheduler.update_after_step(scheduler.schedule())
    return seq


def sampled(tokenizer: Tokenizer, *pairs: tuple[Sequence, str]) -> StepOutput:
    token_ids = [tokenizer.encode(text)[0] for _, text in pairs]
    return StepOutput([seq for seq, _ in pairs], SamplerOutput(token_ids, [None] * len(pairs)))


def test_a_stop_string_finishes_the_request_and_gives_its_blocks_back(
    processor: OutputProcessor, scheduler: Scheduler, tokenizer: Tokenizer
) -> None:
    seq = prefilled(processor, scheduler, "a", SamplingParams(stop=["yz"]))
    [held] = processor.process(sampled(tokenizer, (seq, "y")), now=1.0)
    # The tail that could still become the stop string is held back.
    assert (held.finished, held.outputs[0].text) == (False, "")
    [done] = processor.process(sampled(tokenizer, (seq, "z")), now=2.0)
    assert done.finished and done.metrics.finished_time == 2.0
    completion = done.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("", "stop", "yz")
    assert not processor.requests and not scheduler.running
    assert scheduler.kv_cache.num_free_blocks == NUM_BLOCKS


def test_max_tokens_and_the_eos_token_finish_with_their_reasons(
    processor: OutputProcessor, scheduler: Scheduler, tokenizer: Tokenizer
) -> None:
    short = prefilled(processor, scheduler, "short", SamplingParams(max_tokens=1))
    eos = prefilled(processor, scheduler, "eos", SamplingParams())
    outputs = processor.process(sampled(tokenizer, (short, "x"), (eos, "</s>")), now=1.0)
    reasons = {o.request_id: (o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs}
    assert reasons == {"short": ("length", "x"), "eos": ("stop", "")}
    assert not processor.requests


def test_a_request_aborted_while_its_batch_is_in_flight_is_skipped(
    processor: OutputProcessor, scheduler: Scheduler, tokenizer: Tokenizer
) -> None:
    seq = prefilled(processor, scheduler, "gone", SamplingParams())
    [aborted] = processor.abort(["gone", "unknown"], now=1.0)
    assert (aborted.finished, aborted.outputs[0].finish_reason) == (True, "abort")
    assert processor.process(sampled(tokenizer, (seq, "x")), now=2.0) == []
    assert seq.output_token_ids == []
