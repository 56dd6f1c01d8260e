"""The seeded serving workload that the engine benchmark and the HTTP load generator both replay.

Each request is one chat turn made of real English words (so chat templates apply and the
tokenizer sees ordinary text), sized with the model's own tokenizer: the rendered prompt has a
length drawn uniformly from `prompt_tokens` and the reply a `max_tokens` drawn from
`output_tokens`. Replay it with `ignore_eos` so every request generates exactly `max_tokens`.
The same (num_requests, seed, tokenizer) always gives the same workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.tokenizer import Tokenizer

DEFAULT_PROMPT_TOKENS = (32, 512)
DEFAULT_OUTPUT_TOKENS = (16, 256)

_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population truth song
river stone garden bridge winter summer island mountain forest ocean village castle engine
"""
_WORDS = tuple(_WORD_TEXT.split())

_OPENINGS = (
    "Write a short report that uses these words:",
    "Tell a story about the following:",
    "Summarise the ideas behind these notes:",
    "Explain how these things are connected:",
    "Describe a day that involves all of these:",
)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    messages: tuple[dict[str, str], ...]  # the chat turn, for OpenAI-style endpoints
    prompt_token_ids: tuple[int, ...]  # the same turn rendered by the chat template and encoded
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(
    num_requests: int,
    seed: int,
    tokenizer: Tokenizer,
    prompt_tokens: tuple[int, int] = DEFAULT_PROMPT_TOKENS,
    output_tokens: tuple[int, int] = DEFAULT_OUTPUT_TOKENS,
    prompt_per_output: int | None = None,
) -> list[WorkloadRequest]:
    """`num_requests` chat requests; prompt and output lengths in tokens, bounds inclusive.
    With `prompt_per_output`, each prompt is that many times its own output instead (and
    `prompt_tokens` is unused): a prompt-heavy mix whose long requests are long both ways."""
    (min_prompt, max_prompt), (min_output, max_output) = prompt_tokens, output_tokens
    if num_requests < 0 or not 1 <= min_prompt <= max_prompt or not 1 <= min_output <= max_output:
        raise ValueError("num_requests must be >= 0 and each range (low, high) with 1 <= low")
    if prompt_per_output is not None and prompt_per_output < 1:
        raise ValueError("prompt_per_output must be >= 1")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        if prompt_per_output is None:
            target = rng.randint(*prompt_tokens)
            max_tokens = rng.randint(*output_tokens)
        else:
            max_tokens = rng.randint(*output_tokens)
            target = prompt_per_output * max_tokens
        opening = rng.choice(_OPENINGS)
        words = [rng.choice(_WORDS) for _ in range(target)]  # never more words than tokens
        messages, token_ids = _fit(tokenizer, opening, words, target)
        requests.append(WorkloadRequest(messages, token_ids, max_tokens))
    return requests


def _render(
    tokenizer: Tokenizer, opening: str, words: list[str]
) -> tuple[tuple[dict[str, str], ...], tuple[int, ...]]:
    sentences = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    content = opening + " " + ". ".join(s.capitalize() for s in sentences if s) + "."
    messages = ({"role": "user", "content": content},)
    token_ids = tuple(tokenizer.encode(tokenizer.render_chat(list(messages))))
    return messages, token_ids


def _fit(
    tokenizer: Tokenizer, opening: str, words: list[str], target: int
) -> tuple[tuple[dict[str, str], ...], tuple[int, ...]]:
    """The longest prefix of `words` whose rendered prompt has at most `target` tokens (at
    least one word, so a target below the template's own overhead still gives a request)."""
    low, high = 1, len(words)
    best = _render(tokenizer, opening, words[:1])
    while low <= high:
        middle = (low + high) // 2
        candidate = _render(tokenizer, opening, words[:middle])
        if len(candidate[1]) <= target:
            best = candidate
            low = middle + 1
        else:
            high = middle - 1
    return best
