"""Streaming detokenization: text deltas from token ids that arrive one at a time.

Decoding each token alone is wrong twice over: a character can span tokens (an emoji is four
bytes, often split across two or more tokens), and some decoders change a token's text with its
neighbours (SentencePiece drops the leading space only at the start). So we decode a short window
of recent ids, compare it with the same window minus the new ids, and emit the difference. While
the window ends in U+FFFD (an incomplete UTF-8 sequence) we hold the text back.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas; their concatenation is `decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # ids[:_prefix_offset] are emitted and decode on their own; ids[_prefix_offset:
        # _read_offset] are emitted too but kept as context for the next decode.
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """At the end of the stream: whatever is still held back, incomplete characters and all."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        window = self.token_ids[self._prefix_offset :]
        new_text = self._decode(window)
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # wait for the bytes that complete the character
        emitted = self._decode(window[: self._read_offset - self._prefix_offset])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
