"""The serving API's front: per-request output streams over an engine core that runs elsewhere.

`generate` checks and tokenizes a request here, sends it to the core, and yields what the core
sends back; the core runs on a thread of this process (engine/async_llm.py, `AsyncLLM`) or in a
process of its own (engine/core_client.py, `EngineCoreClient`). Subclasses deliver each batch
of the core's outputs to `_receive` on the event loop, a failure of the core to `_fail`, and a
core that stops answering, for as long as it does, to `_set_unresponsive`.
"""

from __future__ import annotations

import asyncio
import queue
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

from engine.cache_events import CacheEvents
from engine.config import WeightsFormat
from engine.engine_core import AbortRequest, AddRequest, Command, CoreOutputs, WatchCache
from engine.errors import EngineDeadError
from engine.llm_engine import EngineStats
from engine.outputs import RequestOutput
from engine.request_limits import RequestLimits
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tokenizer import Tokenizer

_Sink = asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine(ABC):
    """Streams each request's outputs while other requests join and leave the running batch."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: RequestLimits,
        stats: EngineStats,
        weights_format: WeightsFormat,
    ):
        self.tokenizer = tokenizer
        self.limits = limits
        self.weights_format = weights_format
        # Commands for the core, in order; the subclass carries them across.
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        # Why the core does not answer now (None: it does, as far as this side can tell).
        self.unresponsive_reason: str | None = None
        self._stats = stats
        self._cache_listeners: list[Callable[[CacheEvents], None]] = []

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """Started, and the core has not failed."""

    @abstractmethod
    def start(self) -> None:
        """Start the core; call from the event loop that will consume outputs."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core (pending requests end as aborted) and whatever it started."""

    def stats(self) -> EngineStats:
        """The snapshot taken after the core's latest step (cheap; safe from any thread)."""
        return self._stats

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        resumed_token_ids: list[int] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (deltas unless `params` asks otherwise) until it finishes.

        Raises RequestRejected before yielding anything if the request cannot run, and
        EngineDeadError if the core fails. Closing the iterator early aborts the request.
        A `cache_salt` confines its prefix-cache hits to requests of the same salt;
        `resumed_token_ids` continue a generation begun elsewhere (see `LLMEngine.add_request`).
        """
        if self._error is not None or not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        if self.unresponsive_reason is not None:
            raise self._not_answering()
        if isinstance(prompt, str):
            token_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            token_ids = list(prompt)
        if params.output_kind is RequestOutputKind.CUMULATIVE:
            params = replace(params, output_kind=RequestOutputKind.DELTA)
        # Checked here, not in the core, with the engine's rule (engine/request_limits.py); a
        # server that must refuse before its response starts checks first, with its own.
        self.limits.check(token_ids, params, resumed_token_ids, cache_salt)
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        sink: _Sink = asyncio.Queue()
        self._sinks[request_id] = sink
        text = prompt if isinstance(prompt, str) else None
        self._commands.put(
            AddRequest(request_id, token_ids, text, params, cache_salt, resumed_token_ids)
        )
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                # The core need not send the prompt back with every step: it is known here.
                item.prompt, item.prompt_token_ids = text, token_ids
                yield item
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._commands.put(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def watch_cache(self, listener: Callable[[CacheEvents], None]) -> None:
        """Call `listener` on the event loop with the prefix cache's contents (a snapshot), then
        with its changes after each turn of the core that changed it. Until someone watches, the
        core records none. Another watcher makes every listener receive a new snapshot."""
        self._cache_listeners.append(listener)
        self._commands.put(WatchCache())

    def _receive(self, batch: CoreOutputs) -> None:
        """On the event loop: one turn of the core's outputs, to each request's stream."""
        self._stats = batch.stats
        for events in batch.cache_events:
            for listener in self._cache_listeners:
                listener(events)
        for request_id, error in batch.errors:
            self._put(request_id, error)
        for output in batch.outputs:
            self._put(output.request_id, output)

    def _fail(self, error: EngineDeadError) -> None:
        """On the event loop: the core is gone; every waiting request fails with `error`."""
        if self._error is None:
            self._error = error
        self._fail_requests(error)

    def _set_unresponsive(self, reason: str | None) -> None:
        """On the event loop: the core stopped answering (`reason`), or answers again (None).
        The requests under way fail at once, so that their clients go elsewhere rather than
        wait for a core that may never answer; new ones are refused until it does. A core that
        answers again carries on: the failed requests' aborts reach it then."""
        was, self.unresponsive_reason = self.unresponsive_reason, reason
        if reason is not None and was is None:
            self._fail_requests(self._not_answering())

    def _not_answering(self) -> EngineDeadError:
        return EngineDeadError(f"the engine core does not answer: {self.unresponsive_reason}")

    def _fail_requests(self, error: EngineDeadError) -> None:
        for request_id in list(self._sinks):
            self._put(request_id, error)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.put_nowait(item)
