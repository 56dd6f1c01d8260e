"""Helpers for the node agent tests: a background event loop the servers run on, engines (the
real model, or the fake in fake_engine.py), and node agents started on loopback over one
(fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import plain_http
from fake_engine import FakeEngine
from fastapi import FastAPI
from tiny_checkpoints import save_tiny_transformers_model

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import EngineStats
from node_agent.app import create_app
from node_agent.heartbeat import HeartbeatLoop
from node_agent.runtime import NodeRuntime, load_engine
from node_agent.server import NodeServer
from node_agent.settings import NodeAgentSettings
from wire.connection_guard import bind_socket

T = TypeVar("T")
MODEL_NAME = "smollm2-135m-instruct"
# A small pool, so "all blocks free again" is quick to check and a too-long prompt is cheap.
NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 30.0


class BackgroundLoop:
    """An asyncio loop on its own thread: servers run here while tests block on the main one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers")
        self._thread.start()

    def submit(self, coro: Awaitable[T]) -> Future[T]:
        async def wrapper() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop)

    def run(self, coro: Awaitable[T], timeout_s: float = 30.0) -> T:
        return self.submit(coro).result(timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        async def invoke() -> T:
            return fn()

        return self.run(invoke(), timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def start_engine(loop: BackgroundLoop, gguf: Path, **overrides: Any) -> AsyncEngine:
    """The real model in an engine core process (the node agent's default), started on `loop`,
    with the tests' small pool."""
    values: dict[str, Any] = {"num_kv_blocks": NUM_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN}
    llm = load_engine(EngineConfig(model=str(gguf), **(values | overrides)), separate_process=True)
    loop.call(llm.start)
    return llm


TINY_SERVED_NAME = "tiny-llama"


@contextmanager
def tiny_node(loop: BackgroundLoop, folder: Path, **overrides: Any) -> Iterator[NodeHandle]:
    """A node agent over a real engine core process of a tiny random llama (written into
    `folder`: tests/tiny_checkpoints.py, a 97-token vocabulary, 128 positions), served as
    TINY_SERVED_NAME."""
    save_tiny_transformers_model(folder, "llama")
    llm = start_engine(loop, folder, dtype="float32", num_kv_blocks=64, max_model_len=128)
    node = start_node(loop, llm, model=str(folder), served_model_name=TINY_SERVED_NAME, **overrides)
    try:
        yield node
    finally:
        node.stop()
        loop.run(llm.shutdown())


def start_fake_engine(loop: BackgroundLoop, **overrides: Any) -> FakeEngine:
    """A fake engine (fake_engine.py) with the tests' small pool, started on `loop`."""
    values: dict[str, Any] = {"num_kv_blocks": NUM_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN}
    llm = FakeEngine(**(values | overrides))
    loop.call(llm.start)
    return llm


def node_agent_command(model: Path, port: int, *flags: str) -> list[str]:
    """`python -m node_agent` serving `model` as MODEL_NAME on 127.0.0.1:`port`, with `flags`."""
    return [
        sys.executable,
        "-m",
        "node_agent",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--port",
        str(port),
        *flags,
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class NodeHandle:
    """One node agent (create_app + NodeServer) serving on 127.0.0.1 from the servers' loop."""

    settings: NodeAgentSettings
    app: FastAPI
    server: NodeServer
    done: Future[None]
    loop: BackgroundLoop
    base_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.base_url = self.settings.url

    @property
    def runtime(self) -> NodeRuntime:
        return self.server.runtime

    @property
    def heartbeat(self) -> HeartbeatLoop:
        loop: HeartbeatLoop = self.app.state.heartbeat
        return loop

    def stats(self) -> EngineStats:
        stats = self.runtime.stats()
        assert stats is not None
        return stats

    def client(self, **kwargs: Any) -> httpx.Client:
        return plain_http.client(base_url=self.base_url, timeout=30.0, **kwargs)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if not wait_until(lambda: self.done.done() or is_ready_at(self.base_url), timeout_s):
            raise TimeoutError("the node agent did not become ready")
        if self.done.done():
            self.done.result()
            raise RuntimeError("the node agent stopped before it was ready")

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.done.result(timeout_s)


# The `fake_nodes` fixture: (engine, node) with the node's settings.
FakeNodes = Callable[..., tuple[FakeEngine, NodeHandle]]


def start_node(
    loop: BackgroundLoop,
    llm: AsyncEngine | None,
    wait_ready: bool = True,
    weights_id: str | None = None,
    **overrides: Any,
) -> NodeHandle:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    values: dict[str, Any] = {
        "model": MODEL_NAME,
        "port": port,
        "region": "us-east",
        "node_id": f"node-{port}",
        "log_level": "WARNING",
    }
    settings = NodeAgentSettings(**(values | overrides))
    app = create_app(settings, llm=llm, weights_id=weights_id)
    server = NodeServer(app, settings)
    done = loop.submit(server.serve(sockets=[sock]))
    node = NodeHandle(settings, app, server, done, loop)
    if wait_ready:
        node.wait_ready()
    return node


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def is_ready_at(base_url: str) -> bool:
    """`/ready` answers 200 there (False while nothing listens yet)."""
    try:
        return plain_http.get(base_url + "/ready").status_code == 200
    except httpx.TransportError:
        return False


def engine_idle(node: NodeHandle) -> bool:
    """No request runs or waits, and every KV block is free again."""
    stats = node.stats()
    return (
        stats.num_running == 0
        and stats.num_waiting == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
    )
