"""Which model each simulated node serves, and the catalog the control plane publishes.

Every region serves the default model on its `NODES_PER_REGION` nodes. A scenario may place a
second model (`PlacedModel`) on extra nodes in a few regions only, and send a share of its
requests for it; each node serves one model. The catalog then lists both, the placed model with
its fallbacks (the default model, or none), and reaches the gateways inside the summaries, as
from the real control plane. A world with the default model alone publishes an empty catalog:
every model a node serves is routable under its name (wire/model_catalog.py).

A node's heartbeat carries its model's identity (`wire.heartbeat.ModelIdentity`): the placed
model is the default model's weights computed in fp32, so the two never continue each other's
streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from wire.heartbeat import ModelIdentity
from wire.model_catalog import CatalogIndex, CatalogModel, ModelCatalog

DEFAULT_MODEL: Final = "smollm2-135m-instruct"
CONTEXT_LENGTH: Final = 8192  # SmolLM2's
_WEIGHTS_ID: Final = hashlib.sha256(DEFAULT_MODEL.encode()).hexdigest()[:32]
# The default model as the stack serves it (Q4_1), and any other as its weights in fp32.
DEFAULT_IDENTITY: Final = ModelIdentity(
    weights_id=_WEIGHTS_ID, context_length=CONTEXT_LENGTH, dtype="fp32", quantization="q4_1"
)
FP32_IDENTITY: Final = ModelIdentity(
    weights_id=_WEIGHTS_ID, context_length=CONTEXT_LENGTH, dtype="fp32", quantization="none"
)


@dataclass(frozen=True, slots=True)
class PlacedModel:
    """A model served in a few regions only, on nodes beside those of the default model."""

    name: str
    nodes: Mapping[str, int]  # region → its nodes serving this model
    share: float  # of the requests
    fallbacks: tuple[str, ...]  # the catalog's: served instead when it has no capacity


@dataclass(frozen=True, slots=True)
class Placement:
    """The fleet by model: what each region's nodes serve, what clients ask for, the catalog."""

    nodes: Mapping[str, tuple[str, ...]]  # region → the model of each of its nodes, in order
    shares: tuple[tuple[str, float], ...]  # (model, share of the requests), default first
    catalog: ModelCatalog

    @classmethod
    def of(cls, nodes_per_region: Mapping[str, int], placed: PlacedModel | None) -> Placement:
        if placed is None:
            nodes = {r: (DEFAULT_MODEL,) * n for r, n in nodes_per_region.items()}
            return cls(nodes, ((DEFAULT_MODEL, 1.0),), ModelCatalog())
        unknown = sorted(set(placed.nodes) - set(nodes_per_region))
        if unknown:
            raise ValueError(f"model {placed.name!r} placed in unknown regions {unknown}")
        nodes = {
            region: (DEFAULT_MODEL,) * n + (placed.name,) * placed.nodes.get(region, 0)
            for region, n in nodes_per_region.items()
        }
        shares = ((DEFAULT_MODEL, 1.0 - placed.share), (placed.name, placed.share))
        catalog = ModelCatalog(
            models=(
                CatalogModel(name=DEFAULT_MODEL),
                CatalogModel(name=placed.name, fallbacks=placed.fallbacks),
            )
        )
        return cls(nodes, shares, catalog)

    @property
    def num_nodes(self) -> int:
        return sum(len(models) for models in self.nodes.values())

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(model for model, _ in self.shares)

    def regions_serving(self, model: str) -> frozenset[str]:
        return frozenset(region for region, models in self.nodes.items() if model in models)

    def tries_of(self) -> dict[str, tuple[str, ...]]:
        """Each model, then its fallbacks in order, as the gateway resolves them from the
        catalog (`wire.model_catalog.CatalogIndex`); an empty catalog has no fallbacks."""
        if self.catalog.is_empty:
            return {model: (model,) for model in self.models}
        index = CatalogIndex.of(self.catalog)
        return {model: (model, *index.fallbacks_of[model]) for model in index.models}


def identity_of(model: str) -> ModelIdentity:
    return DEFAULT_IDENTITY if model == DEFAULT_MODEL else FP32_IDENTITY
