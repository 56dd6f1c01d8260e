"""How many tokens a prompt is, without its model's tokenizer: a likely figure and an upper bound.

The upper bound sizes the rate-limit reservation, so that no prompt is ever charged less than
the node will count. Byte-level BPE (and SentencePiece with byte fallback) never makes more
tokens of a text than it has UTF-8 bytes: every token but a special one stands for at least one
byte. What the chat template adds around the text is bounded by two allowances: one per message
(the special tokens and separators around a turn: 4 in ChatML, 5 in Llama 3) and one per
conversation (the generation prompt and a default system prompt: 25 tokens for SmolLM2's). A
completion prompt may gain a BOS token and SentencePiece's dummy space. Roles and names are
counted at their bytes as well, being text the template may render.

The likely figure routes the request (the prefill the router predicts, the edge tier's "light"):
about 4 characters a token for English, and about 3 tokens for 4 bytes of the rest (SmolLM2
makes 3.1 tokens of an emoji, 4 bytes; 1.5 of a Chinese character, 3 bytes). The bound would
count English at 4 times its tokens and send ordinary prompts past the edge.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CHARS_PER_TOKEN = 4
LIKELY_TOKENS_PER_MESSAGE = 4
MAX_TEMPLATE_TOKENS_PER_MESSAGE = 8
MAX_TEMPLATE_TOKENS_PER_CHAT = 32
MAX_ADDED_TOKENS_PER_PROMPT = 2  # BOS, and SentencePiece's dummy space


@dataclass(frozen=True, slots=True)
class PromptEstimate:
    likely_tokens: int  # for routing
    max_tokens: int  # never fewer than the node's tokenizer makes: for rate limits


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """What the chat template renders of one message."""

    role: str
    name: str | None
    text: str


def _num_bytes(text: str) -> int:
    # surrogatepass: a lone surrogate is refused later as not text, not miscounted here.
    return len(text.encode("utf-8", "surrogatepass"))


def _likely(num_chars: int, num_bytes: int) -> int:
    num_extra_bytes = num_bytes - num_chars  # beyond one a character: non-ASCII text
    return num_chars // CHARS_PER_TOKEN + num_extra_bytes * 3 // 4


def of_chat(turns: Iterable[ChatTurn]) -> PromptEstimate:
    num_turns = num_chars = num_bytes = num_header_bytes = 0
    for turn in turns:
        num_turns += 1
        num_chars += len(turn.text)
        num_bytes += _num_bytes(turn.text)
        num_header_bytes += _num_bytes(turn.role) + _num_bytes(turn.name or "")
    likely_overhead = num_turns * LIKELY_TOKENS_PER_MESSAGE
    max_overhead = num_turns * MAX_TEMPLATE_TOKENS_PER_MESSAGE + MAX_TEMPLATE_TOKENS_PER_CHAT
    return PromptEstimate(
        likely_tokens=_likely(num_chars, num_bytes) + likely_overhead + 1,
        max_tokens=num_bytes + num_header_bytes + max_overhead,
    )


def of_texts(prompts: Iterable[str]) -> PromptEstimate:
    likely = bound = 0
    for prompt in prompts:
        num_bytes = _num_bytes(prompt)
        likely += _likely(len(prompt), num_bytes) + 1
        bound += num_bytes + MAX_ADDED_TOKENS_PER_PROMPT
    return PromptEstimate(likely, bound)


def of_token_ids(prompts: Iterable[list[int]]) -> PromptEstimate:
    num_tokens = sum(len(ids) for ids in prompts)
    return PromptEstimate(num_tokens, num_tokens)
