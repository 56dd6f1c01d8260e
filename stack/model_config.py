"""The stack YAML's models: what each one is (where its weights come from, how they are kept, the
name clients send for it), and the catalog `meridian up` registers for them.

Each region of the YAML maps model names to node agents (`models: {NAME: COUNT}`); the one-model
short form (`model: NAME` at the top, `nodes: COUNT` per region) reads as a single model of that
name and source. A model's name is the stack's own handle; clients send its `served_name` (default:
the name), which is also its name in the control plane's catalog.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.model_catalog import (
    MAX_FALLBACKS,
    CatalogAlias,
    CatalogModel,
    ModelCatalog,
    ModelName,
    check_catalog,
)

# engine/config.py's choices (not imported: torch). auto: as the engine picks for the hardware
# (on CPU: bf16 where native, else fp32; a Q4_1 file's blocks kept as they are with AVX-512).
Dtype = Literal["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]
Quantization = Literal["auto", "none", "int8", "q4_1"]
# auto: the KV cache in the model's dtype; fp8: e4m3, twice the blocks in the same memory.
KvCacheDtype = Literal["auto", "fp8"]


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ModelName
    # A pulled model's name (`meridian pull NAME`) or a path to its weights; default: the name.
    source: str | None = Field(default=None, min_length=1, max_length=4096)
    dtype: Dtype = "auto"
    quantization: Quantization = "auto"
    kv_cache_dtype: KvCacheDtype = "auto"
    # What clients put in `model` (and the catalog's name for it); default: the name.
    served_name: ModelName | None = None
    # Models (by name) or aliases to answer instead, in order, when this one has no capacity.
    fallbacks: list[ModelName] = Field(default=[], max_length=MAX_FALLBACKS)

    @property
    def weights(self) -> str:
        """What the node agents load (`--model`)."""
        return self.source or self.name

    @property
    def served(self) -> str:
        return self.served_name or self.name


def served_model(model: str) -> str:
    """The name a node agent serves `--model` under by default: a GGUF path's file stem."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else model


def one_model(model: str) -> ModelConfig:
    """The short form's single model: `model` is its source, served under its own name."""
    return ModelConfig(name=served_model(model), source=model)


def catalog_of(models: list[ModelConfig], aliases: dict[str, str]) -> ModelCatalog:
    """The models and aliases as the control plane's catalog names them (served names); alias
    targets and fallbacks may name a model or an alias. CatalogError (a ValueError) for a name
    used twice, an alias loop, or a fallback or target that names nothing."""
    served = {model.name: model.served for model in models}
    listed = tuple(
        CatalogModel(
            name=model.served, fallbacks=tuple(served.get(name, name) for name in model.fallbacks)
        )
        for model in models
    )
    named = tuple(
        CatalogAlias(name=alias, target=served.get(target, target))
        for alias, target in aliases.items()
    )
    check_catalog(listed, named)  # its own one-line error, before pydantic would wrap it
    return ModelCatalog(models=listed, aliases=named)
