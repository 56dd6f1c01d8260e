"""`GET /v1/models` and `GET /v1/models/{model}` through a real gateway, a real control plane and
fake regions whose nodes serve one model each: the list is the document's (the catalog's models
and aliases, or the served models with an empty catalog), only the names the key may use, each
with the regions serving it now, `auto` when the gateway has it; no node is asked. A control
plane that predates models (a version 1 document) still gets a node's list, as before."""

from __future__ import annotations

import ssl

import httpx
import pytest
import test_gw_models_live
from aiohttp import web
from gw_catalog import SCALE, CatalogForwarder
from gw_fleet import Fleet, GatewayThread, wait_until
from test_gw_models_live import CATALOG, client, new_key, wait_for_key, wait_for_models

from wire.model_catalog import CatalogAlias, CatalogModel, ModelCatalog
from wire.region_summary import RegionSummaryIndex

# CATALOG's models and alias, a model no node serves (listed with no region), a name with `/`.
LISTED = CATALOG.model_copy(
    update={
        "models": (
            *CATALOG.models,
            CatalogModel(name="retired", owned_by="acme", created=1_700_000_000),
        ),
        "aliases": (*CATALOG.aliases, CatalogAlias(name="acme/old-v1", target="retired")),
    }
)


def entries(response: httpx.Response) -> dict[str, dict[str, object]]:
    assert response.status_code == 200, response.text
    listing = response.json()
    assert listing["object"] == "list"
    return {entry["id"]: entry for entry in listing["data"]}


def regions_of(response: httpx.Response) -> dict[str, object]:
    return {name: entry["meridian"] for name, entry in entries(response).items()}


# The regions (`small` in us-east, `large` in eu-west) and the catalog's forwarder.
two_models = test_gw_models_live.two_models
forwarder = test_gw_models_live.forwarder


@pytest.fixture
def catalog_gateway(two_models: Fleet, forwarder: CatalogForwarder) -> GatewayThread:
    forwarder.set_catalog(LISTED)
    gateway = two_models.start_gateway(
        control_plane=forwarder.url, watch_wait_s=0.5, auto_model="chat-default"
    )
    wait_for_models(gateway, "large", "small")
    return gateway


def test_the_list_is_the_catalogs_names_the_key_may_use_with_the_regions_serving_each(
    two_models: Fleet,
    forwarder: CatalogForwarder,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    with client(catalog_gateway, client_ssl, new_key(two_models, catalog_gateway)) as http:
        listed = http.get("/v1/models")
        assert list(entries(listed)) == [
            "large",
            "small",
            "retired",
            "chat-default",
            "acme/old-v1",
            "auto",
        ]
        assert entries(listed)["retired"] == {
            "id": "retired",
            "object": "model",
            "created": 1_700_000_000,
            "owned_by": "acme",
            "meridian": {"regions": []},  # no node serves it: listed, not hidden
        }
        assert regions_of(listed) == {
            "large": {"regions": ["eu-west"]},
            "small": {"regions": ["us-east"]},
            "retired": {"regions": []},
            "chat-default": {"regions": ["eu-west"], "model": "large"},
            "acme/old-v1": {"regions": [], "model": "retired"},
            "auto": {"regions": ["eu-west"], "model": "large"},
        }
        assert entries(listed)["acme/old-v1"]["owned_by"] == "acme"  # its model's
        assert listed.headers["x-meridian-pop"] == "new-york"
        one = http.get("/v1/models/acme/old-v1")
        assert one.status_code == 200 and one.json() == entries(listed)["acme/old-v1"]
        unknown = http.get("/v1/models/gpt-4")
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert error["message"].endswith(
            "Models you may use: acme/old-v1, chat-default, large, retired, small."
        )
    assert all(region.upstream.num_requests == 0 for region in two_models.regions.values())
    # A rollout flips the alias: the next document's list says so.
    flipped = (CatalogAlias(name="chat-default", target="small"), *LISTED.aliases[1:])
    forwarder.set_catalog(LISTED.model_copy(update={"aliases": flipped}))
    router = catalog_gateway.handlers.router
    wait_until(lambda: router.models.model_of["chat-default"] == "small", 5.0, "the flip")
    with client(catalog_gateway, client_ssl, new_key(two_models, catalog_gateway)) as http:
        after = regions_of(http.get("/v1/models"))
    assert after["chat-default"] == after["auto"] == {"regions": ["us-east"], "model": "small"}


def test_a_key_limited_to_some_names_sees_only_those_and_404s_for_the_rest(
    two_models: Fleet,
    forwarder: CatalogForwarder,
    catalog_gateway: GatewayThread,
    client_ssl: ssl.SSLContext,
) -> None:
    key_id, secret = two_models.create_key()
    forwarder.set_key_models(key_id, ("small", "chat-default"))
    wait_for_key(catalog_gateway, secret, ("small", "chat-default"))
    other_id, other = two_models.create_key()
    forwarder.set_key_models(other_id, ("large",))
    wait_for_key(catalog_gateway, other, ("large",))
    with client(catalog_gateway, client_ssl, secret) as http:
        # `auto` names chat-default, which the key may use; `large` only through the alias.
        assert list(entries(http.get("/v1/models"))) == ["small", "chat-default", "auto"]
        hidden = http.get("/v1/models/large")
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
        assert hidden.json()["error"]["message"].endswith(
            "Models you may use: chat-default, small."
        )
        assert http.get("/v1/models/auto").json()["meridian"]["model"] == "large"
    with client(catalog_gateway, client_ssl, other) as http:
        # A key may send an alias of a model it may use: it sees the aliases too.
        assert list(entries(http.get("/v1/models"))) == ["large", "chat-default", "auto"]
        assert http.get("/v1/models").status_code == 200  # the cached list, again
        refused = http.get("/v1/models/small", headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401


def test_with_an_empty_catalog_the_list_is_the_served_models(
    two_models: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_models.start_gateway()
    wait_for_models(gateway, "small", "large")
    with client(gateway, client_ssl, new_key(two_models, gateway)) as http:
        listed = http.get("/v1/models")
        assert regions_of(listed) == {
            "large": {"regions": ["eu-west"]},
            "small": {"regions": ["us-east"]},
        }
        assert entries(listed)["small"]["created"] == 0
        assert http.get("/v1/models/small").json()["id"] == "small"
    assert all(region.upstream.num_requests == 0 for region in two_models.regions.values())


class FirstVersionForwarder(CatalogForwarder):
    """Serves the control plane's summaries as a control plane before models did: version 1,
    no models, no catalog."""

    async def _summary(self, request: web.Request) -> web.Response:
        document = RegionSummaryIndex.model_validate_json(await self._watched(request))
        regions = [region.model_copy(update={"models": ()}) for region in document.regions]
        old = document.model_copy(
            update={
                "schema_version": 1,
                "catalog": None,
                "regions": regions,
                "index": document.index * SCALE + self.version,
            }
        )
        return web.Response(body=old.model_dump_json(), content_type="application/json")


def test_a_first_version_document_lists_a_nodes_models_as_before(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    first = FirstVersionForwarder(two_regions.cp_url, ModelCatalog())
    two_regions.loop.run(first.start())
    try:
        gateway = two_regions.start_gateway(control_plane=first.url, auto_model="fake-model")
        two_regions.wait_for_gateway(gateway)
        assert not gateway.handlers.router.models.is_model_aware
        with client(gateway, client_ssl, new_key(two_regions, gateway)) as http:
            listed = http.get("/v1/models")
            assert [entry["id"] for entry in listed.json()["data"]] == ["fake-model", "auto"]
            assert listed.headers["x-meridian-region"] == "us-east"  # a node answered
            one = http.get("/v1/models/fake-model")
            assert one.status_code == 404 and "predates" in one.json()["error"]["message"]
    finally:
        two_regions.loop.run(first.stop())
