"""`GET /v1/models` and `GET /v1/models/{model}` at the gateway, answered from the region
summaries document it holds: the names a request may name (gateway/model_routes.py resolves the
same names for completions), never a node's own list.

Each entry is OpenAI's (`id`, `object: "model"`, `created`, `owned_by`) with a `meridian` field:
the regions that serve its model right now (the model in their summary with healthy nodes > 0,
by name) and, for an alias and `auto`, the model it names. Listed, of the names the key may use
(a key limited to a list may use a name the list holds, or whose model it holds):

- a catalog that lists models: its models, then its aliases, in the catalog's order; an alias
  has its model's `created` and `owned_by`;
- an empty catalog: the models the regions list, by name (`created` 0: nobody said when);
- `auto` last, when this gateway has the alias (`--auto-model`) and the document routes what it
  names (gateway/edge.py).

A version 1 document (a control plane that predates models) keeps the old answer: the list of a
node in the nearest region, with `auto` added (api.Handlers.models); it has no single entries.

The entries are worked out on the first call after each document, and each key-access set's
list encoded once per document: a call costs a dictionary lookup whatever the catalog's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from gateway.api import Handlers
from gateway.calls import POP_HEADER, Call
from gateway.edge import AutoTier
from gateway.errors import GatewayError, ModelNotFoundError, NotReadyError
from gateway.keys import ApiKey
from gateway.metrics import NO_REGION
from gateway.region_state import RegionState
from gateway.request_ids import HEADER
from gateway.routing import Router
from gateway.tiers import AUTO_MODEL

# Key-access sets whose encoded list is kept per document (past it, the cache starts again).
MAX_ENCODED_LISTS: Final = 256

Card = dict[str, object]


@dataclass(frozen=True, slots=True)
class ModelCards:
    """One document's entries, and the list each key-access set sees, encoded."""

    cards: dict[str, Card]  # name -> entry, in the listing's order
    # Name -> the names that let a key use it: itself and its model (`auto`: what it names).
    grants: dict[str, tuple[str, ...]]
    encoded: dict[frozenset[str] | None, bytes] = field(default_factory=dict)

    @classmethod
    def of(cls, router: Router, auto: AutoTier | None) -> ModelCards:
        routes = router.models
        regions_of = _serving_regions(router.regions)
        cards: dict[str, Card] = {}
        grants: dict[str, tuple[str, ...]] = {}
        if routes.catalog is not None:
            for model in routes.catalog.models:
                regions = regions_of.get(model.name, [])
                cards[model.name] = _card(model.name, model.created, model.owned_by, regions)
                grants[model.name] = (model.name,)
            for alias in routes.catalog.aliases:
                model_name = routes.model_of[alias.name]
                cards[alias.name] = _alias_card(alias.name, cards[model_name], model_name)
                grants[alias.name] = (alias.name, model_name)
        else:
            for name in routes.names:
                cards[name] = _card(name, 0, "meridian", regions_of.get(name, []))
                grants[name] = (name,)
        auto_model = None if auto is None else routes.model_of.get(auto.region_model)
        if auto is not None and auto_model is not None:
            cards[AUTO_MODEL] = _alias_card(AUTO_MODEL, cards[auto_model], auto_model)
            grants[AUTO_MODEL] = (auto.region_model, auto_model)
        return cls(cards, grants)

    def may_use(self, key: ApiKey, name: str) -> bool:
        return any(map(key.may_use, self.grants[name]))

    def listing(self, key: ApiKey) -> bytes:
        """The list `key` sees, encoded."""
        body = self.encoded.get(key.models)
        if body is None:
            usable = [card for name, card in self.cards.items() if self.may_use(key, name)]
            body = _encode({"object": "list", "data": usable})
            if len(self.encoded) >= MAX_ENCODED_LISTS:
                self.encoded.clear()
            self.encoded[key.models] = body
        return body

    def card(self, name: str, key: ApiKey) -> Card | None:
        """`name`'s entry (None: no such name, or one `key` may not use)."""
        card = self.cards.get(name)
        if card is None or not self.may_use(key, name):
            return None
        return card


def _serving_regions(regions: dict[str, RegionState]) -> dict[str, list[str]]:
    """Model -> the regions with healthy nodes serving it, by name."""
    serving: dict[str, list[str]] = {}
    for region, state in sorted(regions.items()):
        for model, load in state.models.items():
            if load.healthy_nodes > 0:
                serving.setdefault(model, []).append(region)
    return serving


def _card(name: str, created: int, owned_by: str, regions: list[str]) -> Card:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "meridian": {"regions": regions},
    }


def _alias_card(name: str, model_card: Card, model_name: str) -> Card:
    meridian = model_card["meridian"]
    assert isinstance(meridian, dict)
    return model_card | {"id": name, "meridian": {**meridian, "model": model_name}}


def _encode(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(slots=True)
class ModelList:
    """The two routes' handlers, on the handlers' keys, router, `auto` and call log."""

    handlers: Handlers
    _cards: ModelCards | None = None
    _regions: dict[str, RegionState] | None = None  # the document `_cards` came from

    async def list(self, request: web.Request) -> web.StreamResponse:
        if not self.handlers.router.models.is_model_aware:
            return await self.handlers.models(request)  # version 1: a node's list, as before
        call = Call.start(request)
        try:
            key = call.authenticate(self.handlers.keys)
            body = self._current().listing(key)
        except GatewayError as exc:
            return self.handlers.log.refuse(call, exc)
        return self._answer(call, body)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        call = Call.start(request)
        name = request.match_info["model"]
        try:
            key = call.authenticate(self.handlers.keys)
            cards = self._current()
            routes = self.handlers.router.models
            if not routes.is_model_aware:
                raise ModelNotFoundError(
                    "No model can be looked up here: the control plane predates the model "
                    "catalog. GET /v1/models lists what the regions serve.",
                    "model_not_found",
                    param="model",
                )
            card = cards.card(name, key)
            if card is None:  # a name the key may not use is not there for it either
                raise routes.not_found(name, key)
        except GatewayError as exc:
            return self.handlers.log.refuse(call, exc)
        return self._answer(call, _encode(card))

    def _current(self) -> ModelCards:
        """The entries of the document the router holds (NotReadyError: none yet)."""
        router = self.handlers.router
        if not router.is_loaded:
            raise NotReadyError("the gateway has not loaded region summaries yet", "not_ready")
        if self._cards is None or self._regions is not router.regions:
            self._cards = ModelCards.of(router, self.handlers.auto)
            self._regions = router.regions  # a new dict with each document
        return self._cards

    def _answer(self, call: Call, body: bytes) -> web.Response:
        log = self.handlers.log
        log.record(call, 200, NO_REGION, 0)
        headers = {HEADER: call.request_id, POP_HEADER: log.pop}
        return web.Response(body=body, headers=headers, content_type="application/json")
