"""A fake `AsyncEngine` for node-agent tests that are not about the engine's output: no model, no
process, answers at once and the same every time.

Its core is a coroutine on the event loop that started it, in place of the real core's thread
(engine/async_llm.py) or process (engine/core_client.py): the real `AsyncEngine.generate` checks
and tokenizes each request and sends it over the same command queue. Each step gives every
running request its next token: the prompt's ids echoed from the start, over and over (a resumed
request carries on where the echo had got to, as an unbroken one would). A request ends as the
real engine ends one: a stop token ("stop", unless `ignore_eos`), a stop string (its text held
back while it could be forming, cut at the match), or `max_tokens` ("length"; at most what the
context leaves). Prefix-cache hits are counted per whole block of the prompt seen before with
the same cache salt (keyed by the engine's own salted hash chain, the least recently used block
evicted once the pool's worth is cached), and the stats move as the real engine's do. Watched
(`watch_cache`), it sends a snapshot and then each turn's stored and evicted hashes, as the real
core does.

Steering, from any thread: `hold(after_tokens)` lets no request past that many output tokens
until `release()`; `fail(message)` kills the core (every request fails with EngineDeadError);
`stop_answering(reason)` / `answer_again()` as a core that goes silent and comes back;
`cached_hashes()` (on its loop) what its prefix cache holds.

The tokenizer is byte-level (one token per UTF-8 byte, so any text round-trips) with ChatML's
specials and template; `<|im_end|>` is the stop token.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from engine.async_engine import AsyncEngine
from engine.cache_events import CacheEventRecorder, CacheEvents
from engine.chat_template import ChatTemplate
from engine.config import WeightsFormat
from engine.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    CoreOutputs,
    StopCore,
    WatchCache,
)
from engine.errors import EngineDeadError
from engine.kv_cache_manager import chain_root, hash_block
from engine.llm_engine import EngineStats
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request_limits import RequestLimits
from engine.sequence import TokenLogprobs
from engine.tokenizer import SpecialTokens, Tokenizer

BLOCK_SIZE = 16
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
T = TypeVar("T")
# Between steps while nothing can run (no request, or all held): how soon a change is seen.
IDLE_POLL_S = 0.002


def byte_tokenizer() -> Tokenizer:
    """One token per byte (GPT-2's byte spelling), then `<|im_start|>` and `<|im_end|>`."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in (IM_START, IM_END)])
    im_end = len(alphabet) + 1  # the specials come after the bytes, in order
    assert backend.token_to_id(IM_END) == im_end
    special = SpecialTokens(
        bos_id=None,
        eos_id=im_end,
        unk_id=None,
        pad_id=None,
        stop_ids=frozenset({im_end}),
        add_bos=False,
    )
    return Tokenizer(backend, special, ChatTemplate(CHATML))


@dataclass(slots=True)
class _Request:
    add: AddRequest
    max_tokens: int
    arrival_time: float
    num_cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    num_sent_chars: int = 0  # of the text so far, what earlier outputs carried

    @property
    def num_tokens(self) -> int:
        return (
            len(self.add.token_ids) + len(self.add.resumed_token_ids or ()) + len(self.output_ids)
        )

    def next_token(self) -> int:
        prompt = self.add.token_ids
        position = len(self.add.resumed_token_ids or ()) + len(self.output_ids)
        return prompt[position % len(prompt)]


class FakeEngine(AsyncEngine):
    def __init__(self, max_model_len: int, num_kv_blocks: int):
        tokenizer = byte_tokenizer()
        self._num_kv_blocks = num_kv_blocks
        self._requests: dict[str, _Request] = {}
        self._cached_blocks: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self._cache_events: CacheEventRecorder | None = None
        self._totals = {"queried": 0, "hits": 0, "prompt": 0, "generated": 0}
        self._hold_after: int | None = None
        self._core: asyncio.Task[None] | None = None
        limits = RequestLimits(max_model_len, tokenizer.vocab_size)
        super().__init__(tokenizer, limits, self._snapshot(), WeightsFormat("fp32", "none"))

    # --- the AsyncEngine interface ---

    @property
    def is_running(self) -> bool:
        return self._core is not None and not self._core.done() and self._error is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._core = self._loop.create_task(self._run(), name="fake-engine-core")

    async def shutdown(self) -> None:
        if self._core is not None:
            self._commands.put(StopCore())
            with contextlib.suppress(asyncio.CancelledError):
                await self._core
            self._core = None

    # --- steering, from any thread ---

    def hold(self, after_tokens: int = 0) -> None:
        """Let no request produce more than `after_tokens` tokens until `release()`."""
        self._hold_after = after_tokens

    def release(self) -> None:
        self._hold_after = None

    def fail(self, message: str = "the fake engine failed") -> None:
        self._call(self._die, message)

    def stop_answering(self, reason: str = "silent for a test") -> None:
        self._call(self._set_unresponsive, reason)

    def answer_again(self) -> None:
        self._call(self._set_unresponsive, None)

    def cached_hashes(self) -> frozenset[bytes]:
        """What the prefix cache holds now (call on the engine's loop)."""
        return frozenset(self._cached_blocks)

    # --- the core ---

    def _call(self, fn: Callable[[T], None], arg: T) -> None:
        assert self._loop is not None, "start the engine first"
        self._loop.call_soon_threadsafe(fn, arg)

    def _die(self, message: str) -> None:
        if self._core is not None:
            self._core.cancel()
        self._fail(EngineDeadError(message))

    async def _run(self) -> None:
        while True:
            commands = _drain(self._commands)
            outputs: list[RequestOutput] = []
            cache_events: list[CacheEvents] = []
            for command in commands:
                if isinstance(command, StopCore):
                    self._deliver(self._abort_all(), [])
                    return
                if isinstance(command, AddRequest):
                    self._add(command)
                elif isinstance(command, AbortRequest):
                    outputs += self._abort(command.request_id)
                elif isinstance(command, WatchCache):
                    self._cache_events = CacheEventRecorder()
                    cache_events = [CacheEvents(tuple(self._cached_blocks), is_snapshot=True)]
            if self.unresponsive_reason is None:
                outputs += self._step()
            if self._cache_events is not None and (changes := self._cache_events.take()):
                cache_events.append(changes)
            if outputs or commands:  # the stats moved
                self._deliver(outputs, cache_events)
            await asyncio.sleep(0 if outputs else IDLE_POLL_S)

    def _deliver(self, outputs: list[RequestOutput], cache_events: list[CacheEvents]) -> None:
        self._receive(CoreOutputs(outputs, [], self._snapshot(), tuple(cache_events)))

    def _add(self, add: AddRequest) -> None:
        ids = [*add.token_ids, *(add.resumed_token_ids or ())]
        num_cached = 0
        parent = chain_root(add.cache_salt)
        for end in range(BLOCK_SIZE, len(ids) + 1, BLOCK_SIZE):
            parent = hash_block(parent, ids[end - BLOCK_SIZE : end])
            if parent in self._cached_blocks and num_cached == end - BLOCK_SIZE:
                num_cached = end
            self._cache(parent)
        room = self.limits.max_model_len - len(ids)
        max_tokens = min(add.params.max_tokens or room, room)
        self._requests[add.request_id] = _Request(add, max_tokens, time.time(), num_cached)
        self._totals["queried"] += len(ids)
        self._totals["hits"] += num_cached
        self._totals["prompt"] += len(ids)

    def _cache(self, block_hash: bytes) -> None:
        if block_hash in self._cached_blocks:
            self._cached_blocks.move_to_end(block_hash)
            return
        self._cached_blocks[block_hash] = None
        if self._cache_events is not None:
            self._cache_events.stored(block_hash)
        if len(self._cached_blocks) > self._num_kv_blocks:
            evicted, _ = self._cached_blocks.popitem(last=False)
            if self._cache_events is not None:
                self._cache_events.removed(evicted)

    def _step(self) -> list[RequestOutput]:
        outputs = []
        for request in list(self._requests.values()):
            if self._hold_after is not None and len(request.output_ids) >= self._hold_after:
                continue
            token = request.next_token()
            request.output_ids.append(token)
            self._totals["generated"] += 1
            outputs.append(self._output(request, token))
        return outputs

    def _output(self, request: _Request, token: int) -> RequestOutput:
        params = request.add.params
        text = self.tokenizer.decode(request.output_ids)
        finish_reason: str | None = None
        stop_reason: str | int | None = None
        stop_ids = {*params.stop_token_ids, *self.tokenizer.stop_token_ids}
        found = [(text.find(s), s) for s in params.stop if s in text]
        if not params.ignore_eos and token in stop_ids:
            finish_reason, stop_reason = "stop", token
        elif found:
            at, stop_reason = min(found)
            finish_reason, text = "stop", text[:at]
        elif len(request.output_ids) >= request.max_tokens:
            finish_reason = "length"
        # Text that may yet turn into a stop string, or a character still incomplete, waits.
        held = max((len(s) - 1 for s in params.stop), default=0)
        end = len(text) if finish_reason else len(text.rstrip("\ufffd")) - held
        delta = text[request.num_sent_chars : max(end, request.num_sent_chars)]
        request.num_sent_chars += len(delta)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprobs(token, 0.0, [(token, 0.0)][: params.logprobs])]
        if finish_reason is not None:
            del self._requests[request.add.request_id]
        return _request_output(request, [token], delta, logprobs, finish_reason, stop_reason)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        return [_request_output(request, [], "", None, "abort", None)]

    def _abort_all(self) -> list[RequestOutput]:
        return [output for rid in list(self._requests) for output in self._abort(rid)]

    def _snapshot(self) -> EngineStats:
        used = sum(math.ceil(r.num_tokens / BLOCK_SIZE) for r in self._requests.values())
        free = self._num_kv_blocks - used
        return EngineStats(
            num_running=len(self._requests),
            num_waiting=0,
            num_waiting_prefill_tokens=0,
            num_running_prefill_tokens=0,
            kv_blocks_total=self._num_kv_blocks,
            kv_blocks_free=free,
            block_size=BLOCK_SIZE,
            kv_cache_usage=used / self._num_kv_blocks,
            prefix_cache_queried_tokens=self._totals["queried"],
            prefix_cache_hit_tokens=self._totals["hits"],
            prompt_tokens_total=self._totals["prompt"],
            generation_tokens_total=self._totals["generated"],
            num_preemptions_total=0,
            decode_tokens_per_s=0.0,
        )


def _request_output(
    request: _Request,
    token_ids: list[int],
    text: str,
    logprobs: list[TokenLogprobs] | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
) -> RequestOutput:
    completion = CompletionOutput(0, text, token_ids, None, logprobs, finish_reason, stop_reason)
    now = time.time()
    metrics = RequestMetrics(
        request.arrival_time, request.arrival_time, now, now if finish_reason else None
    )
    return RequestOutput(
        request.add.request_id,
        None,
        [],
        [completion],
        finish_reason is not None,
        request.num_cached_tokens,
        metrics,
    )


def _drain(commands: queue.SimpleQueue[Command]) -> list[Command]:
    items = []
    with contextlib.suppress(queue.Empty):
        while True:
            items.append(commands.get_nowait())
    return items
