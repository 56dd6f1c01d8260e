"""What `GET /v1/models` shows: the catalog's models with the regions serving each in the
published summaries (a model no node serves is listed with none), the aliases with the model each
leads to, and the models nodes serve that the catalog does not list."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from control_plane.catalog.edits import Entry
from control_plane.catalog.schemas import (
    AliasView,
    ModelList,
    ModelView,
    RegionServing,
    UnlistedView,
)
from control_plane.model import Node
from wire.model_catalog import CatalogIndex, CatalogModel, ModelCatalog
from wire.region_summary import RegionSummary


def list_models(
    catalog: ModelCatalog, regions: Iterable[RegionSummary], nodes: Iterable[Node]
) -> ModelList:
    """`regions`: the summary document's (its `models` say who serves what); `nodes`: the
    fleet's, for the models outside the catalog (the summaries leave those out)."""
    index = CatalogIndex.of(catalog)
    serving = _serving(regions)
    listed = {model.name for model in catalog.models}
    unlisted: dict[str, Counter[str]] = {}
    for node in nodes:
        if node.model not in listed:
            counts = unlisted.setdefault(node.model, Counter())
            counts[node.identity.region] += int(node.is_in_summaries)
    return ModelList(
        data=[_model_view(model, index, serving.get(model.name, [])) for model in catalog.models],
        aliases=[
            AliasView(name=alias.name, target=alias.target, model=index.model_of[alias.name])
            for alias in catalog.aliases
        ],
        unlisted=[
            UnlistedView(
                name=name,
                regions=_regions(unlisted[name]),
                is_routed=catalog.is_empty,
            )
            for name in sorted(unlisted)
        ],
    )


def entry_view(
    catalog: ModelCatalog, regions: Iterable[RegionSummary], entry: Entry
) -> ModelView | AliasView:
    """One model's or alias's view, as `GET /v1/models` lists it."""
    index = CatalogIndex.of(catalog)
    if isinstance(entry, CatalogModel):
        return _model_view(entry, index, _serving(regions).get(entry.name, []))
    return AliasView(name=entry.name, target=entry.target, model=index.model_of[entry.name])


def _serving(regions: Iterable[RegionSummary]) -> dict[str, list[RegionServing]]:
    """Model -> the regions whose summary lists it, by name."""
    serving: dict[str, list[RegionServing]] = {}
    for region in regions:
        for load in region.models:
            if load.healthy_nodes > 0:
                found = RegionServing(name=region.name, healthy_nodes=load.healthy_nodes)
                serving.setdefault(load.name, []).append(found)
    return serving


def _regions(counts: Counter[str]) -> list[RegionServing]:
    return [
        RegionServing(name=name, healthy_nodes=count)
        for name, count in sorted(counts.items())
        if count > 0
    ]


def _model_view(
    model: CatalogModel, index: CatalogIndex, regions: list[RegionServing]
) -> ModelView:
    return ModelView(
        id=model.name,
        created=model.created,
        owned_by=model.owned_by,
        fallbacks=list(model.fallbacks),
        aliases=list(index.aliases_of[model.name]),
        regions=regions,
        healthy_nodes=sum(region.healthy_nodes for region in regions),
    )
