"""The model catalog: control plane → gateways, inside the region summary document
(`RegionSummaryIndex.catalog`), so that an alias flip reaches every PoP with the next summary.

A model is named by the name clients send and its nodes serve it under. An alias is another name
for a model or for another alias (a rollout moves `chat-default` from one model to the next in one
call). A model's fallbacks, in order, serve a request instead when the model itself has no
capacity anywhere reachable. Names are unique across models and aliases; an alias chain ends at a
model and never loops. The control plane checks a catalog with `check_catalog` before it writes
one (a conflict is a 409) and gateways check every document they adopt the same way.

An empty catalog means the operator lists nothing: every model a node serves is routable under
its served name. Once the catalog lists a model, only listed models are routed to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A name a client may put in `model`: what OpenAI's and Hugging Face's names look like
# (`smollm2-135m-instruct`, `org/model-v2:latest`), no spaces or control characters.
MODEL_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN, min_length=1, max_length=128)]
MAX_MODELS: Final = 1000
MAX_ALIASES: Final = 10_000
MAX_FALLBACKS: Final = 8
# The model a request is for (gateway → region ingress: Envoy routes on it to the nodes serving
# it), and the model that answered (gateway → client: a fallback's name when one answered).
MODEL_HEADER: Final = "x-meridian-model"


class CatalogError(ValueError):
    """A catalog that cannot stand: a name used twice, an alias to nothing or in a loop, a
    fallback to an unknown name. The control plane answers it with 409."""


class CatalogModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: ModelName
    owned_by: str = Field(default="meridian", min_length=1, max_length=64)
    # Models or aliases to serve a request instead, in order, when this one has no capacity.
    fallbacks: tuple[ModelName, ...] = Field(default=(), max_length=MAX_FALLBACKS)
    created: int = Field(default=0, ge=0)  # unix seconds


class CatalogAlias(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: ModelName
    target: ModelName  # a model or another alias


class ModelCatalog(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    models: tuple[CatalogModel, ...] = Field(default=(), max_length=MAX_MODELS)
    aliases: tuple[CatalogAlias, ...] = Field(default=(), max_length=MAX_ALIASES)

    @model_validator(mode="after")
    def _consistent(self) -> ModelCatalog:
        check_catalog(self.models, self.aliases)
        return self

    @property
    def is_empty(self) -> bool:
        return not self.models


def check_catalog(models: tuple[CatalogModel, ...], aliases: tuple[CatalogAlias, ...]) -> None:
    """CatalogError naming the first problem, if there is one."""
    names: set[str] = set()
    for name in [m.name for m in models] + [a.name for a in aliases]:
        if name in names:
            raise CatalogError(f"the name {name!r} is used twice (models and aliases share names)")
        names.add(name)
    targets = {alias.name: alias.target for alias in aliases}
    for alias in aliases:
        _model_behind(alias.name, targets, names)
    for model in models:
        for fallback in model.fallbacks:
            if fallback not in names:
                raise CatalogError(f"model {model.name!r} falls back to unknown {fallback!r}")
            if fallback == model.name or _model_behind(fallback, targets, names) == model.name:
                raise CatalogError(f"model {model.name!r} falls back to itself ({fallback!r})")


def _model_behind(name: str, targets: dict[str, str], names: set[str]) -> str:
    seen = [name]
    while name in targets:
        name = targets[name]
        if name not in names:
            raise CatalogError(f"alias {seen[-1]!r} points to unknown {name!r}")
        if name in seen:
            raise CatalogError("alias loop: " + " -> ".join([*seen, name]))
        seen.append(name)
    return name


@dataclass(frozen=True, slots=True)
class CatalogIndex:
    """A checked catalog as lookups: worked out once per document, used on every request."""

    models: dict[str, CatalogModel]
    # Every model and alias name -> the model it names.
    model_of: dict[str, str]
    # Model -> its fallbacks resolved to models, in order, without repeats or itself.
    fallbacks_of: dict[str, tuple[str, ...]]
    aliases_of: dict[str, tuple[str, ...]]  # model -> the aliases that lead to it, sorted

    @classmethod
    def of(cls, catalog: ModelCatalog) -> CatalogIndex:
        names = {m.name for m in catalog.models} | {a.name for a in catalog.aliases}
        targets = {alias.name: alias.target for alias in catalog.aliases}
        model_of = {name: _model_behind(name, targets, names) for name in names}
        fallbacks_of: dict[str, tuple[str, ...]] = {}
        for model in catalog.models:
            resolved: list[str] = []
            for fallback in model.fallbacks:
                target = model_of[fallback]
                if target != model.name and target not in resolved:
                    resolved.append(target)
            fallbacks_of[model.name] = tuple(resolved)
        aliases_of: dict[str, list[str]] = {m.name: [] for m in catalog.models}
        for alias in catalog.aliases:
            aliases_of[model_of[alias.name]].append(alias.name)
        return cls(
            models={m.name: m for m in catalog.models},
            model_of=model_of,
            fallbacks_of=fallbacks_of,
            aliases_of={name: tuple(sorted(found)) for name, found in aliases_of.items()},
        )
