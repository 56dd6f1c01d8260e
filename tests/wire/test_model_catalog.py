"""The model catalog's rules: unique names, aliases ending at a model, fallbacks to known names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wire.model_catalog import CatalogAlias, CatalogError, CatalogIndex, CatalogModel, ModelCatalog


def catalog(models: dict[str, tuple[str, ...]], aliases: dict[str, str]) -> ModelCatalog:
    return ModelCatalog(
        models=tuple(CatalogModel(name=n, fallbacks=f) for n, f in models.items()),
        aliases=tuple(CatalogAlias(name=n, target=t) for n, t in aliases.items()),
    )


def test_aliases_resolve_through_chains_and_fallbacks_through_aliases() -> None:
    index = CatalogIndex.of(
        catalog(
            {"small": ("chat-default", "large"), "large": (), "coder": ("big",)},
            {"chat-default": "latest", "latest": "large", "big": "large"},
        )
    )
    assert index.model_of["chat-default"] == "large"
    assert index.model_of["small"] == "small"
    # "chat-default" and "large" both name large: it is tried once.
    assert index.fallbacks_of["small"] == ("large",)
    assert index.fallbacks_of["coder"] == ("large",)
    assert index.aliases_of["large"] == ("big", "chat-default", "latest")
    assert index.aliases_of["small"] == ()


@pytest.mark.parametrize(
    ("models", "aliases", "problem"),
    [
        ({"a": ()}, {"a": "a"}, "used twice"),
        ({"a": ()}, {"x": "y", "y": "x"}, "alias loop: x -> y -> x"),
        ({"a": ()}, {"x": "nothing"}, "points to unknown 'nothing'"),
        ({"a": ("b",)}, {}, "falls back to unknown 'b'"),
        ({"a": ("me",)}, {"me": "a"}, "falls back to itself"),
    ],
)
def test_a_catalog_that_cannot_stand_is_refused(
    models: dict[str, tuple[str, ...]], aliases: dict[str, str], problem: str
) -> None:
    with pytest.raises(ValidationError, match=problem) as caught:
        catalog(models, aliases)
    assert isinstance(caught.value.errors()[0]["ctx"]["error"], CatalogError)


def test_names_are_checked() -> None:
    with pytest.raises(ValidationError):
        CatalogModel(name="has space")
    assert CatalogModel(name="org/model-v2:latest").name == "org/model-v2:latest"
