"""Auth on every route, read from the published OpenAPI schema so a new route cannot escape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import ControlPlaneClient, bearer, make_settings, new_tokens
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.routing import BaseRoute

from control_plane.api.auth import match_token
from control_plane.app import create_app
from control_plane.settings import Settings
from control_plane.tokens import TokenKind, read_token_file, resolve_tokens

SCHEME_KINDS = {"adminToken": "admin", "nodeToken": "node", "gatewayToken": "gateway"}
PUBLIC_PATHS = {"/openapi.json"}


def operations(schema: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, concrete path, the one token kind it needs) for every operation."""
    found = []
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            security = operation.get("security")
            assert security and len(security) == 1 and len(security[0]) == 1, (
                f"{method.upper()} {path} must declare exactly one bearer token kind"
            )
            (scheme,) = security[0]
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            found.append((method.upper(), concrete, SCHEME_KINDS[scheme]))
    return found


def all_routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """Routes of the app, looking inside included routers."""
    found: list[BaseRoute] = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        found.extend(all_routes(inner.routes) if inner is not None else [route])
    return found


async def call(cp: ControlPlaneClient, method: str, path: str, headers: dict[str, str]) -> int:
    body = {} if method in ("POST", "PUT", "PATCH") else None
    response = await cp.http.request(method, path, json=body, headers=headers)
    if response.status_code in (401, 403):
        error = response.json()["error"]
        assert {"message", "type", "code"} <= set(error)
    return response.status_code


@pytest.mark.asyncio
async def test_every_route_is_in_the_schema_with_one_token_kind(cp: ControlPlaneClient) -> None:
    assert cp.app is not None
    schema = (await cp.http.get("/openapi.json")).json()
    every = all_routes(cp.app.routes)
    routes = [r for r in every if isinstance(r, APIRoute)]
    assert routes and all(route.include_in_schema for route in routes)
    # The schema names a path parameter without its converter ({name:path} -> {name}).
    assert {re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path) for r in routes} == set(schema["paths"])
    others = {getattr(r, "path", repr(r)) for r in every if not isinstance(r, APIRoute)}
    assert others == PUBLIC_PATHS
    assert set(schema["components"]["securitySchemes"]) == set(SCHEME_KINDS)
    kinds = {kind for _, _, kind in operations(schema)}
    assert kinds == {"admin", "node", "gateway"}
    # Unauthenticated routes are the published schema only (no /docs that escapes the check).
    assert (await cp.http.get("/docs")).status_code == 404


@pytest.mark.asyncio
async def test_missing_or_wrong_token_is_401_and_other_kind_is_403(cp: ControlPlaneClient) -> None:
    schema = (await cp.http.get("/openapi.json")).json()
    ops = operations(schema)
    assert len(ops) >= 19
    headers_by_kind = cp.headers | {"node": await cp.node_headers("x")}
    for method, path, kind in ops:
        where = f"{method} {path}"
        assert await call(cp, method, path, {}) == 401, where
        assert await call(cp, method, path, bearer("not-a-token-" + "x" * 20)) == 401, where
        assert await call(cp, method, path, {"Authorization": "Basic YTpi"}) == 401, where
        wrong_prefix = {"Authorization": "Bearer " + cp.tokens.admin[:-1]}
        assert await call(cp, method, path, wrong_prefix) == 401, where
        for other, headers in headers_by_kind.items():
            status = await call(cp, method, path, headers)
            if other == kind:
                assert status not in (401, 403), where
            else:
                assert status == 403, f"{where} with the {other} token"


@pytest.mark.asyncio
async def test_401_carries_www_authenticate(cp: ControlPlaneClient) -> None:
    response = await cp.http.get("/v1/status")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "missing_api_key"


def test_match_token_tells_kinds_apart() -> None:
    tokens = new_tokens()
    assert match_token(tokens, tokens.admin) is TokenKind.ADMIN
    assert match_token(tokens, tokens.gateway) is TokenKind.GATEWAY
    assert match_token(tokens, "") is None
    assert match_token(tokens, "é" + tokens.gateway) is None


def test_settings_refuse_non_loopback_without_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="MERIDIAN_ADMIN_TOKEN"):
        Settings(host="0.0.0.0", db_path=str(tmp_path / "x.db"))
    tokens = new_tokens()
    settings = make_settings(tmp_path / "x.db", tokens, host="0.0.0.0")
    assert resolve_tokens(settings) == tokens


def test_settings_refuse_equal_or_short_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="must differ"):
        Settings(admin_token="a" * 20, gateway_token="a" * 20, db_path=str(tmp_path / "x.db"))
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(admin_token="short", db_path=str(tmp_path / "x.db"))


def test_settings_read_tokens_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = new_tokens()
    monkeypatch.setenv("MERIDIAN_ADMIN_TOKEN", tokens.admin)
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", tokens.gateway)
    settings = Settings(host="10.0.0.1")
    assert resolve_tokens(settings) == tokens


def test_loopback_generates_tokens_once_into_a_private_file(tmp_path: Path) -> None:
    settings = Settings(db_path=str(tmp_path / "cp.db"))
    first = resolve_tokens(settings)
    token_file = tmp_path / "cp.db.tokens"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert read_token_file(token_file) == {
        TokenKind.ADMIN: first.admin,
        TokenKind.GATEWAY: first.gateway,
    }
    assert first.admin != first.gateway
    # Nodes have no shared token: each gets its own credential from the admin API.
    assert "MERIDIAN_NODE_TOKEN" not in token_file.read_text()
    assert resolve_tokens(settings) == first  # a restart keeps them
    # A token given explicitly wins over the file and is not written to it.
    given = "given-admin-token-" + "z" * 10
    mixed = resolve_tokens(Settings(db_path=str(tmp_path / "cp.db"), admin_token=given))
    assert mixed.admin == given and mixed.gateway == first.gateway
    assert given not in token_file.read_text()


def test_create_app_on_loopback_without_tokens_works(tmp_path: Path) -> None:
    app = create_app(Settings(db_path=str(tmp_path / "cp.db")))
    assert app.title == "Meridian control plane"
    assert (tmp_path / "cp.db.tokens").exists()
