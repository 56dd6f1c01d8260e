"""The admin API's bodies for the catalog: what `POST` and `PATCH /v1/models` take, and what
`GET /v1/models` answers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from control_plane.catalog.edits import Entry, Patch
from control_plane.safe_text import refuse_unsafe
from wire.model_catalog import MAX_FALLBACKS, CatalogAlias, CatalogModel, ModelName

# Unsafe characters get a 400 before the name's pattern (control_plane/safe_text.py).
SafeModelName = Annotated[ModelName, BeforeValidator(refuse_unsafe)]
OwnedBy = Annotated[str, Field(min_length=1, max_length=64), BeforeValidator(refuse_unsafe)]
Fallbacks = Annotated[list[SafeModelName], Field(max_length=MAX_FALLBACKS)]


def _no_repeats(fallbacks: list[str] | None) -> None:
    if fallbacks is not None and len(set(fallbacks)) != len(fallbacks):
        raise ValueError("fallbacks name a model twice")


class ModelCreate(BaseModel):
    """A model {name, owned_by?, fallbacks?}, or an alias {name, target}."""

    model_config = ConfigDict(extra="forbid")

    name: SafeModelName
    owned_by: OwnedBy | None = None
    fallbacks: Fallbacks | None = None
    target: SafeModelName | None = None  # makes it an alias

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCreate:
        if self.target is not None and (self.owned_by is not None or self.fallbacks is not None):
            raise ValueError("an alias takes only a name and a target (no owned_by, fallbacks)")
        _no_repeats(self.fallbacks)
        return self

    def entry(self) -> Entry:
        if self.target is not None:
            return CatalogAlias(name=self.name, target=self.target)
        return CatalogModel.model_validate(self.model_dump(exclude_none=True))


class ModelPatch(BaseModel):
    """A model's {fallbacks?, owned_by?} (fallbacks replace the list), or an alias's {target}."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    owned_by: OwnedBy | None = None
    fallbacks: Fallbacks | None = None
    target: SafeModelName | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ModelPatch:
        if not self.model_fields_set:
            raise ValueError("give fallbacks or owned_by (a model), or target (an alias)")
        for name in self.model_fields_set:
            if getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null")
        if self.target is not None and (self.owned_by is not None or self.fallbacks is not None):
            raise ValueError("give target (an alias) or fallbacks and owned_by (a model), not both")
        _no_repeats(self.fallbacks)
        return self

    def patch(self) -> Patch:
        fallbacks = tuple(self.fallbacks) if self.fallbacks is not None else None
        return Patch(owned_by=self.owned_by, fallbacks=fallbacks, target=self.target)


class RegionServing(BaseModel):
    name: str
    healthy_nodes: int


class ModelView(BaseModel):
    """A catalog model (OpenAI's model object, and what the operator set), with the regions that
    serve it now: empty for a model no healthy node serves, which is listed all the same."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    fallbacks: list[str]
    aliases: list[str]  # every alias that leads to it, through chains too
    regions: list[RegionServing]
    healthy_nodes: int  # over all regions: 0 is no capacity anywhere


class AliasView(BaseModel):
    name: str
    target: str  # a model or another alias
    model: str  # the model at the end of the chain


class UnlistedView(BaseModel):
    """A model nodes serve under a name the catalog does not list: routed to only while the
    catalog is empty (then every served model is), else by no one until the operator lists it."""

    name: str
    regions: list[RegionServing]
    is_routed: bool


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelView]
    aliases: list[AliasView]
    unlisted: list[UnlistedView]
