"""`python -m control_plane.admin_cli model ...` against a real control plane on loopback (called
in-process through `main`): the catalog edited from a script, and each refusal as one line."""

from __future__ import annotations

import pytest
from admin_cli_runner import Cli, cli_fixture

from wire.model_catalog import MODEL_NAME_PATTERN

SMALL, LARGE = "smollm2-135m-instruct", "org/large-v2"


cli = cli_fixture("model")


@pytest.mark.asyncio
async def test_models_aliases_and_fallbacks_from_the_command_line(cli: Cli) -> None:
    run = cli
    assert run("list") == (0, "the catalog is empty and no node serves a model", "")
    assert run("add", SMALL) == (0, f"model {SMALL}: added", "")
    assert run("add", LARGE, "--owned-by=acme", f"--fallback={SMALL}") == (
        0,
        f"model {LARGE}: added",
        "",
    )
    assert run("alias", "chat", SMALL) == (0, f"alias chat: created -> {SMALL}", "")
    assert run("alias", "chat", SMALL) == (0, f"alias chat: unchanged -> {SMALL}", "")
    assert run("alias", "chat", LARGE) == (0, f"alias chat: moved {SMALL} -> {LARGE}", "")
    assert run("fallbacks", SMALL, "chat") == (0, f"model {SMALL}: fallbacks chat", "")
    assert run("fallbacks", SMALL) == (0, f"model {SMALL}: fallbacks cleared", "")
    status, out, err = run("list")
    assert (status, err) == (0, "")
    assert out.splitlines() == [
        f"model {SMALL}  owned_by meridian  fallbacks -  aliases -  regions none (no capacity)",
        f"model {LARGE}  owned_by acme  fallbacks {SMALL}  aliases chat  "
        "regions none (no capacity)",
        f"alias chat -> {LARGE} ({LARGE})",
    ]
    assert run("remove", "chat") == (0, "chat: removed", "")
    assert run("remove", "chat") == (0, "chat: already absent", "")


@pytest.mark.asyncio
async def test_each_refusal_is_one_line(cli: Cli) -> None:
    run = cli
    run("add", SMALL)
    run("add", LARGE, f"--fallback={SMALL}")
    run("alias", "a", SMALL)
    run("alias", "b", "a")
    assert run("alias", "a", "b") == (
        1,
        "",
        "admin_cli: error: model alias a: 409 alias loop: a -> b -> a",
    )
    assert run("add", SMALL) == (
        1,
        "",
        f"admin_cli: error: model add {SMALL}: 409 the name '{SMALL}' is taken",
    )
    assert run("alias", SMALL, LARGE) == (
        1,
        "",
        f"admin_cli: error: model alias {SMALL}: '{SMALL}' is a model, not an alias",
    )
    assert run("fallbacks", LARGE, "nowhere")[2] == (
        f"admin_cli: error: model fallbacks {LARGE}: 409 model '{LARGE}' falls back to "
        "unknown 'nowhere'"
    )
    assert run("remove", SMALL) == (
        1,
        "",
        f"admin_cli: error: model remove {SMALL}: 409 '{SMALL}' is still named by alias 'a', "
        f"the fallbacks of '{LARGE}': point those elsewhere first",
    )
    assert run("add", "has space") == (
        2,
        "",
        f"admin_cli: error: argument name: 'has space' is not a model name ({MODEL_NAME_PATTERN})",
    )
