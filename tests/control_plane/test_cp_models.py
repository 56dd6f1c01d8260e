"""The model catalog's admin API (`/v1/models`): models, aliases and fallbacks added, listed,
changed and removed; every bad input answered in the error shape; every write audited; the
catalog in the region summary document (an alias flip moves its index) and kept across a restart.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from conftest import ControlPlaneClient, bearer, eventually, settings_on_each_db

from control_plane.app import create_app
from control_plane.settings import Settings

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL

SMALL, LARGE = "smollm2-135m-instruct", "org/large-v2:latest"


async def post(cp: ControlPlaneClient, body: dict[str, Any], status: int = 201) -> Any:
    response = await cp.http.post("/v1/models", json=body, headers=cp.admin)
    assert response.status_code == status, response.text
    return response.json()


async def patch(cp: ControlPlaneClient, name: str, body: dict[str, Any], status: int = 200) -> Any:
    response = await cp.http.patch(f"/v1/models/{name}", json=body, headers=cp.admin)
    assert response.status_code == status, response.text
    return response.json()


async def listing(cp: ControlPlaneClient) -> Any:
    response = await cp.http.get("/v1/models", headers=cp.admin)
    assert response.status_code == 200, response.text
    return response.json()


async def two_models_and_an_alias(cp: ControlPlaneClient) -> None:
    await post(cp, {"name": SMALL})
    await post(cp, {"name": LARGE, "owned_by": "acme", "fallbacks": [SMALL]})
    await post(cp, {"name": "chat-default", "target": SMALL})


def error_of(body: Any) -> tuple[str, str]:
    return body["error"]["code"], body["error"]["message"]


@pytest.mark.asyncio
async def test_models_aliases_and_fallbacks_are_added_listed_and_flipped(
    cp: ControlPlaneClient,
) -> None:
    small = await post(cp, {"name": SMALL})
    assert small["id"] == SMALL and small["owned_by"] == "meridian" and small["created"] > 0
    assert (small["fallbacks"], small["regions"], small["healthy_nodes"]) == ([], [], 0)
    large = await post(cp, {"name": LARGE, "owned_by": "acme", "fallbacks": [SMALL]})
    assert (large["owned_by"], large["fallbacks"]) == ("acme", [SMALL])
    alias = await post(cp, {"name": "chat-default", "target": SMALL})
    assert alias == {"name": "chat-default", "target": SMALL, "model": SMALL}
    chained = await post(cp, {"name": "chat", "target": "chat-default"})
    assert chained["model"] == SMALL

    listed = await listing(cp)
    assert listed["object"] == "list"
    assert [(m["id"], m["aliases"]) for m in listed["data"]] == [
        (SMALL, ["chat", "chat-default"]),
        (LARGE, []),
    ]
    assert listed["aliases"][0] == alias and listed["unlisted"] == []

    # The rollout: one call moves the alias (and the chain behind it) to the next model.
    flipped = await patch(cp, "chat-default", {"target": LARGE})
    assert flipped == {"name": "chat-default", "target": LARGE, "model": LARGE}
    assert (await cp.http.get("/v1/models/chat", headers=cp.admin)).json()["model"] == LARGE
    # A model's fallbacks are replaced as a whole; its owner alone may change.
    assert (await patch(cp, SMALL, {"fallbacks": ["chat-default"]}))["fallbacks"] == [
        "chat-default"
    ]
    assert (await patch(cp, SMALL, {"owned_by": "team-a"}))["fallbacks"] == ["chat-default"]
    assert (await patch(cp, SMALL, {"fallbacks": []}))["owned_by"] == "team-a"

    # A name with '/' and ':' is one path: read, changed and removed as such.
    got = await cp.http.get(f"/v1/models/{LARGE}", headers=cp.admin)
    assert got.json()["id"] == LARGE and got.json()["aliases"] == ["chat", "chat-default"]
    await patch(cp, "chat-default", {"target": SMALL})
    assert (await cp.http.delete(f"/v1/models/{LARGE}", headers=cp.admin)).status_code == 204
    assert (await cp.http.get(f"/v1/models/{LARGE}", headers=cp.admin)).status_code == 404
    assert [m["id"] for m in (await listing(cp))["data"]] == [SMALL]


@pytest.mark.asyncio
async def test_each_model_lists_the_regions_serving_it_and_the_unlisted_models(
    cp: ControlPlaneClient,
) -> None:
    await cp.add_region("us-east")
    await cp.add_region("eu-west", lat=50.1, lon=8.7)
    await cp.beat("n1", "us-east")
    await cp.beat("n2", "us-east")
    await cp.beat("n3", "eu-west", model="qwen-coder")
    # An empty catalog routes every served model: all of them unlisted, and routed.
    unlisted = (await listing(cp))["unlisted"]
    assert unlisted == [
        {
            "name": "qwen-coder",
            "regions": [{"name": "eu-west", "healthy_nodes": 1}],
            "is_routed": True,
        },
        {"name": SMALL, "regions": [{"name": "us-east", "healthy_nodes": 2}], "is_routed": True},
    ]

    await two_models_and_an_alias(cp)

    async def listed_with_capacity() -> bool:
        return (await listing(cp))["data"][0]["healthy_nodes"] == 2

    await eventually(listed_with_capacity)
    listed = await listing(cp)
    small, large = listed["data"]
    assert small["regions"] == [{"name": "us-east", "healthy_nodes": 2}]
    # No node serves the large model: listed with no capacity, not hidden.
    assert (large["regions"], large["healthy_nodes"]) == ([], 0)
    # The coder model is served but not listed: shown, routed by no one.
    assert listed["unlisted"] == [
        {
            "name": "qwen-coder",
            "regions": [{"name": "eu-west", "healthy_nodes": 1}],
            "is_routed": False,
        }
    ]


@pytest.mark.asyncio
async def test_conflicts_are_409_naming_the_problem(cp: ControlPlaneClient) -> None:
    await two_models_and_an_alias(cp)
    cases: list[tuple[str, str, dict[str, Any], str, str]] = [
        ("POST", "", {"name": SMALL}, "model_exists", f"the name '{SMALL}' is taken"),
        ("POST", "", {"name": "chat-default", "target": LARGE}, "model_exists", "is taken"),
        ("POST", "", {"name": SMALL, "target": LARGE}, "model_exists", "is taken"),
        ("POST", "", {"name": "x", "target": "nowhere"}, "catalog_conflict", "unknown 'nowhere'"),
        ("POST", "", {"name": "x", "fallbacks": ["nowhere"]}, "catalog_conflict", "unknown"),
        ("POST", "", {"name": "x", "fallbacks": ["x"]}, "catalog_conflict", "falls back to itself"),
        ("PATCH", f"/{SMALL}", {"fallbacks": ["chat-default"]}, "catalog_conflict", "itself"),
        ("PATCH", f"/{SMALL}", {"target": LARGE}, "wrong_kind", "is a model, not an alias"),
        ("PATCH", "/chat-default", {"fallbacks": [LARGE]}, "wrong_kind", "is an alias"),
        ("PATCH", "/chat-default", {"target": "chat-default"}, "catalog_conflict", "alias loop"),
    ]
    for method, path, body, code, message in cases:
        response = await cp.http.request(method, "/v1/models" + path, json=body, headers=cp.admin)
        assert response.status_code == 409, (method, path, body, response.text)
        assert error_of(response.json())[0] == code, response.text
        assert message in error_of(response.json())[1], response.text

    # A loop through two aliases names every hop.
    await post(cp, {"name": "chat", "target": "chat-default"})
    loop = await patch(cp, "chat-default", {"target": "chat"}, status=409)
    assert error_of(loop) == (
        "catalog_conflict",
        "alias loop: chat-default -> chat -> chat-default",
    )

    # Removing what an alias or a fallback names is refused, naming each referrer.
    refused = await cp.http.delete(f"/v1/models/{SMALL}", headers=cp.admin)
    assert refused.status_code == 409
    assert error_of(refused.json()) == (
        "model_in_use",
        f"'{SMALL}' is still named by alias 'chat-default', the fallbacks of '{LARGE}': "
        "point those elsewhere first",
    )
    in_chain = await cp.http.delete("/v1/models/chat-default", headers=cp.admin)
    assert error_of(in_chain.json())[0] == "model_in_use"
    # Nothing was changed by any of them.
    listed = await listing(cp)
    assert [(m["id"], m["fallbacks"]) for m in listed["data"]] == [(SMALL, []), (LARGE, [SMALL])]
    assert [(a["name"], a["target"]) for a in listed["aliases"]] == [
        ("chat-default", SMALL),
        ("chat", "chat-default"),
    ]


BAD_BODIES: list[tuple[str, str, Any, int, str]] = [
    # (method, path, body, status, code or a part of the message)
    ("POST", "", {"name": "has space"}, 422, "name: String should match pattern"),
    ("POST", "", {"name": "-leading"}, 422, "String should match pattern"),
    ("POST", "", {"name": "x" * 129}, 422, "at most 128 characters"),
    ("POST", "", {"name": ""}, 422, "at least 1 character"),
    ("POST", "", {"name": "evil\u202egpt"}, 400, "invalid_characters"),
    ("POST", "", {"name": "m", "owned_by": "a\u0000b"}, 400, "invalid_characters"),
    ("POST", "", {"name": "m", "owned_by": ""}, 422, "owned_by"),
    ("POST", "", {"name": "m", "fallbacks": ["a b"]}, 422, "fallbacks.0"),
    ("POST", "", {"name": "m", "fallbacks": [SMALL, SMALL]}, 422, "name a model twice"),
    ("POST", "", {"name": "m", "fallbacks": [f"f{i}" for i in range(9)]}, 422, "at most 8"),
    ("POST", "", {"name": "a", "target": SMALL, "fallbacks": []}, 422, "an alias takes only"),
    ("POST", "", {"name": "m", "served": "x"}, 422, "Extra inputs are not permitted"),
    ("POST", "", {"target": SMALL}, 422, "name: Field required"),
    ("POST", "", ["m"], 422, "valid dictionary"),
    ("POST", "", "{not json", 400, "invalid_json"),
    ("PATCH", f"/{SMALL}", {}, 422, "give fallbacks or owned_by"),
    ("PATCH", f"/{SMALL}", {"fallbacks": None}, 422, "fallbacks cannot be null"),
    ("PATCH", f"/{SMALL}", {"target": SMALL, "owned_by": "a"}, 422, "not both"),
    ("PATCH", f"/{SMALL}", {"name": "other"}, 422, "Extra inputs are not permitted"),
    ("PATCH", "/chat-default", {"target": "bad name"}, 422, "target: String should match"),
]


@pytest.mark.asyncio
async def test_bad_input_gets_a_clear_error_and_changes_nothing(cp: ControlPlaneClient) -> None:
    await two_models_and_an_alias(cp)
    before = await listing(cp)
    for method, path, body, status, expected in BAD_BODIES:
        content = body if isinstance(body, str) else None
        response = await cp.http.request(
            method,
            "/v1/models" + path,
            json=None if content is not None else body,
            content=content,
            headers=cp.admin | {"content-type": "application/json"},
        )
        assert response.status_code == status, (method, path, body, response.text)
        code, message = error_of(response.json())
        assert expected == code or expected in message, (body, response.text)
    assert await listing(cp) == before


@pytest.mark.asyncio
async def test_unknown_names_are_404_and_only_the_admin_token_may_call(
    cp: ControlPlaneClient,
) -> None:
    await two_models_and_an_alias(cp)
    for method, body in (("GET", None), ("PATCH", {"owned_by": "a"}), ("DELETE", None)):
        for name in ("nowhere", "org/nowhere", f"{SMALL}/extra"):
            response = await cp.http.request(
                method, f"/v1/models/{name}", json=body, headers=cp.admin
            )
            assert response.status_code == 404, (method, name, response.text)
            assert error_of(response.json()) == (
                "model_not_found",
                f"no model or alias is called '{name}'",
            )
    unsafe = await cp.http.get("/v1/models/a%E2%80%AEb", headers=cp.admin)
    assert (unsafe.status_code, error_of(unsafe.json())[0]) == (400, "invalid_characters")
    for headers, status in (({}, 401), (cp.gateway, 403), (bearer("wrong"), 401)):
        assert (await cp.http.get("/v1/models", headers=headers)).status_code == status
        write = await cp.http.post("/v1/models", json={"name": "m"}, headers=headers)
        assert write.status_code == status
    assert [m["id"] for m in (await listing(cp))["data"]] == [SMALL, LARGE]


async def audit_entries(cp: ControlPlaneClient) -> list[dict[str, Any]]:
    response = await cp.http.get("/v1/audit", headers=cp.admin)
    return [
        e for e in response.json()["entries"] if e["action"].split(".")[0] in ("model", "alias")
    ]


@pytest.mark.asyncio
async def test_every_write_is_audited_with_what_it_replaced(cp: ControlPlaneClient) -> None:
    await two_models_and_an_alias(cp)
    await patch(cp, "chat-default", {"target": LARGE})
    await patch(cp, LARGE, {"fallbacks": [], "owned_by": "team-b"})
    await patch(cp, SMALL, {"owned_by": "meridian"})  # as it was: nothing replaced
    assert (await cp.http.delete("/v1/models/chat-default", headers=cp.admin)).status_code == 204
    await post(cp, {"name": SMALL}, status=409)  # refused: not a change
    entries = await audit_entries(cp)
    assert all((e["actor"], e["client"] != "") == ("admin", True) for e in entries)
    created = entries[1]["detail"]["created"]
    assert [(e["action"], e["target"], e["detail"]) for e in entries] == [
        ("model.create", SMALL, entries[0]["detail"]),
        (
            "model.create",
            LARGE,
            {"name": LARGE, "owned_by": "acme", "fallbacks": [SMALL], "created": created},
        ),
        ("alias.create", "chat-default", {"name": "chat-default", "target": SMALL}),
        (
            "alias.update",
            "chat-default",
            {"name": "chat-default", "target": LARGE, "old": {"target": SMALL}},
        ),
        (
            "model.update",
            LARGE,
            {
                "name": LARGE,
                "owned_by": "team-b",
                "fallbacks": [],
                "created": created,
                "old": {"owned_by": "acme", "fallbacks": [SMALL]},
            },
        ),
        ("model.update", SMALL, entries[5]["detail"]),
        ("alias.delete", "chat-default", {"old": {"name": "chat-default", "target": LARGE}}),
    ]
    assert entries[5]["detail"]["old"] == {}


async def summary(cp: ControlPlaneClient) -> Any:
    response = await cp.http.get("/v1/regions/summary", headers=cp.gateway)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.asyncio
async def test_the_catalog_reaches_the_summary_document_and_a_flip_moves_its_index(
    cp: ControlPlaneClient,
) -> None:
    assert (await summary(cp))["catalog"] == {"models": [], "aliases": []}
    await two_models_and_an_alias(cp)
    document = await summary(cp)
    assert [m["name"] for m in document["catalog"]["models"]] == [SMALL, LARGE]
    assert document["catalog"]["aliases"] == [{"name": "chat-default", "target": SMALL}]
    # The flip is in the very next document: published by the write, not by a later tick.
    await patch(cp, "chat-default", {"target": LARGE})
    flipped = await summary(cp)
    assert flipped["index"] > document["index"]
    assert flipped["catalog"]["aliases"] == [{"name": "chat-default", "target": LARGE}]
    # A gateway waiting on the old index is woken by the flip.
    waiting = cp.http.get(
        "/v1/regions/summary",
        params={"index": flipped["index"], "wait": "5s"},
        headers=cp.gateway,
    )
    task = asyncio.ensure_future(waiting)
    await patch(cp, "chat-default", {"target": SMALL})
    woken = (await task).json()
    assert woken["index"] > flipped["index"]
    assert woken["catalog"]["aliases"] == [{"name": "chat-default", "target": SMALL}]


@pytest.mark.asyncio
async def test_the_catalog_is_kept_across_a_restart(
    cp: ControlPlaneClient, settings: Settings
) -> None:
    await two_models_and_an_alias(cp)
    before = await listing(cp)
    app = create_app(settings)  # a second start on the same database
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            after = await http.get("/v1/models", headers=cp.admin)
            assert after.json() == before
            document = await http.get("/v1/regions/summary", headers=cp.gateway)
            aliases = document.json()["catalog"]["aliases"]
            assert aliases == [{"name": "chat-default", "target": SMALL}]
