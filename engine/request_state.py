"""One request's output state: detokenization, stop conditions, and the outputs a caller sees."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind
from engine.sequence import Sequence, TokenLogprobs
from engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a request stopped: `reason` is "stop", "length", "abort" or "error" (its grammar
    failed); `stop_reason` is the stop string or stop token id that matched, if one did, or on
    "error" what failed."""

    reason: str
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    max_model_len: int
    text: str = ""
    # For DELTA outputs: how much of the text and tokens earlier outputs already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finished_time: float | None = None
    _max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.seq.params.stop), default=0)

    @classmethod
    def create(
        cls, seq: Sequence, prompt: str | None, tokenizer: Tokenizer, max_model_len: int
    ) -> RequestState:
        detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=seq.params.skip_special_tokens
        )
        return cls(seq, prompt, detok, tokenizer.stop_token_ids, max_model_len)

    def resume(self) -> None:
        """Take the output tokens the sequence starts with (a generation resumed from elsewhere)
        as already streamed: their text primes the detokenizer and stop-string search, and the
        outputs start after them, where the interrupted run's outputs had got to."""
        seq = self.seq
        for token_id in seq.output_token_ids:
            self.text += self.detokenizer.push(token_id)
        self.num_sent_tokens = seq.num_output_tokens
        visible = len(self.text)
        if self._max_stop_len:
            visible = max(visible - self._max_stop_len + 1, 0)
        self.num_sent_chars = visible

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> Finish | None:
        """Record a sampled token; why the request is done, if it is."""
        seq = self.seq
        params = seq.params
        seq.token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.grammar is not None:
            try:
                seq.grammar.accept(token_id)
            except GrammarError as exc:  # this sequence ends; the batch goes on
                return Finish("error", str(exc))
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.text += self.detokenizer.finish()
            return Finish("stop")
        if token_id in params.stop_token_ids:
            self.text += self.detokenizer.finish()
            return Finish("stop", token_id)
        delta = self.detokenizer.push(token_id)
        self.text += delta
        if params.stop and delta:
            stop = self._cut_at_stop(len(delta))
            if stop is not None:
                return Finish("stop", stop)
        if seq.grammar is not None and seq.grammar.is_finished:
            self.text += self.detokenizer.finish()
            return Finish("stop")
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.text += self.detokenizer.finish()
            return Finish("length")
        return None

    def _cut_at_stop(self, delta_len: int) -> str | None:
        """Find the first stop string the new text completes and cut the text there."""
        search_from = max(len(self.text) - delta_len - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.seq.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[
            : at + len(stop) if self.seq.params.include_stop_str_in_output else at
        ]
        return stop

    def output(self, finished: bool) -> RequestOutput | None:
        """This step's output for the caller, in the request's output kind (None: nothing due)."""
        seq = self.seq
        kind = seq.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # While a stop string could still be forming at the end, hold that tail back.
        visible = len(self.text)
        if not finished and self._max_stop_len:
            visible = max(visible - self._max_stop_len + 1, 0)
        token_ids = seq.output_token_ids
        logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
        if kind is RequestOutputKind.DELTA:
            text = self.text[self.num_sent_chars : visible]
            new_tokens = token_ids[self.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self.num_sent_tokens :]
            self.num_sent_chars = max(visible, self.num_sent_chars)
            self.num_sent_tokens = len(token_ids)
            token_ids = new_tokens
        else:
            text = self.text[:visible]
        cumulative = sum(lp.logprob for lp in seq.output_logprobs) if logprobs is not None else None
        completion = CompletionOutput(
            0, text, token_ids, cumulative, logprobs, seq.finish_reason, seq.stop_reason
        )
        metrics = RequestMetrics(
            seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, self.finished_time
        )
        return RequestOutput(
            seq.request_id,
            self.prompt,
            seq.prompt_token_ids,
            [completion],
            finished,
            seq.num_cached_tokens,
            metrics,
        )
