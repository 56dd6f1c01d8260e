"""Fixtures for the node agent: one real SmolLM2 engine, loaded once and shared by every
in-process node agent, on a background event loop the servers run on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_helpers import (
    BackgroundLoop,
    NodeHandle,
    start_engine,
    start_node,
)

from engine.async_engine import AsyncEngine
from engine.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def no_meridian_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide every setting themselves: ignore MERIDIAN_* from the calling shell."""
    for name in list(os.environ):
        if name.startswith("MERIDIAN_"):
            monkeypatch.delenv(name)


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
def node(server_loop: BackgroundLoop, shared_llm: AsyncEngine) -> Iterator[NodeHandle]:
    """A node agent with default settings over the shared engine."""
    handle = start_node(server_loop, shared_llm)
    yield handle
    handle.stop()
