"""The engine core's own process: loads the engine, then steps it for the client at the far end
of one pipe (engine/core_client.py).

The process lives exactly as long as its parent wants it: it ends on `StopCore`, when the pipe
closes (the parent exited, however it died), and, should a long step keep it from reading the
pipe, when a watchdog sees that the parent is gone; it then exits at once, without the
interpreter's teardown. Its parallel workers, if any, follow it
(engine/workers.py: they end when its pipes close). While it runs it leaves signs of life for
its client: a thread's ticks, and its loop's turns (engine/core_liveness.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.config import EngineConfig, WeightsFormat
from engine.core_liveness import CoreSigns
from engine.engine_core import Command, CoreOutputs, EngineCore
from engine.errors import EngineDeadError
from engine.llm_engine import EngineStats, LLMEngine
from engine.request_limits import RequestLimits
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5
# After the parent is gone, how long the loop has to notice the closed pipe and stop its
# workers itself before the watchdog ends the process.
_PARENT_GONE_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The first message: what the client needs to check and tokenize requests itself."""

    tokenizer: Tokenizer
    limits: RequestLimits
    stats: EngineStats
    weights_format: WeightsFormat
    pid: int


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The last message of a core that could not start (`error` as raised) or that failed."""

    error: Exception


class _PipeInbox:
    """The loop asks it for commands once a turn: what the loop does between two asks is the
    turn, which the signs of life time."""

    def __init__(self, pipe: Connection, signs: CoreSigns):
        self._pipe = pipe
        self._signs = signs

    def get(self, block: bool) -> list[Command]:
        """Raises EOFError once the parent's end is closed."""
        self._signs.end_turn()
        items: list[Command] = []
        if block or self._pipe.poll():
            while True:
                items += self._pipe.recv()  # the client sends lists of commands
                if not self._pipe.poll():
                    break
        self._signs.begin_turn()
        return items


def _send_outputs(pipe: Connection, batch: CoreOutputs) -> None:
    # The client keeps each request's prompt; sending it back with every step would cost the
    # core a pickle of every prompt per step.
    for output in batch.outputs:
        output.prompt, output.prompt_token_ids = None, []
    pipe.send(batch)


def _portable(error: Exception) -> Exception:
    """`error` itself where it pickles (the client re-raises it), else its text."""
    try:
        pickle.dumps(error)
    except Exception:  # any object may refuse to pickle, in any way
        return EngineDeadError(f"{type(error).__name__}: {error}")
    return error


def _watch_parent(parent_pid: int, stopped: threading.Event) -> None:
    while not stopped.wait(_PARENT_POLL_S):
        if os.getppid() != parent_pid:
            if not stopped.wait(_PARENT_GONE_GRACE_S):
                logger.error("the engine core's parent %d is gone; exiting", parent_pid)
                os._exit(1)
            return


def run_core(
    config: EngineConfig, pipe: Connection, parent_pid: int, log_level: int, signs: CoreSigns
) -> None:
    """The process's target."""
    _serve(config, pipe, parent_pid, log_level, signs)
    # Leave without the interpreter's teardown: collecting and freeing the engine's objects one
    # by one kept both cores busy for most of a second after a node died, while the node that
    # took over its streams prefilled them on the same machine (issue 15). Nothing is left to
    # clean up: the pipe is closed and the parallel workers, if any, are stopped.
    logging.shutdown()
    os._exit(0)


def _serve(
    config: EngineConfig, pipe: Connection, parent_pid: int, log_level: int, signs: CoreSigns
) -> None:
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s (core): %(message)s"
    )
    stopped = threading.Event()
    threading.Thread(
        target=_watch_parent, args=(parent_pid, stopped), name="parent-watch", daemon=True
    ).start()
    threading.Thread(
        target=signs.tick_until, args=(stopped,), name="signs-of-life", daemon=True
    ).start()
    try:
        try:
            engine = LLMEngine(config)
        except Exception as exc:  # the client raises it as the load's failure
            pipe.send(CoreFailed(_portable(exc)))
            return
        try:
            pipe.send(
                CoreReady(
                    engine.tokenizer,
                    engine.limits,
                    engine.stats(),
                    engine.weights_format,
                    os.getpid(),
                )
            )
            EngineCore(engine, _PipeInbox(pipe, signs), lambda b: _send_outputs(pipe, b)).run()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            logger.warning("the engine core's client is gone; stopping")
        except Exception as exc:  # the client fails every request with it
            logger.exception("engine core failed")
            with contextlib.suppress(OSError):  # the client may be gone as well
                pipe.send(CoreFailed(EngineDeadError(f"the engine failed: {exc}")))
        finally:
            engine.shutdown()
    finally:
        stopped.set()
        pipe.close()
