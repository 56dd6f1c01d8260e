"""A prompt's prefix-block hashes, exactly as the engine keys its prefix cache
(engine/kv_cache_manager.py: `chain_root(salt)`, then `hash_block` over each full block of token
ids), for a chat rendered by the model's own template and tokenized by its own tokenizer.

Speed: a tenant's long system prompt would cost a full encode (1,500 tokens: milliseconds) on
every request. The tokenizer splits text at its added tokens (`<|im_start|>`, `<|im_end|>`, ...)
before anything else, so the ids of a rendered chat are the ids of its pieces between added
tokens, concatenated. The hasher walks those pieces and remembers, per (salt, leading pieces),
the chain so far (the full blocks' hashes and the ids of the part-filled block): a request that
repeats a known prefix resumes there and encodes and hashes only what follows it. A tokenizer
whose added tokens strip their neighbours is not split that way (engine/tokenizer.py
`split_points`); its text is encoded whole.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.chat_template import ChatMessage
from engine.kv_cache_manager import chain_root, hash_block
from engine.tokenizer import Tokenizer

DEFAULT_MEMO_SIZE = 4096


@dataclass(frozen=True, slots=True)
class _Chain:
    """The hash chain after some leading pieces of a prompt."""

    hashes: tuple[bytes, ...]  # one per full block
    tail: tuple[int, ...]  # the ids after the last full block (fewer than a block)


class PromptHasher:
    """Block hashes of prompts for one model's tokenizer and one block size."""

    def __init__(
        self, tokenizer: Tokenizer, block_size: int, memo_size: int = DEFAULT_MEMO_SIZE
    ) -> None:
        if block_size < 1:
            raise ValueError("a block holds at least one token")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._memo_size = memo_size
        self._memo: OrderedDict[tuple[bytes, tuple[str, ...]], _Chain] = OrderedDict()
        points = tokenizer.split_points
        self._splitter = (
            re.compile("(" + "|".join(map(re.escape, points)) + ")") if points else None
        )
        first = tokenizer.encode("")
        self._bos = first[0] if first else None  # a tokenizer that adds BOS adds it to any text
        self.num_memo_hits = 0

    def chat_hashes(self, messages: Sequence[ChatMessage], cache_salt: str | None) -> list[bytes]:
        """The hashes of the chat's prompt (generation prompt added), as the node would make it.
        Raises engine.errors.InvalidRequestError if the template refuses the chat."""
        text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return self.text_hashes(text, cache_salt)

    def text_hashes(self, text: str, cache_salt: str | None) -> list[bytes]:
        root = chain_root(cache_salt)
        if self._splitter is None:
            return list(self._extend(root, _Chain((), ()), self.tokenizer.encode(text)).hashes)
        pieces = tuple(piece for piece in self._splitter.split(text) if piece)
        start, chain = self._longest_known(root, pieces)
        if start == 0 and self._bos is not None:
            chain = _Chain((), (self._bos,))
        for count in range(start + 1, len(pieces) + 1):
            chain = self._extend(root, chain, self._ids_of(pieces[count - 1]))
            if count < len(pieces) and chain.hashes:
                self._remember((root, pieces[:count]), chain)
        return list(chain.hashes)

    def _ids_of(self, piece: str) -> list[int]:
        ids = self.tokenizer.encode(piece)
        return ids[1:] if self._bos is not None else ids

    def _longest_known(self, root: bytes, pieces: tuple[str, ...]) -> tuple[int, _Chain]:
        for count in range(len(pieces) - 1, 0, -1):
            key = (root, pieces[:count])
            chain = self._memo.get(key)
            if chain is not None:
                self._memo.move_to_end(key)
                self.num_memo_hits += 1
                return count, chain
        return 0, _Chain((), ())

    def _extend(self, root: bytes, chain: _Chain, ids: Sequence[int]) -> _Chain:
        pending = [*chain.tail, *ids]
        hashes = list(chain.hashes)
        bs = self.block_size
        num_full = len(pending) // bs
        for index in range(num_full):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, pending[index * bs : (index + 1) * bs]))
        return _Chain(tuple(hashes), tuple(pending[num_full * bs :]))

    def _remember(self, key: tuple[bytes, tuple[str, ...]], chain: _Chain) -> None:
        self._memo[key] = chain
        self._memo.move_to_end(key)
        while len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
