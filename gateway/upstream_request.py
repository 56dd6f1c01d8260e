"""A request as the gateway sends it upstream, kept as data until it is sent.

A completion's body is the client's JSON after the gateway's checks and its own fields
(gateway/openai_request.py). The gateway edits it for the model it resolved the request to (and
each fallback it tries), for the edge (the real model behind `auto`), for a continuation (the
ids relayed, fewer tokens left) and for a prewarm (one token, not streamed): each edit makes
a new `UpstreamBody` from the fields, never from the bytes, and `encode` is the one way a body
becomes bytes. It encodes at once rather than at the send: the encoding is what finds text JSON
cannot carry (a lone surrogate), which must be a 400 before admission, and a body sent to
several regions in turn is encoded once.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from gateway.errors import InvalidRequestError
from wire.model_catalog import MODEL_HEADER
from wire.output_limit import set_output_limit


def encode(fields: Mapping[str, object]) -> bytes:
    """A body's bytes on the wire: compact, text as UTF-8 (not escaped)."""
    try:
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        raise InvalidRequestError(
            "request body holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text",
            "invalid_unicode",
        ) from None
    except RecursionError:  # within json.loads's limit, but deeper in the stack here
        raise InvalidRequestError("request body is nested too deeply", "invalid_json") from None


@dataclass(frozen=True, slots=True)
class UpstreamBody:
    """A completion's JSON body: its fields (never changed: an edit makes a new body), the
    output limit written in them, and their encoding."""

    fields: Mapping[str, object]
    max_tokens: int
    encoded: bytes

    @classmethod
    def of(cls, fields: Mapping[str, object], max_tokens: int) -> UpstreamBody:
        """`fields`, whose output limit is `max_tokens` already, encoded (InvalidRequestError:
        they hold what JSON text cannot)."""
        return cls(fields, max_tokens, encode(fields))

    def edited(
        self,
        changes: Mapping[str, object],
        removed: Collection[str] = (),
        max_tokens: int | None = None,
    ) -> UpstreamBody:
        """This body with `changes` set, the `removed` fields gone and, given `max_tokens`, that
        output limit (under both of OpenAI's names where the body uses the newer one)."""
        fields = {name: value for name, value in self.fields.items() if name not in removed}
        fields.update(changes)
        if max_tokens is None:
            max_tokens = self.max_tokens
        else:
            set_output_limit(fields, max_tokens)
        return UpstreamBody.of(fields, max_tokens)


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    path: str
    body: UpstreamBody | None
    headers: dict[str, str]  # all of them: nothing of the client's is forwarded
    is_stream: bool

    @property
    def max_tokens(self) -> int:
        """The output limit (0 without a body): sizes a non-stream's first-byte timeout."""
        return self.body.max_tokens if self.body is not None else 0

    @property
    def data(self) -> bytes | None:
        return self.body.encoded if self.body is not None else None

    def with_header(self, name: str, value: str) -> UpstreamRequest:
        return replace(self, headers={**self.headers, name: value})

    def for_model(self, model: str) -> UpstreamRequest:
        """This request for `model`: its body's `model` and MODEL_HEADER (what a region's
        ingress routes on) name it."""
        body = self.body
        if body is not None and body.fields.get("model") != model:
            body = body.edited({"model": model})
        return replace(self, body=body, headers={**self.headers, MODEL_HEADER: model})
