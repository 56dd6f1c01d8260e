"""The serving API: an engine loop on its own thread, fed and drained from asyncio.

The engine is synchronous and single-threaded; requests and aborts reach it through a
thread-safe inbox read between steps, and each step's outputs go back to the event loop in one
call, where each request's queue feeds its `generate` iterator.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm_engine import EngineStats, LLMEngine, check_cache_salt
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_Sink = asyncio.Queue[RequestOutput | BaseException]


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    cache_salt: str | None
    sink: _Sink
    resumed_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


_STOP = object()


class AsyncLLM:
    """Streams each request's outputs while other requests join and leave the running batch."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | object] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (cheap; safe from any thread)."""
        return self._stats

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop (pending requests end as aborted), then the engine's workers."""
        if self._thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.engine.shutdown()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        resumed_token_ids: list[int] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (deltas unless `params` asks otherwise) until it finishes.

        Raises InvalidRequestError before yielding anything if the request cannot run, and
        EngineDeadError if the engine fails. Closing the iterator early aborts the request.
        A `cache_salt` confines its prefix-cache hits to requests of the same salt;
        `resumed_token_ids` continue a generation begun elsewhere (see `LLMEngine.add_request`).
        """
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running") from self._error
        if isinstance(prompt, str):
            token_ids = await asyncio.to_thread(self.engine.tokenizer.encode, prompt)
        else:
            token_ids = list(prompt)
        if params.output_kind is RequestOutputKind.CUMULATIVE:
            params = replace(params, output_kind=RequestOutputKind.DELTA)
        self.engine.check_request(token_ids, params, resumed_token_ids)
        check_cache_salt(cache_salt)
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        sink: _Sink = asyncio.Queue()
        self._sinks[request_id] = sink
        text = prompt if isinstance(prompt, str) else None
        self._inbox.put(
            _Add(request_id, token_ids, text, params, cache_salt, sink, resumed_token_ids)
        )
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                    break
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Stats first: a consumer woken by its output must not see itself still running.
                self._stats = self.engine.stats()
                self._deliver([(o.request_id, o) for o in outputs])
        except Exception as exc:  # the loop must report any failure to every waiting request
            logger.exception("engine loop failed")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc}")
            self._deliver([(request_id, dead) for request_id in list(self._sinks)])

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                self.engine.abort_request(list(self.engine.requests))
                return False
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Abort):
                self.engine.abort_request([item.request_id])

    def _add(self, item: _Add) -> None:
        try:
            self.engine.add_request(item.request_id, item.token_ids, item.params,
                                    prompt_text=item.prompt, cache_salt=item.cache_salt,
                                    resumed_token_ids=item.resumed_token_ids)
        except Exception as exc:  # reported to the caller, not fatal to the engine
            self._deliver([(item.request_id, exc)])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if not items or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._put_all, items)

    def _put_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            sink = self._sinks.get(request_id)
            if sink is not None:
                sink.put_nowait(item)
