"""The model catalog between two `python -m control_plane` replicas on one real PostgreSQL: an
edit through one is listed by the other and reaches the other's summary document, and the store,
not a replica's memory, decides conflicts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import ControlPlaneProcess, bearer
from test_cp_replicas import wait_for

from control_plane.tokens import TokenSet

pytestmark = pytest.mark.slow  # starts two control planes and a PostgreSQL

SMALL, LARGE = "smollm2-135m-instruct", "org/large-v2"


def call(
    cp: ControlPlaneProcess, tokens: TokenSet, method: str, path: str, body: Any = None
) -> httpx.Response:
    return httpx.request(
        method, cp.base_url + path, json=body, headers=bearer(tokens.admin), timeout=5.0
    )


def aliases_in_summary(cp: ControlPlaneProcess, tokens: TokenSet) -> tuple[int, list[Any]]:
    response = httpx.get(
        cp.base_url + "/v1/regions/summary", headers=bearer(tokens.gateway), timeout=5.0
    )
    document = response.json()
    return document["index"], document["catalog"]["aliases"]


def test_an_edit_through_one_replica_reaches_the_others_listing_and_summaries(
    start_replica: Any, tokens: TokenSet
) -> None:
    a, b = start_replica("a"), start_replica("b")
    assert call(a, tokens, "POST", "/v1/models", {"name": SMALL}).status_code == 201
    assert call(a, tokens, "POST", "/v1/models", {"name": LARGE}).status_code == 201
    assert call(a, tokens, "POST", "/v1/models", {"name": "chat", "target": SMALL}).is_success
    wait_for(
        lambda: (
            [m["id"] for m in call(b, tokens, "GET", "/v1/models").json()["data"]] == [SMALL, LARGE]
        ),
        "b to list a's models",
    )
    wait_for(
        lambda: aliases_in_summary(b, tokens)[1] == [{"name": "chat", "target": SMALL}],
        "the alias in b's summaries",
    )
    # The flip made at b moves a's summary document on.
    index_before, _ = aliases_in_summary(a, tokens)
    assert call(b, tokens, "PATCH", "/v1/models/chat", {"target": LARGE}).status_code == 200
    wait_for(
        lambda: aliases_in_summary(a, tokens)[1] == [{"name": "chat", "target": LARGE}],
        "b's flip in a's summaries",
    )
    assert aliases_in_summary(a, tokens)[0] > index_before

    # Each edit is checked against the stored catalog: b refuses a name a has just taken, and
    # a refuses to remove what b's alias now names.
    assert call(a, tokens, "POST", "/v1/models", {"name": "coder"}).status_code == 201
    taken = call(b, tokens, "POST", "/v1/models", {"name": "coder", "target": SMALL})
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "model_exists")
    in_use = call(a, tokens, "DELETE", f"/v1/models/{LARGE}")
    assert (in_use.status_code, in_use.json()["error"]["code"]) == (409, "model_in_use")
    assert call(b, tokens, "DELETE", "/v1/models/coder").status_code == 204
    wait_for(
        lambda: (
            [m["id"] for m in call(a, tokens, "GET", "/v1/models").json()["data"]] == [SMALL, LARGE]
        ),
        "the delete at b to reach a",
    )


def test_edits_made_at_once_through_both_replicas_are_all_kept(
    start_replica: Any, tokens: TokenSet
) -> None:
    """Each edit reads, changes and writes the stored catalog in one transaction that holds the
    document's row: an edit committed meanwhile by the other replica is never overwritten."""
    a, b = start_replica("a"), start_replica("b")
    names = [f"m{i:02d}" for i in range(24)]

    def add(i: int) -> int:
        return call((a, b)[i % 2], tokens, "POST", "/v1/models", {"name": names[i]}).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(add, range(len(names)))) == [201] * len(names)

    def listed(cp: ControlPlaneProcess) -> list[str]:
        return sorted(m["id"] for m in call(cp, tokens, "GET", "/v1/models").json()["data"])

    wait_for(lambda: listed(a) == listed(b) == names, "every model at both replicas")
