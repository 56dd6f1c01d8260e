"""`AsyncEngine` over an engine core in its own process (as vLLM v1's EngineCore client).

The server's process keeps HTTP, tokenization and the output streams; the core process
(engine/core_process.py) only schedules and steps, so the server's event loop no longer takes
cores from the engine's threads. One duplex pipe joins them: a writer thread sends the queued
commands in batches (the event loop never blocks on a full pipe), and a reader thread hands each
turn's outputs to the event loop. The pipe closing is how each side learns that the other died:
the client then fails every request with EngineDeadError, and the core exits. A core that lives
but does not answer (its process stopped, or one step of its loop stuck) closes nothing: a watch
thread reads the signs of life it leaves (engine/core_liveness.py), and while they say it does
not answer, the requests under way fail and new ones are refused (`unresponsive_reason`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core_liveness import TICK_S, CoreSigns, LivenessLimits, LivenessWatch
from engine.core_process import CoreFailed, CoreReady, run_core
from engine.engine_core import Command, CoreOutputs, StopCore
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

_START_POLL_S = 0.5
_STOP_TIMEOUT_S = 30.0
_KILL_TIMEOUT_S = 5.0
# A stopped process is noticed within seconds; a step may take its time (a long prefill on a
# loaded CPU took 7.4 s), though not past the gateway's 60 s limit on a stream's silence.
DEFAULT_LIVENESS = LivenessLimits(max_silence_s=5.0, max_step_s=60.0)


class EngineCoreClient(AsyncEngine):
    """Starts, feeds, watches and stops one engine core process."""

    def __init__(
        self,
        process: BaseProcess,
        pipe: Connection,
        ready: CoreReady,
        signs: CoreSigns,
        liveness: LivenessLimits,
    ):
        super().__init__(ready.tokenizer, ready.limits, ready.stats, ready.weights_format)
        self.process = process
        self._pipe = pipe
        self._signs = signs
        self._liveness = liveness
        self._threads: list[threading.Thread] = []
        self._stopping = False
        atexit.register(self._kill)

    @classmethod
    def from_config(
        cls, config: EngineConfig, liveness: LivenessLimits = DEFAULT_LIVENESS
    ) -> EngineCoreClient:
        """Start the core process and wait until its engine is loaded (blocking: seconds to
        minutes). Raises what the engine raised while loading, or EngineDeadError."""
        # Spawned, never forked: the core starts torch's threads (and CUDA) clean. It is not a
        # daemon, since it may start parallel workers of its own.
        context = mp.get_context("spawn")
        ours, theirs = context.Pipe()
        signs = CoreSigns(context)
        log_level = logging.getLogger().getEffectiveLevel()
        process = context.Process(
            target=run_core,
            args=(config, theirs, os.getpid(), log_level, signs),
            name="engine-core",
        )
        process.start()
        theirs.close()  # so that the core's death closes the pipe for us
        try:
            ready = _wait_ready(process, ours)
        except BaseException:
            ours.close()
            _stop_process(process, timeout_s=_KILL_TIMEOUT_S)
            raise
        logger.info("engine core running in process %d", ready.pid)
        return cls(process, ours, ready, signs, liveness)

    @property
    def is_running(self) -> bool:
        return bool(self._threads) and self._error is None and self.process.is_alive()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = [
            threading.Thread(target=self._write, name="core-writer", daemon=True),
            threading.Thread(target=self._read, name="core-reader", daemon=True),
            threading.Thread(target=self._watch, name="core-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(StopCore())
        if not self._threads:  # never started: no writer will carry the stop across
            with contextlib.suppress(OSError):
                self._pipe.send([StopCore()])
        await asyncio.to_thread(_stop_process, self.process, _STOP_TIMEOUT_S)
        self._pipe.close()
        for thread in self._threads:
            await asyncio.to_thread(thread.join)
        atexit.unregister(self._kill)

    def _write(self) -> None:
        """Send queued commands, all that are waiting in one message."""
        while True:
            batch: list[Command] = [self._commands.get()]
            while True:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                self._pipe.send(batch)
            except OSError:
                return  # the core is gone; the reader reports it
            if any(isinstance(c, StopCore) for c in batch):
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._pipe.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, CoreFailed):
                self._report_death(message.error)
                return
            assert isinstance(message, CoreOutputs), "the core sends outputs once ready"
            self._event_loop.call_soon_threadsafe(self._receive, message)
        if self._stopping:
            return
        self.process.join(_KILL_TIMEOUT_S)
        self._report_death(
            EngineDeadError(f"the engine core process exited (exit code {self.process.exitcode})")
        )

    def _watch(self) -> None:
        """Judge the core's signs of life every tick; tell the event loop when it stops
        answering, and when it answers again."""
        watch = LivenessWatch(self._liveness)
        reason: str | None = None
        while not self._stopping and self._error is None:
            now_s = time.monotonic()
            was, reason = reason, watch.check(self._signs.read(), now_s)
            if reason is not None and was is None:
                logger.error("the engine core does not answer: %s", reason)
                self._event_loop.call_soon_threadsafe(self._set_unresponsive, reason)
            elif reason is None and was is not None:
                logger.warning("the engine core answers again")
                self._event_loop.call_soon_threadsafe(self._set_unresponsive, None)
            time.sleep(TICK_S)

    def _report_death(self, error: Exception) -> None:
        logger.error("engine core failed: %s", error)
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
        self._event_loop.call_soon_threadsafe(self._fail, dead)
        self._commands.put(StopCore())  # so that the writer ends too

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the threads run only after start()"
        return self._loop

    def _kill(self) -> None:
        """At interpreter exit without a shutdown: leave no core behind."""
        _stop_process(self.process, timeout_s=0.0)


def _wait_ready(process: BaseProcess, pipe: Connection) -> CoreReady:
    while not pipe.poll(_START_POLL_S):
        if not process.is_alive():
            break
    try:
        message = pipe.recv()
    except EOFError:
        process.join(_KILL_TIMEOUT_S)
        raise EngineDeadError(
            f"the engine core process exited while starting (exit code {process.exitcode})"
        ) from None
    if isinstance(message, CoreFailed):
        raise message.error
    assert isinstance(message, CoreReady), "the core says it is ready before anything else"
    return message


def _stop_process(process: BaseProcess, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the process to end, then kill it."""
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(_KILL_TIMEOUT_S)
