"""Fixtures for the node agent, whose servers run on a background event loop: a fake engine
(fake_engine.py) and a node over it for every test that is not about the engine's output, and
one real SmolLM2 engine, loaded once and shared, for those that are."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_engine import FakeEngine
from node_helpers import (
    BackgroundLoop,
    FakeNodes,
    NodeHandle,
    start_engine,
    start_fake_engine,
    start_node,
)
from suite_env import clear_settings

from engine.async_engine import AsyncEngine
from engine.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def no_meridian_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide every setting themselves: ignore MERIDIAN_* from the calling shell (but the
    suite's pins, tests/suite_env.py)."""
    clear_settings(monkeypatch)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def shared_llm(smollm2_gguf: Path, server_loop: BackgroundLoop) -> Iterator[AsyncEngine]:
    """The real model, loaded once in an engine core process and started on the servers'
    loop."""
    llm = start_engine(server_loop, smollm2_gguf)
    yield llm
    server_loop.run(llm.shutdown())


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    """The real model's tokenizer alone (no engine)."""
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def real_node(server_loop: BackgroundLoop, shared_llm: AsyncEngine) -> Iterator[NodeHandle]:
    """A node agent with default settings over the shared real engine."""
    handle = start_node(server_loop, shared_llm)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def fake_llm(server_loop: BackgroundLoop) -> Iterator[FakeEngine]:
    """One fake engine, shared: a test that steers it (`hold`, `fail`) starts one of its own."""
    llm = start_fake_engine(server_loop)
    yield llm
    server_loop.run(llm.shutdown())


@pytest.fixture(scope="session")
def node(server_loop: BackgroundLoop, fake_llm: FakeEngine) -> Iterator[NodeHandle]:
    """A node agent with default settings over the shared fake engine."""
    handle = start_node(server_loop, fake_llm)
    yield handle
    handle.stop()


@pytest.fixture
def fake_nodes(server_loop: BackgroundLoop) -> Iterator[FakeNodes]:
    """Factory: a fake engine of the test's own (to steer) and a node over it with `settings`;
    both stopped at the end."""
    started: list[tuple[FakeEngine, NodeHandle]] = []

    def start(**settings: Any) -> tuple[FakeEngine, NodeHandle]:
        llm = start_fake_engine(server_loop)
        started.append((llm, start_node(server_loop, llm, **settings)))
        return started[-1]

    yield start
    for llm, node in started:
        if not node.done.done():
            node.stop()
        server_loop.run(llm.shutdown())


@pytest.fixture
def openai_client(real_node: NodeHandle) -> Iterator[openai.OpenAI]:
    """The official client, unmodified, against the real model's node agent."""
    with openai.OpenAI(
        base_url=real_node.base_url + "/v1", api_key="unused", max_retries=0
    ) as client:
        yield client
