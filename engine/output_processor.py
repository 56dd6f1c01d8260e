"""Turns a step's sampled tokens into the callers' outputs: each request's stop checks, and the
finishing of the requests that stopped (or were aborted)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.executor import StepOutput
from engine.outputs import RequestOutput
from engine.request_state import Finish, RequestState
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

_ABORTED = Finish("abort")


@dataclass(slots=True)
class OutputProcessor:
    """The only owner of the requests' output states; finishing a request retires its sequence
    in the scheduler."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    max_model_len: int
    requests: dict[str, RequestState] = field(default_factory=dict)

    def add(self, seq: Sequence, prompt_text: str | None) -> None:
        """Follow a new request; output tokens it starts with count as already streamed."""
        state = RequestState.create(seq, prompt_text, self.tokenizer, self.max_model_len)
        state.resume()
        self.requests[seq.request_id] = state

    def process(self, step: StepOutput, now: float) -> list[RequestOutput]:
        """Append each sequence's new token, finish those that stopped, and return the outputs
        due; a sequence aborted while its batch was in flight is skipped."""
        outputs = []
        sampled = step.sampled
        for seq, token_id, logprobs in zip(
            step.seqs, sampled.token_ids, sampled.logprobs, strict=True
        ):
            if seq.is_finished:
                continue
            state = self.requests[seq.request_id]
            finish = state.append_token(token_id, logprobs)
            if finish is not None:
                self._finish(state, finish, now)
            output = state.output(finished=finish is not None)
            if output is not None:
                outputs.append(output)
        return outputs

    def abort(
        self, request_ids: Iterable[str], now: float, finish: Finish = _ABORTED
    ) -> list[RequestOutput]:
        """Finish these requests now, as aborted (or as `finish` says); unknown ids are
        ignored."""
        outputs = []
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            self._finish(state, finish, now)
            output = state.output(finished=True)
            if output is not None:
                outputs.append(output)
        return outputs

    def _finish(self, state: RequestState, finish: Finish, now: float) -> None:
        seq = state.seq
        self.scheduler.finish(seq, finish.reason)
        seq.stop_reason = finish.stop_reason
        state.finished_time = now
        del self.requests[seq.request_id]
