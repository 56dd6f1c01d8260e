"""The prefix cache's events, from the recorder up through a real engine: on its thread and in its
own process, a watcher that follows them holds exactly what the cache holds."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from tiny_checkpoints import TINY_VOCAB, save_tiny_transformers_model

from engine.async_engine import AsyncEngine
from engine.async_llm import AsyncLLM
from engine.cache_events import CacheEventRecorder, CacheEvents
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.kv_cache_manager import chain_root, hash_block
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
# Small enough that the workload below evicts: 24 blocks of 4 tokens, prompts of 20-40 tokens.
NUM_KV_BLOCKS = 24


def test_the_recorder_nets_a_turns_changes() -> None:
    recorder = CacheEventRecorder()
    assert recorder.take() is None
    recorder.stored(b"a")
    recorder.removed(b"a")  # stored and gone within the turn: nobody needs to hear of it
    recorder.removed(b"b")
    recorder.stored(b"b")  # held before and after
    recorder.stored(b"c")
    recorder.removed(b"d")
    assert recorder.take() == CacheEvents((b"c",), (b"d",))
    assert recorder.take() is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_transformers_model(folder, "llama")
    return folder


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(
        str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )


class Mirror:
    """What a watcher believes the cache holds."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.num_snapshots = 0
        self.num_removed = 0

    def apply(self, events: CacheEvents) -> None:
        if events.is_snapshot:
            self.held = set(events.stored)
            self.num_snapshots += 1
            return
        assert set(events.removed) <= self.held and not set(events.stored) & self.held
        self.held -= set(events.removed)
        self.held |= set(events.stored)
        self.num_removed += len(events.removed)


def prompts(seed: int) -> list[tuple[list[int], str | None]]:
    """Tenants' prompts: shared system parts (some salted), each with its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(TINY_VOCAB - 3) for _ in range(16)] for _ in range(3)]
    out = []
    for index in range(12):
        system = systems[index % 3]
        question = [rng.randrange(TINY_VOCAB - 3) for _ in range(rng.randrange(4, 24))]
        out.append((system + question, f"tenant-{index % 2}" if index % 3 == 0 else None))
    return out


async def run_workload(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(index: int, prompt: list[int], salt: str | None) -> None:
        async for _ in engine.generate(prompt, params, f"r{index}", cache_salt=salt):
            pass

    for start in range(0, 12, 3):  # three at a time, so that they share and evict
        batch = prompts(0)[start : start + 3]
        await asyncio.gather(*(one(start + i, p, s) for i, (p, s) in enumerate(batch)))


async def until_idle(engine: AsyncEngine) -> None:
    """The core's last turn, and its events, have reached this side."""
    for _ in range(500):
        if engine.stats().num_running == 0:
            return
        await asyncio.sleep(0.01)


def test_a_watcher_of_the_engine_holds_exactly_its_prefix_cache(tiny_model: Path) -> None:
    async def scenario() -> None:
        llm = AsyncLLM.from_config(engine_config(tiny_model))
        llm.start()
        mirror = Mirror()
        try:
            llm.watch_cache(mirror.apply)
            await run_workload(llm)
            await until_idle(llm)
            kv = llm.engine.scheduler.kv_cache
            actual = {b.block_hash for b in kv.blocks if b.block_hash is not None}
            assert mirror.held == actual
            assert mirror.num_snapshots == 1 and mirror.num_removed > 0  # it did evict
            # The hashes are the scheduler's own chain, salted: the last batch's first prompt's
            # first block (nothing evicted it since).
            prompt, salt = prompts(0)[9]
            assert salt is not None
            assert hash_block(chain_root(salt), prompt[:BLOCK_SIZE]) in actual
        finally:
            await llm.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow  # starts the engine core's process
def test_events_cross_the_core_process_and_a_new_watch_starts_with_the_truth(
    tiny_model: Path,
) -> None:
    async def scenario() -> None:
        client = EngineCoreClient.from_config(engine_config(tiny_model))
        client.start()
        first, second = Mirror(), Mirror()
        try:
            client.watch_cache(first.apply)
            await run_workload(client)
            await until_idle(client)
            assert first.num_removed > 0
            followed = set(first.held)
            # A second watcher: the core sends both a snapshot of what it holds now.
            client.watch_cache(second.apply)
            for _ in range(500):
                if second.num_snapshots:
                    break
                await asyncio.sleep(0.01)
            assert first.num_snapshots == 2
            assert second.held == followed and followed
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_nothing_is_recorded_while_nobody_watches(tiny_model: Path) -> None:
    async def scenario() -> None:
        llm = AsyncLLM.from_config(engine_config(tiny_model))
        llm.start()
        try:
            await run_workload(llm)
            assert llm.engine.scheduler.kv_cache._events is None
            assert llm.engine.take_cache_events() is None
        finally:
            await llm.shutdown()

    asyncio.run(scenario())
