"""The engine core's loop: apply queued requests and aborts, step, hand the outputs on.

The same loop runs on a thread beside the server (engine/async_llm.py) or alone in its own
process (engine/core_process.py); only the inbox and the outbox differ. Everything that crosses
between the server and the core is one of the small values below, so that it pickles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.cache_events import CacheEvents
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    cache_salt: str | None
    resumed_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class WatchCache:
    """Send the prefix cache's contents, then its changes with every turn's outputs."""


@dataclass(frozen=True, slots=True)
class StopCore:
    """Abort whatever runs and end the loop."""


Command = AddRequest | AbortRequest | WatchCache | StopCore


@dataclass(frozen=True, slots=True)
class CoreOutputs:
    """What one turn of the loop produced. `stats` come after the step, so a consumer woken by
    its output never sees itself still running."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, Exception]]  # requests refused when added: (request id, why)
    stats: EngineStats
    # The prefix cache's snapshot (after WatchCache) and changes in this turn, in order; empty
    # while nobody watches.
    cache_events: tuple[CacheEvents, ...] = ()


class Inbox(Protocol):
    def get(self, block: bool) -> list[Command]:
        """The commands queued since the last call; with `block`, wait for at least one."""


class EngineCore:
    """Drives one LLMEngine until told to stop; `run` raises whatever the engine raises."""

    def __init__(
        self, engine: LLMEngine, inbox: Inbox, outbox: Callable[[CoreOutputs], None]
    ) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox

    def run(self) -> None:
        engine = self.engine
        while True:
            outputs: list[RequestOutput] = []
            errors: list[tuple[str, Exception]] = []
            cache_events: list[CacheEvents] = []
            commands = self._inbox.get(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, StopCore):
                    engine.abort_request(list(engine.requests))
                    return
                if isinstance(command, AbortRequest):
                    outputs += engine.abort_request([command.request_id])
                elif isinstance(command, WatchCache):
                    cache_events = [engine.watch_cache_events()]
                else:
                    self._add(command, errors)
            if engine.has_unfinished_requests():
                outputs += engine.step()
            if (changes := engine.take_cache_events()) is not None:
                cache_events.append(changes)
            self._outbox(CoreOutputs(outputs, errors, engine.stats(), tuple(cache_events)))

    def _add(self, command: AddRequest, errors: list[tuple[str, Exception]]) -> None:
        try:
            self.engine.add_checked_request(
                command.request_id,
                command.token_ids,
                command.params,
                command.prompt,
                command.cache_salt,
                command.resumed_token_ids,
            )
        except Exception as exc:  # reported to the caller, not fatal to the engine
            errors.append((command.request_id, exc))
