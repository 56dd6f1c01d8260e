"""The synchronous engine: add requests, step, collect outputs. One thread drives it."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from engine.cache_events import CacheEvents
from engine.config import EngineConfig, WeightsFormat
from engine.errors import InvalidRequestError
from engine.executor import ModelExecutor
from engine.grammar import CompiledGrammar, GrammarCompiler
from engine.kernels import cpu_kernels
from engine.kv_cache_manager import KVCacheManager
from engine.kv_profile import LargestStep, kv_budget_bytes, peak_step_bytes
from engine.loader import load_checkpoint
from engine.model.llama import keeps_q4_1_blocks
from engine.model_config import ModelConfig
from engine.model_runner import RunnerShape
from engine.model_store import resolve_model
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.prefill_rate import PrefillRate
from engine.request_limits import RequestLimits
from engine.request_state import Finish, RequestState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from wire.capacity import DECODE_RATE_WINDOW_S

# How long a step with nothing to run but grammars compiling waits for one before it returns
# (the loop then reads its inbox again).
_COMPILE_WAIT_S = 0.05

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of load and capacity, for the node agent's metrics and heartbeats."""

    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int
    num_running_prefill_tokens: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float | None = None  # measured (engine/prefill_rate.py); None: not yet
    step_s: float | None = None  # a step's fixed part, measured there too; None: not yet


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        grammar_compiler: Callable[[Tokenizer, int], GrammarCompiler] = GrammarCompiler,
    ):
        """`grammar_compiler` makes the compiler of constrained requests' grammars from the
        tokenizer and the vocabulary's size (a test holds its compiles with its own)."""
        self.config = config
        checkpoint = load_checkpoint(resolve_model(config.model))
        self.model_config: ModelConfig = checkpoint.config
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        device, dtype = config.torch_device(), config.torch_dtype()
        context_len = min(
            self.model_config.max_position_embeddings,
            config.max_model_len or self.model_config.max_position_embeddings,
        )
        started = time.monotonic()
        keeps_q4_1 = (
            device.type == "cpu"
            and keeps_q4_1_blocks(checkpoint, config.tensor_parallel_size)
            and cpu_kernels() is not None
        )
        shape = RunnerShape(
            device,
            dtype,
            config.block_size,
            context_len,
            config.weight_quantization(keeps_q4_1),
            config.kv_torch_dtype(dtype),
        )
        self.weights_format = WeightsFormat.of(dtype, shape.quantization, config.kv_cache_dtype)
        self.executor = ModelExecutor(
            checkpoint,
            shape,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.parallel_step_timeout_s,
        )
        scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_num_prefill_only_tokens
        )
        largest_step = LargestStep(
            scheduler_config.token_budget(has_decodes=False), config.max_num_seqs, context_len
        )
        num_blocks = self._num_kv_blocks(device, largest_step)
        self.executor.allocate_kv_cache(num_blocks, config.max_num_seqs)
        # A request alone must always fit in the pool, or preemption could never make room.
        self.max_model_len = min(context_len, num_blocks * config.block_size)
        self.limits = RequestLimits(self.max_model_len, self.model_config.vocab_size)
        kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, kv_cache)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len)
        self.grammars = grammar_compiler(self.tokenizer, self.model_config.vocab_size)
        # Constrained requests whose grammar is compiling: followed, not yet scheduled.
        self._compiling: dict[str, tuple[Sequence, Future[CompiledGrammar]]] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._prefill_rate = PrefillRate()
        # When each batch in flight was submitted, and when the last one was collected: a
        # batch's time is from the later of the two (pipelined batches overlap) to its collect.
        self._submitted_at: deque[float] = deque()
        self._collected_at = 0.0
        logger.info(
            "loaded %s (%s%s, %s) in %.1f s; context %d tokens",
            config.model,
            dtype,
            "" if shape.quantization == "none" else f", {shape.quantization} weights",
            device,
            time.monotonic() - started,
            self.max_model_len,
        )

    def _num_kv_blocks(self, device: torch.device, largest_step: LargestStep) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if device.type == "cuda":
            peak = 0
            # Ranks in other processes would have to join the run; they are not profiled.
            if self.executor.workers is None:
                peak = peak_step_bytes(self.executor.runner, largest_step)
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
            budget = kv_budget_bytes(
                free_bytes, total_bytes, self.config.gpu_memory_utilization, peak
            )
            logger.info("KV budget %.2f GiB after a step peaking at %.2f GiB", budget / 2**30,
                        peak / 2**30)  # fmt: skip
        else:
            budget = self.config.cpu_kv_cache_gib * 2**30
        num_blocks = int(budget // self.executor.kv_bytes_per_block)
        if num_blocks < 1:
            raise InvalidRequestError("no memory is left for the KV cache")
        return num_blocks

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        resumed_token_ids: list[int] | None = None,
    ) -> None:
        """Check and queue a request; raises InvalidRequestError (RequestRejected when the
        request itself cannot run) and queues nothing if it cannot run.

        `prompt_text` names the text that `prompt` token ids came from, for the outputs. A
        `cache_salt` confines the request's prefix-cache hits to requests of the same salt.
        `resumed_token_ids` continue a generation that began elsewhere: they count as output
        already made (so seeded sampling goes on at their position and stop strings see their
        text); delta outputs start after them, cumulative ones include them (the generation so
        far); `params.max_tokens` counts only new tokens."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        self.limits.check(token_ids, params, resumed_token_ids, cache_salt)
        self.add_checked_request(
            request_id, token_ids, params, prompt_text, cache_salt, resumed_token_ids
        )

    def add_checked_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None,
        cache_salt: str | None,
        resumed_token_ids: list[int] | None,
    ) -> None:
        """Queue a request that the front has checked (`AsyncEngine.generate` for the engine
        core); as `add_request` otherwise."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        resumed = list(resumed_token_ids or ())
        room = self.max_model_len - len(token_ids) - len(resumed)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seq = Sequence(
            request_id,
            token_ids,
            params,
            len(resumed) + max_tokens,
            cache_salt=cache_salt,
            token_ids=token_ids + resumed,
        )
        self.output_processor.add(seq, prompt_text)
        if params.grammar is None:
            self.scheduler.add(seq)
        else:
            self._compiling[request_id] = (seq, self.grammars.compile(params.grammar))

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled; end those whose grammar failed
        (finish "error", what failed in `stop_reason`)."""
        outputs: list[RequestOutput] = []
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            self.scheduler.add(seq)
            try:
                seq.grammar = self.grammars.matcher(future.result(), seq.output_token_ids)
            except Exception as exc:  # a grammar's failure ends its request only
                logger.warning("%s: its grammar failed: %s", request_id, exc)
                finish = Finish("error", f"grammar error: {exc}")
                outputs += self.output_processor.abort([request_id], time.monotonic(), finish)
        return outputs

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests, by id."""
        return self.output_processor.requests

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Stop these requests now and free their blocks; unknown ids are ignored."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:  # the scheduler retires it as any waiting request
                self.scheduler.add(compiling[0])
        return self.output_processor.abort(request_ids, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.executor.in_flight)

    def step(self) -> list[RequestOutput]:
        """Schedule a batch and start it if the pipeline has room; collect the oldest batch in
        flight once that is due; turn its sampled tokens into outputs. With one pipeline stage
        each step starts and collects one batch; with M stages up to M batches of disjoint
        sequences are in flight, so a step may only start one and return [].
        Requests whose grammar is compiling join once it is compiled; a step with nothing
        else to do waits a little for one."""
        admitted = self._admit_compiled() if self._compiling else []
        started = self._schedule()
        if not self._is_collect_due(started):
            if not started and not self.executor.in_flight and self._compiling:
                futures = [future for _, future in self._compiling.values()]
                wait(futures, _COMPILE_WAIT_S, FIRST_COMPLETED)
            return admitted
        batch, result = self.executor.collect()
        self.scheduler.update_after_step(batch)
        now = time.monotonic()
        num_prompt_tokens = batch.num_tokens - len(result.seqs)
        started_at = max(self._submitted_at.popleft(), self._collected_at)
        self._collected_at = now
        self._prefill_rate.record(num_prompt_tokens, now - started_at)
        self._count_tokens(now, num_prompt_tokens, len(result.seqs))
        return admitted + self.output_processor.process(result, now)

    def _schedule(self) -> bool:
        """Start the next batch if the pipeline has room; whether one started."""
        depth = self.config.pipeline_parallel_size
        if len(self.executor.in_flight) >= depth:
            return False
        # Even batches: each stage then takes about as long on each.
        batch = self.scheduler.schedule(-(-self.scheduler.num_unfinished // depth))
        if not batch:
            return False
        self._submitted_at.append(time.monotonic())
        self.executor.submit(batch)
        return True

    def _is_collect_due(self, started: bool) -> bool:
        """Collect once the pipeline is full, or while batches are in flight and none could
        start (there is nothing else to do)."""
        num_in_flight = len(self.executor.in_flight)
        return num_in_flight >= self.config.pipeline_parallel_size or (
            num_in_flight > 0 and not started
        )

    def watch_cache_events(self) -> CacheEvents:
        """Record the prefix cache's changes from now on; returns what it holds now."""
        return self.scheduler.kv_cache.watch_events()

    def take_cache_events(self) -> CacheEvents | None:
        """The prefix cache's changes since the last call (None: none, or not watched)."""
        return self.scheduler.kv_cache.take_events()

    def shutdown(self) -> None:
        """Stop the parallel workers, if any; the engine cannot step afterwards."""
        self.grammars.shutdown()
        self.executor.shutdown()

    def _count_tokens(self, now: float, num_prompt_tokens: int, num_generated: int) -> None:
        self._prompt_tokens_total += num_prompt_tokens
        self._generation_tokens_total += num_generated
        self._recent_tokens.append((now, num_generated))
        while self._recent_tokens and self._recent_tokens[0][0] < now - DECODE_RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache
        s = self.scheduler.stats
        now = time.monotonic()
        recent = sum(n for t, n in self._recent_tokens if t >= now - DECODE_RATE_WINDOW_S)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_prefill_tokens=self.scheduler.num_waiting_tokens,
            num_running_prefill_tokens=self.scheduler.num_running_prefill_tokens,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            block_size=kv.block_size,
            kv_cache_usage=kv.usage,
            prefix_cache_queried_tokens=s.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=s.num_prefix_hit_tokens,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions_total=s.num_preemptions,
            decode_tokens_per_s=recent / DECODE_RATE_WINDOW_S,
            prefill_tokens_per_s=self._prefill_rate.tokens_per_s,
            step_s=self._prefill_rate.step_s,
        )
