"""Resolving a request's model against the document the gateway holds (pure: documents and keys
in, models to try or errors out), and where a stream of a model may resume."""

from __future__ import annotations

import random

import pytest
from test_gw_routing import CONFIG
from test_gw_routing_models import model_load, region

from gateway.errors import ModelNotAllowedError, ModelNotFoundError
from gateway.keys import ApiKey
from gateway.model_routes import MAX_NAMED, ModelChoice, ModelRoutes, is_out_of_capacity
from gateway.resume import ResumeTargets
from gateway.routing import Router
from wire.geo import locate
from wire.limit_shares import model_entry, split_entry
from wire.model_catalog import CatalogAlias, CatalogModel, ModelCatalog
from wire.region_summary import RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

ANY_KEY = ApiKey("k", 100, 1000)

CATALOG = ModelCatalog(
    models=(
        CatalogModel(name="large", fallbacks=("chat-small", "tiny")),
        CatalogModel(name="small"),
        CatalogModel(name="tiny"),
    ),
    aliases=(
        CatalogAlias(name="chat-small", target="small"),
        CatalogAlias(name="chat-default", target="chat-large"),
        CatalogAlias(name="chat-large", target="large"),
    ),
)


def document(
    *regions: RegionSummary, catalog: ModelCatalog | None = CATALOG, schema_version: int = 2
) -> RegionSummaryIndex:
    return RegionSummaryIndex(
        schema_version=schema_version,  # type: ignore[arg-type]
        index=1,
        regions=list(regions),
        routing=RoutingPolicy(),
        catalog=catalog,
    )


def key(*names: str) -> ApiKey:
    return ApiKey("k", 100, 1000, frozenset(names))


def test_a_name_or_an_alias_chain_resolves_to_its_model_then_its_fallbacks() -> None:
    routes = ModelRoutes.of(document())
    assert routes.resolve("large", ANY_KEY) == ModelChoice(("large", "small", "tiny"), True)
    assert routes.resolve("chat-default", ANY_KEY).models == ("large", "small", "tiny")
    assert routes.resolve("chat-small", ANY_KEY) == ModelChoice(("small",), True)


def test_an_unknown_name_is_a_404_naming_the_names_the_key_may_use() -> None:
    routes = ModelRoutes.of(document())
    with pytest.raises(ModelNotFoundError) as unknown:
        routes.resolve("gpt-4", ANY_KEY)
    assert unknown.value.status_code == 404 and unknown.value.code == "model_not_found"
    assert unknown.value.param == "model"
    names = "chat-default, chat-large, chat-small, large, small, tiny"
    assert (
        unknown.value.message == f"The model 'gpt-4' does not exist. Models you may use: {names}."
    )
    with pytest.raises(ModelNotFoundError) as limited:
        routes.resolve("gpt-4", key("chat-small"))
    assert limited.value.message.endswith("Models you may use: chat-small.")


def test_an_error_repeats_no_more_of_a_name_than_a_name_may_hold() -> None:
    routes = ModelRoutes.of(document())
    with pytest.raises(ModelNotFoundError) as unknown:
        routes.resolve("x" * 100_000, ANY_KEY)
    assert f"'{'x' * 128}'... does not exist" in unknown.value.message
    assert len(unknown.value.message) < 300


def test_a_404_names_at_most_ten() -> None:
    many = ModelCatalog(models=tuple(CatalogModel(name=f"m{i:02}") for i in range(30)))
    with pytest.raises(ModelNotFoundError) as unknown:
        ModelRoutes.of(document(catalog=many)).resolve("x", ANY_KEY)
    listed = unknown.value.message.split("Models you may use: ")[1]
    assert listed == ", ".join(f"m{i:02}" for i in range(MAX_NAMED)) + ", ..."


def test_a_name_the_key_may_not_use_is_a_403() -> None:
    routes = ModelRoutes.of(document())
    with pytest.raises(ModelNotAllowedError) as refused:
        routes.resolve("large", key("small"))
    assert refused.value.status_code == 403 and refused.value.code == "model_not_allowed"
    # The name sent or the model it resolves to: either in the key's list will do.
    assert routes.resolve("chat-small", key("small")).models == ("small",)
    with pytest.raises(ModelNotAllowedError):  # an alias in the list grants the alias alone
        routes.resolve("small", key("chat-small"))


def test_fallbacks_the_key_may_not_use_are_skipped() -> None:
    routes = ModelRoutes.of(document())
    assert routes.resolve("large", key("large", "tiny")).models == ("large", "tiny")
    # A fallback is usable through one of its aliases too.
    assert routes.resolve("large", key("large", "chat-small")).models == ("large", "small")


def test_an_empty_catalog_routes_every_served_name_and_nothing_else() -> None:
    doc = document(
        region("us-east", model_load("small")),
        region("eu-west", model_load("large", healthy_nodes=0)),  # listed, no capacity now
        catalog=ModelCatalog(),
    )
    routes = ModelRoutes.of(doc)
    assert routes.resolve("small", ANY_KEY) == ModelChoice(("small",), True)
    assert routes.resolve("large", ANY_KEY) == ModelChoice(("large",), True)
    with pytest.raises(ModelNotFoundError, match="Models you may use: large, small"):
        routes.resolve("chat-small", ANY_KEY)


def test_a_version_1_document_is_model_blind() -> None:
    routes = ModelRoutes.of(document(region("us-east"), catalog=None, schema_version=1))
    assert routes.resolve("anything", ANY_KEY) == ModelChoice(("anything",), False)
    with pytest.raises(ModelNotAllowedError):
        routes.resolve("anything", key("other"))


def test_routes_are_kept_while_the_names_stay_the_same() -> None:
    first = ModelRoutes.of(document())
    same = ModelRoutes.of(document(region("us-east", model_load("small"))), first)
    assert same is first  # an equal catalog: not indexed again
    aliases = (CatalogAlias(name="chat-default", target="small"), *CATALOG.aliases[::2])
    flipped = CATALOG.model_copy(update={"aliases": aliases})
    moved = ModelRoutes.of(document(catalog=flipped), first)
    assert moved.resolve("chat-default", ANY_KEY).models == ("small",)
    served = document(region("us-east", model_load("small")), catalog=ModelCatalog())
    kept = ModelRoutes.of(served)
    assert ModelRoutes.of(served, kept) is kept
    blind = ModelRoutes.of(document(catalog=None, schema_version=1))
    assert ModelRoutes.of(document(catalog=ModelCatalog()), blind).is_model_aware


def test_capacity_refusals_move_on_to_a_fallback_other_answers_do_not() -> None:
    assert is_out_of_capacity(429) and is_out_of_capacity(503)
    assert not any(map(is_out_of_capacity, (200, 400, 404, 500, 502, 504)))


def test_a_stream_resumes_only_where_the_same_weights_serve_its_model() -> None:
    router = Router(CONFIG, locate("new-york"), rng=random.Random(3))
    same, other = ("w1:none:fp32",), ("w2:none:fp32",)
    router.update(
        document(
            region("us-east", model_load("small", serving_keys=same)),
            region("toronto", model_load("small", serving_keys=other)),
            region("chicago", model_load("small", serving_keys=same)),
            region("eu-west", model_load("small", serving_keys=same + other)),  # mixed nodes
            region("us-west", model_load("large", serving_keys=same)),  # another model
        )
    )
    targets = ResumeTargets(router, None, "small", router.serving_key_of("us-east", "small"), 0)
    assert [c.region for c in targets.candidates(10, ["us-east"])] == ["chicago"]
    # Nodes that did not say what they serve: no region is known to write the same text.
    unknown = ResumeTargets(router, None, "small", router.serving_key_of("eu-west", "small"), 0)
    assert unknown.serving_key is None and unknown.candidates(10, ["eu-west"]) == []
    # Model-blind (a version 1 document): every other region, as before.
    blind = ResumeTargets(router, None, None, None, 0)
    assert len(blind.candidates(10, ["us-east"])) == 4


def limited(*names: str) -> ApiKey:
    """A key with limits on each of `names` (a model or an alias), as the snapshot has them."""
    limits = {name: ApiKey(model_entry("k", name), 1, 10) for name in names}
    return ApiKey("k", 100, 1000, model_limits=limits)


def limits_named(routes: ModelRoutes, name: str, key: ApiKey) -> str | None:
    """The name the limits `name`'s requests take from are keyed by (None: none)."""
    limits = routes.resolve(name, key).limits
    return None if limits is None else split_entry(limits.id)[1]


def test_limits_named_by_an_alias_apply_to_the_model_it_names_now() -> None:
    routes = ModelRoutes.of(document())
    key = limited("chat-default", "tiny")
    # chat-default -> chat-large -> large: its limits are large's, by any name.
    assert [limits_named(routes, name, key) for name in ("large", "chat-large")] == [
        "chat-default",
        "chat-default",
    ]
    assert limits_named(routes, "tiny", key) == "tiny"
    assert limits_named(routes, "small", key) is None
    # Flipped to small: they follow the alias, and large has none left.
    flipped = CATALOG.model_copy(
        update={
            "aliases": (
                CatalogAlias(name="chat-small", target="small"),
                CatalogAlias(name="chat-default", target="small"),
                CatalogAlias(name="chat-large", target="large"),
            )
        }
    )
    after = ModelRoutes.of(document(catalog=flipped), routes)
    assert limits_named(after, "small", key) == "chat-default"
    assert limits_named(after, "large", key) is None


def test_limits_named_by_the_model_itself_come_before_its_aliases() -> None:
    routes = ModelRoutes.of(document())
    assert limits_named(routes, "chat-default", limited("chat-large", "large")) == "large"
    # Of two aliases of one model, the first by name.
    assert limits_named(routes, "large", limited("chat-large", "chat-default")) == "chat-default"
    # Model-blind: the name as sent.
    blind = ModelRoutes.blind()
    assert limits_named(blind, "large", limited("large")) == "large"
    assert limits_named(blind, "chat-default", limited("large")) is None
