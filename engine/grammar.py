"""Constrained decoding: grammars compiled off the step loop, and each constrained sequence's
matcher, which masks its next token and follows the tokens it is given.

Compiling runs on one thread of its own (llguidance drops the GIL while it builds a grammar),
cached by spec: a request whose grammar is not compiled yet waits outside the scheduler
(`LLMEngine`) while the batch steps on. Each request gets a copy of the compiled matcher. A
server's front compiles with a compiler of its own to refuse a grammar that does not compile
against the vocabulary before it queues anything (node_agent/serving.py).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property

import llguidance
import torch

from engine.errors import InvalidRequestError
from engine.grammar_spec import GrammarSpec
from engine.tokenizer import Tokenizer

CompiledGrammar = llguidance.LLMatcher  # a matcher at the start, copied for each request
_MAX_CACHED = 128  # compiled grammars kept, least recently used dropped first


class GrammarError(InvalidRequestError):
    """A grammar that does not compile against this vocabulary, or a matcher that failed."""


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w is
        token 32 w + i)."""
        self._matcher.unsafe_compute_mask_ptr(
            bitmask[row].data_ptr(), bitmask.shape[1] * bitmask.element_size()
        )

    def accept(self, token_id: int) -> None:
        """Follow a sampled token; raises GrammarError if the matcher is (or gets) in error."""
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            raise GrammarError(f"grammar error: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar has ended: nothing more may follow."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles specs on its own thread; the vocabulary is read on the first compile."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()

    def compile(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The spec's compiled grammar, from the cache or being compiled."""
        future = self._cache.get(spec)
        if future is None:
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
            if len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return future

    @staticmethod
    def matcher(compiled: CompiledGrammar, output_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher of a compiled grammar, past the output so far (a resumed request)."""
        matcher = GrammarMatcher(compiled.deep_copy())
        for token_id in output_token_ids:
            matcher.accept(token_id)
        return matcher

    @cached_property
    def _vocabulary(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self._tokenizer.to_json(),
            n_vocab=self._vocab_size,
            eos_token=sorted(self._tokenizer.stop_token_ids),
        )

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        matcher = llguidance.LLMatcher(self._vocabulary, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.param}: {matcher.get_error()}")
        # A grammar that no token of this vocabulary can start (a choice of characters it
        # cannot spell, a regex matching nothing) errs on its first mask: found here, before
        # any sequence of it runs.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(
                f"{spec.param}: no output of it can be spelled with this model's vocabulary"
            )
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
