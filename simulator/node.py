"""A node running our engine, as a service model (no tokens, only their timing).

Continuous batching, as engine/scheduler.py does it: requests wait (FIFO) until a sequence slot
(`max_num_seqs`) and KV blocks for their whole length are free, then prefill one after another
at the head of the step's token budget, then decode one token per step until done. Simulating
every step would cost an event per step per node, so the model is fluid: between two changes of
the batch, every decoding sequence advances at 1 / step time tokens per second and the prefill
at the head of the queue at its own rate. A step that carries prefill lasts
`step_s(batch) + chunk / prefill_tokens_per_s` (the chunk is the head's prompt, at most the token
budget), so prefill slows decoding, as it does in the engine. The first token comes out of the
last prefill step. A prefix-cache hit (the tenant's system prompt, whole blocks of it) is not
prefilled again.

Events: the node schedules one wake-up for its next change (a prefill or a sequence finishing)
and moves it whenever the batch changes; a stale wake-up is recognised by its generation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from node_agent.hot_prefixes import HotPrefixes
from simulator.calibration import ServiceCalibration
from simulator.events import EventLoop
from simulator.models import DEFAULT_MODEL

EPSILON_TOKENS = 1e-6
INFINITY = float("inf")


@dataclass(slots=True)
class Job:
    """One request on one node; `owner` is the caller's handle for it."""

    owner: object
    prompt_tokens: int
    output_tokens: int
    prefix_key: str | None
    prefix_tokens: int
    num_blocks: int = 0
    prefill_tokens: int = 0  # what is left to compute once admitted (prefix hits removed)
    chunk_tokens: int = 0
    finish_v: float = 0.0
    num_generated: int = 0  # output tokens it had produced when its node died
    cached_tokens: int = 0  # of its prompt, found in the prefix cache when admitted


class NodeLoad(NamedTuple):  # a tuple: one per heartbeat
    """What a heartbeat reports (engine stats as node_agent/runtime.py reads them)."""

    num_running: int
    num_waiting: int  # no first token yet: waiting for a slot or in prefill (the agent's count)
    num_waiting_prefill_tokens: int  # the engine's waiting queue only
    num_running_prefill_tokens: int  # admitted, still to prefill
    kv_blocks_free: int
    num_in_flight: int
    generated_tokens: float  # since start, for the node's recent decode rate


@dataclass(slots=True)
class Node:
    name: str
    region: str
    calibration: ServiceCalibration
    loop: EventLoop
    on_first_token: Callable[[Job], None]
    on_finished: Callable[[Job], None]
    model: str = DEFAULT_MODEL  # the one model it serves, under this name
    is_up: bool = True
    waiting: deque[Job] = field(default_factory=deque)
    prefilling: deque[Job] = field(default_factory=deque)
    decoding: list[tuple[float, int, Job]] = field(default_factory=list)  # heap by finish_v
    free_blocks: int = 0
    prefix_cache: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # The system prompts served lately, as the node agent reports them in its beats.
    hot_prefixes: HotPrefixes = field(init=False)
    v: float = 0.0  # decode steps every running sequence has taken since start (fluid)
    head_done: float = 0.0  # prefill tokens computed of the queue's head
    generated_tokens: float = 0.0
    decode_rate: float = 0.0  # tokens per second per decoding sequence, now
    prefill_rate: float = 0.0  # prompt tokens per second at the head, now
    last_s: float = 0.0
    wake_generation: int = 0
    # Running totals, so that a heartbeat or an oracle need not walk the queues.
    waiting_prompt_tokens: int = 0
    prefill_tokens_queued: int = 0  # to compute for the admitted, before any progress
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.free_blocks = self.calibration.kv_blocks
        self.hot_prefixes = HotPrefixes(clock=self._now_s)

    def _now_s(self) -> float:
        return self.loop.now_s

    # What the outside sees.

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def num_not_started(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def load(self, now_s: float) -> NodeLoad:
        self._advance(now_s)
        return NodeLoad(
            num_running=len(self.prefilling) + len(self.decoding),
            num_waiting=self.num_not_started,
            num_waiting_prefill_tokens=self.waiting_prompt_tokens,
            num_running_prefill_tokens=int(self.prefill_tokens_queued - self.head_done),
            kv_blocks_free=self.free_blocks,
            num_in_flight=self.num_in_flight,
            generated_tokens=self.generated_tokens,
        )

    def blocks_for(self, prompt_tokens: int, output_tokens: int) -> int:
        return -(-(prompt_tokens + output_tokens) // self.calibration.block_size)

    def can_ever_fit(self, job: Job) -> bool:
        return self.blocks_for(job.prompt_tokens, job.output_tokens) <= self.calibration.kv_blocks

    def is_overloaded(self) -> bool:
        """The node agent's admission: 429 once this many requests have no first token yet."""
        return self.num_not_started >= self.calibration.max_num_waiting_requests

    # Changes.

    def submit(self, job: Job, now_s: float) -> None:
        self._advance(now_s)
        job.num_blocks = self.blocks_for(job.prompt_tokens, job.output_tokens)
        self.hot_prefixes.seen(job.prefix_key)
        self.waiting.append(job)
        self.waiting_prompt_tokens += job.prompt_tokens
        self._settle(now_s)

    def abort(self, job: Job, now_s: float) -> bool:
        """The client gave up before its first token; False if the node no longer holds it."""
        self._advance(now_s)
        if job in self.waiting:
            self.waiting.remove(job)
            self.waiting_prompt_tokens -= job.prompt_tokens
        elif job in self.prefilling:
            if self.prefilling[0] is job:
                self.head_done = 0.0
            self.prefilling.remove(job)
            self.prefill_tokens_queued -= job.prefill_tokens
            self.free_blocks += job.num_blocks
        else:
            return False
        self._settle(now_s)
        return True

    def fail(self, now_s: float) -> list[Job]:
        """The node dies: everything it holds is gone. Returns every job it held, each with the
        output tokens it had produced (`num_generated`: 0 for those still waiting or in
        prefill)."""
        self._advance(now_s)
        held = [*self.waiting, *self.prefilling]
        for finish_v, _, job in self.decoding:
            steps_left = finish_v - self.v  # one token per step after the first
            job.num_generated = math.floor(job.output_tokens - steps_left + EPSILON_TOKENS)
            held.append(job)
        self.is_up = False
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self.prefix_cache.clear()
        self.hot_prefixes = HotPrefixes(clock=self._now_s)  # a new node agent
        self.free_blocks = self.calibration.kv_blocks
        self.head_done = 0.0
        self.waiting_prompt_tokens = self.prefill_tokens_queued = 0
        self.decode_rate = self.prefill_rate = 0.0
        self.wake_generation += 1
        self.last_s = now_s
        return held

    def restart(self, now_s: float) -> None:
        self.is_up = True
        self.last_s = now_s

    # The model.

    def _advance(self, now_s: float) -> None:
        elapsed_s = now_s - self.last_s
        if elapsed_s > 0.0:
            if self.decoding:
                step_v = elapsed_s * self.decode_rate
                self.v += step_v
                self.generated_tokens += step_v * len(self.decoding)
            if self.prefilling:
                self.head_done += elapsed_s * self.prefill_rate
        self.last_s = now_s

    def _wake(self, generation: int) -> None:
        if generation != self.wake_generation:
            return  # the batch changed since this wake-up was planned
        now_s = self.loop.now_s
        self._advance(now_s)
        if self.prefilling:
            head = self.prefilling[0]
            if self.head_done >= head.prefill_tokens - EPSILON_TOKENS:
                self.prefilling.popleft()
                self.prefill_tokens_queued -= head.prefill_tokens
                self.head_done = 0.0
                self._finish_prefill(head)
        decoding = self.decoding
        while decoding and decoding[0][0] <= self.v + EPSILON_TOKENS:
            _, _, job = heapq.heappop(decoding)
            self.free_blocks += job.num_blocks
            self.on_finished(job)
        self._settle(now_s)

    def _finish_prefill(self, job: Job) -> None:
        if job.prefix_key is not None:
            self.prefix_cache[job.prefix_key] = None
            self.prefix_cache.move_to_end(job.prefix_key)
            if len(self.prefix_cache) > self.calibration.max_cached_prefixes:
                self.prefix_cache.popitem(last=False)
        self.on_first_token(job)
        if job.output_tokens <= 1:
            self.free_blocks += job.num_blocks
            self.on_finished(job)
            return
        job.finish_v = self.v + (job.output_tokens - 1)
        heapq.heappush(self.decoding, (job.finish_v, next(self._order), job))

    def _admit(self) -> None:
        calibration = self.calibration
        while self.waiting:
            job = self.waiting[0]
            num_running = len(self.prefilling) + len(self.decoding)
            if num_running >= calibration.max_num_seqs or job.num_blocks > self.free_blocks:
                return  # first come, first served: the head waits, and everyone behind it
            self.waiting.popleft()
            self.waiting_prompt_tokens -= job.prompt_tokens
            self.free_blocks -= job.num_blocks
            cached = 0
            if job.prefix_key is not None and job.prefix_key in self.prefix_cache:
                self.prefix_cache.move_to_end(job.prefix_key)
                cached = job.prefix_tokens // calibration.block_size * calibration.block_size
            job.cached_tokens = cached
            job.prefill_tokens = max(1, job.prompt_tokens - cached)
            job.chunk_tokens = min(job.prefill_tokens, calibration.max_num_batched_tokens)
            self.prefill_tokens_queued += job.prefill_tokens
            self.prefilling.append(job)

    def _settle(self, now_s: float) -> None:
        """Admit what fits, set the rates for the new batch, plan the next wake-up."""
        self._admit()
        calibration = self.calibration
        num_decoding = len(self.decoding)
        step_s = calibration.step_base_s  # calibration.step_s(num_decoding), inlined: hot
        if num_decoding > 1:
            step_s += calibration.step_per_seq_s * (num_decoding - 1)
        next_s = INFINITY
        if self.prefilling:
            head = self.prefilling[0]
            step_s += head.chunk_tokens / calibration.prefill_tokens_per_s
            self.prefill_rate = head.chunk_tokens / step_s
            next_s = (head.prefill_tokens - self.head_done) / self.prefill_rate
        else:
            self.prefill_rate = 0.0
        if self.decoding:
            self.decode_rate = 1.0 / step_s
            next_s = min(next_s, (self.decoding[0][0] - self.v) / self.decode_rate)
        else:
            self.decode_rate = 0.0
        self.wake_generation += 1
        if next_s != INFINITY:
            self.loop.at(now_s + max(0.0, next_s), self._wake, self.wake_generation)

    # What an oracle may know.

    def predict_ttft_s(
        self,
        prompt_tokens: int,
        prefix_key: str | None,
        prefix_tokens: int,
        now_s: float,
        num_incoming: int = 0,
        incoming_tokens: int = 0,
    ) -> float:
        """Seconds from now to this request's first token if it arrived now behind what the
        node holds and `num_incoming` requests on their way, and nothing else came: the prefill
        queue ahead of it, a wait for a slot if the node is full, its own prefill."""
        self._advance(now_s)
        calibration = self.calibration
        rate = calibration.prefill_tokens_per_s
        num_decoding = len(self.decoding)
        step_s = calibration.step_base_s  # step_s(num_decoding), inlined: asked of every node
        if num_decoding > 1:
            step_s += calibration.step_per_seq_s * (num_decoding - 1)
        ahead_tokens = self.prefill_tokens_queued - self.head_done + self.waiting_prompt_tokens
        ahead_tokens += incoming_tokens
        num_ahead = len(self.prefilling) + len(self.waiting) + num_incoming
        cached = 0
        if prefix_key is not None and prefix_key in self.prefix_cache:
            cached = prefix_tokens // calibration.block_size * calibration.block_size
        own_tokens = max(1, prompt_tokens - cached)
        wait_s = ahead_tokens / rate + num_ahead * step_s + own_tokens / rate + step_s
        if self.decoding and self.decode_rate > 0.0:
            wait_s += self._admission_wait_s(
                num_ahead + num_decoding >= calibration.max_num_seqs,
                self.blocks_for(prompt_tokens, 0) + self._waiting_blocks(incoming_tokens),
            )
        return wait_s

    def _waiting_blocks(self, incoming_tokens: int) -> int:
        """KV blocks the requests not admitted yet (those on their way included, their prompts
        only) will take before a newcomer is admitted."""
        block_size = self.calibration.block_size
        return sum(job.num_blocks for job in self.waiting) + incoming_tokens // block_size

    def _admission_wait_s(self, is_full: bool, num_blocks_needed: int) -> float:
        """Seconds until the decoding sequences free a slot (`is_full`) and enough KV blocks for
        `num_blocks_needed` (admission takes both, first come first served)."""
        steps = self.decoding[0][0] - self.v if is_full else 0.0
        if num_blocks_needed > self.free_blocks:
            freed = self.free_blocks
            for finish_v, _, job in sorted(self.decoding):
                freed += job.num_blocks
                if freed >= num_blocks_needed:
                    steps = max(steps, finish_v - self.v)
                    break
        return steps / self.decode_rate
