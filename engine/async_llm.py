"""The engine core on a thread of the serving process, fed and drained from asyncio.

The engine is synchronous and single-threaded; requests and aborts reach it through a
thread-safe queue read between steps, and each step's outputs go back to the event loop in one
call. Its threads then share the process (and its cores) with the server's event loop: a node
agent runs the core in a process of its own by default (engine/core_client.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import Command, CoreOutputs, EngineCore, StopCore
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class _QueueInbox:
    def __init__(self, commands: queue.SimpleQueue[Command]):
        self._commands = commands

    def get(self, block: bool) -> list[Command]:
        items: list[Command] = []
        while True:
            try:
                items.append(self._commands.get(block=block))
            except queue.Empty:
                return items
            block = False


class AsyncLLM(AsyncEngine):
    """`AsyncEngine` over an `LLMEngine` stepping on its own thread in this process."""

    def __init__(self, engine: LLMEngine):
        super().__init__(engine.tokenizer, engine.limits, engine.stats(), engine.weights_format)
        self.engine = engine
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(StopCore())
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.engine.shutdown()

    def _run(self) -> None:
        core = EngineCore(self.engine, _QueueInbox(self._commands), self._deliver)
        try:
            core.run()
        except Exception as exc:  # the loop must report any failure to every waiting request
            logger.exception("engine loop failed")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc}")
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail, dead)

    def _deliver(self, batch: CoreOutputs) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._receive, batch)
