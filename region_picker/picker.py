"""One decision: a request's headers and body in, the node to send it to (or None: let Envoy
balance it; or a `Deflection`: send it back to its gateway, wire/deflection.py) out.
Synchronous and quick: it runs on the ext_proc server's event loop."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass

from engine.chat_template import ChatMessage
from engine.errors import InvalidRequestError
from region_picker.metrics import PickerMetrics
from region_picker.node_book import NodeBook
from region_picker.prompt_hashes import PromptHasher
from region_picker.routed_prefixes import RoutedPrefixes
from region_picker.scoring import CacheView, Decision, deflects, pick
from wire.cache_salt import CACHE_SALT_HEADER, engine_cache_salt
from wire.deflection import ALTERNATIVE_HEADER, alternative_of
from wire.model_catalog import MODEL_HEADER

# OpenAI's name for the system role in newer models; the node agent maps it the same way.
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class Deflection:
    """The request goes back to its gateway: its best node here is further from a first token
    than the next-best region the gateway had for it."""

    wait_s: float
    alternative_s: float


@dataclass(frozen=True, slots=True)
class Prompt:
    model: str | None
    messages: list[ChatMessage] | None  # a chat
    text: str | None  # a completion's prompt
    cache_salt: str | None = None  # the body's own (a client's split of its partition)


def parse_prompt(headers: Mapping[str, str], body: bytes) -> Prompt | None:
    """The request's model and prompt, as the node agent reads them; None if the body is not a
    completion or chat this picker can read (Envoy then balances it as usual)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    model = headers.get(MODEL_HEADER) or data.get("model")
    model = model if isinstance(model, str) else None
    salt = data.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    messages = data.get("messages")
    if isinstance(messages, list):
        chat = [_message(m) for m in messages]
        if any(m is None for m in chat):
            return None
        return Prompt(model, [m for m in chat if m is not None], None, salt)
    prompt = data.get("prompt")
    return Prompt(model, None, prompt if isinstance(prompt, str) else None, salt)


def _message(message: object) -> ChatMessage | None:
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(message, dict) or not isinstance(role, str):
        return None
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        content = "".join(p for p in parts if isinstance(p, str))
    entry: dict[str, str] = {
        "role": _ROLE_ALIASES.get(role, role),
        "content": content if isinstance(content, str) else "",
    }
    if isinstance(message.get("name"), str) and message["name"]:
        entry["name"] = message["name"]
    return entry


class Picker:
    def __init__(
        self,
        nodes: NodeBook,
        hashers: Mapping[str, PromptHasher],
        cache: CacheView,
        routed: RoutedPrefixes,
        metrics: PickerMetrics,
        rng: random.Random,
    ) -> None:
        self._nodes = nodes
        self._hashers = hashers  # by served model name
        self._cache = cache
        self._routed = routed
        self._metrics = metrics
        self._rng = rng

    def decide(self, headers: Mapping[str, str], body: bytes) -> Decision | Deflection | None:
        prompt = parse_prompt(headers, body)
        if prompt is None:
            self._metrics.fallback("unreadable_body")
            return None
        # Salted as the node salts it: the gateway's header and the body's own field.
        salt = engine_cache_salt(headers.get(CACHE_SALT_HEADER), prompt.cache_salt)
        hasher = self._hashers.get(prompt.model or "")
        hashes = self._hashes(hasher, prompt, salt) if hasher is not None else []
        prefix = hashes[0] if hashes else None  # its own prefix's sends are no work ahead of it
        candidates = self._nodes.candidates(prompt.model, prefix)
        if not candidates:
            self._metrics.fallback("no_candidate")
            return None
        if hasher is not None and hasher.block_size != candidates[0].block_size:
            # Nodes that keep blocks of another size: no sends were ever noted under a prefix
            # of this size, so the candidates' counts stand; load alone decides.
            hashes, prefix = [], None
        decision = pick(candidates, hashes, self._cache, self._rng)
        assert decision is not None
        alternative_s = alternative_of(headers.get(ALTERNATIVE_HEADER))
        if deflects(decision, alternative_s):
            assert alternative_s is not None and decision.wait_s is not None
            self._metrics.deflections.inc()
            return Deflection(decision.wait_s, alternative_s)
        chosen = decision.chosen
        node_id, block_size = chosen.candidate.node_id, chosen.candidate.block_size
        # Its full blocks not cached there, and the partial last block, which never is.
        uncached = (len(hashes) - chosen.cached_blocks + 1) * block_size
        self._nodes.note_sent(node_id, uncached, prefix)
        self._routed.record(node_id, hashes)
        self._metrics.decided(decision, len(hashes))
        return decision

    def started(self, node_id: str) -> None:
        """The response of a request sent to `node_id` has started (or the request ended)."""
        self._nodes.note_started(node_id)

    @staticmethod
    def _hashes(hasher: PromptHasher, prompt: Prompt, salt: str | None) -> list[bytes]:
        try:
            if prompt.messages is not None:
                return hasher.chat_hashes(prompt.messages, salt)
            if prompt.text:
                return hasher.text_hashes(prompt.text, salt)
        except InvalidRequestError:
            pass  # the node will refuse it with its own 400; anywhere will do
        return []
