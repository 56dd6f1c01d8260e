"""Per-key model access, limits per model and token budgets: created, patched, refused when bad,
audited, carried in the gateways' snapshot; spend recorded from usage reports and read back
(`GET /v1/keys/{id}/spend`), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from conftest import ControlPlaneClient, settings_on_each_db

from control_plane.limit_reports import LimitLedger
from control_plane.limit_shares import LimitSharesConfig
from stack.status import key_spends
from wire.key_snapshot import KeySnapshot, period_start
from wire.limit_shares import ModelSpend, ShareAnswer, UsageReport

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL

SMALL, LARGE = "smollm2-135m-instruct", "org/large-v2:latest"
ACCESS = {
    "models": [SMALL, "chat-default"],
    "model_limits": {SMALL: {"rpm": 10, "tpm": 1000}},
    "max_budget_tokens": 5000,
    "budget_period": "1d",
}


async def create_key(cp: ControlPlaneClient, **fields: object) -> dict[str, Any]:
    body = {"name": "team-a", "rpm": 60, "tpm": 10_000} | fields
    response = await cp.http.post("/v1/keys", json=body, headers=cp.admin)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def snapshot(cp: ControlPlaneClient) -> KeySnapshot:
    response = await cp.http.get("/v1/keys/snapshot", headers=cp.gateway)
    return KeySnapshot.model_validate_json(response.content)


async def patch(cp: ControlPlaneClient, key_id: str, body: object) -> Any:
    return await cp.http.patch(f"/v1/keys/{key_id}", json=body, headers=cp.admin)


@pytest.mark.asyncio
async def test_a_key_created_with_access_and_budget_carries_them_to_gateways(
    cp: ControlPlaneClient,
) -> None:
    created = await create_key(cp, **ACCESS)
    assert {name: created[name] for name in ACCESS} == ACCESS
    (listed,) = (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"]
    assert {name: listed[name] for name in ACCESS} == ACCESS

    (grant,) = (await snapshot(cp)).keys
    assert grant.models == (SMALL, "chat-default")
    assert {m: (lim.rpm, lim.tpm) for m, lim in grant.model_limits.items()} == {SMALL: (10, 1000)}
    assert (grant.max_budget_tokens, grant.budget_period_s) == (5000, 86_400)

    plain = await create_key(cp, name="plain")
    assert (plain["models"], plain["model_limits"], plain["max_budget_tokens"]) == (None, {}, None)
    grants = {grant.id: grant for grant in (await snapshot(cp)).keys}
    assert grants[plain["id"]].models is None and grants[plain["id"]].model_limits == {}


@pytest.mark.asyncio
async def test_a_patch_changes_access_wakes_gateways_and_is_audited(cp: ControlPlaneClient) -> None:
    created = await create_key(cp, **ACCESS)
    before = (await snapshot(cp)).index
    response = await patch(
        cp, created["id"], {"models": None, "max_budget_tokens": 100, "budget_period": "12h"}
    )
    assert response.status_code == 200, response.text
    patched = response.json()
    assert patched["models"] is None and patched["model_limits"] == ACCESS["model_limits"]
    assert (patched["max_budget_tokens"], patched["budget_period"]) == (100, "12h")

    after = await snapshot(cp)
    assert after.index > before
    (grant,) = after.keys
    assert grant.models is None and (grant.max_budget_tokens, grant.budget_period_s) == (
        100,
        43_200,
    )

    cleared = await patch(
        cp, created["id"], {"max_budget_tokens": None, "budget_period": None, "model_limits": None}
    )
    assert cleared.status_code == 200, cleared.text
    assert (cleared.json()["max_budget_tokens"], cleared.json()["model_limits"]) == (None, {})

    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    updates = [e["detail"] for e in entries if e["action"] == "key.update"]
    assert updates[0]["models"] is None and updates[0]["old"] == {
        "models": ACCESS["models"],
        "max_budget_tokens": 5000,
        "budget_period": "1d",
    }
    assert updates[1]["old"]["max_budget_tokens"] == 100


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"max_budget_tokens": 100}, "together"),
        ({"budget_period": "1d"}, "together"),
        ({"max_budget_tokens": 100, "budget_period": "1w"}, "unit"),
        ({"max_budget_tokens": 100, "budget_period": 86400}, "string"),
        ({"max_budget_tokens": 0, "budget_period": "1d"}, "max_budget_tokens"),
        ({"models": ["has space"]}, "models"),
        ({"models": [SMALL, SMALL]}, "twice"),
        ({"model_limits": {SMALL: {"rpm": 0, "tpm": 5}}}, "rpm"),
        ({"model_limits": {SMALL: {"tpm": 5}}}, "rpm"),
        ({"model_limits": {"bad name": {"rpm": 1, "tpm": 5}}}, "model_limits"),
        ({"budget": 5}, "budget"),
    ],
)
async def test_bad_access_is_refused_with_what_is_wrong(
    cp: ControlPlaneClient, body: dict[str, object], says: str
) -> None:
    refused = await cp.http.post(
        "/v1/keys", json={"name": "k", "rpm": 1, "tpm": 1} | body, headers=cp.admin
    )
    assert refused.status_code == 422, refused.text
    assert says in refused.json()["error"]["message"]
    key = await create_key(cp)
    patched = await patch(cp, key["id"], body)
    assert patched.status_code == 422 and says in patched.json()["error"]["message"]


@pytest.mark.asyncio
async def test_a_patch_of_nothing_a_missing_or_a_revoked_key_is_refused(
    cp: ControlPlaneClient,
) -> None:
    key = await create_key(cp)
    assert (await patch(cp, key["id"], {})).status_code == 422
    missing = await patch(cp, "key_nope", {"models": None})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "key_not_found")
    assert (await cp.http.get("/v1/keys/key_nope/spend", headers=cp.admin)).status_code == 404
    await cp.http.delete(f"/v1/keys/{key['id']}", headers=cp.admin)
    revoked = await patch(cp, key["id"], {"models": None})
    assert (revoked.status_code, revoked.json()["error"]["code"]) == (409, "key_revoked")
    unauthorized = await cp.http.patch(f"/v1/keys/{key['id']}", json={"models": None})
    assert unauthorized.status_code == 401


def report(
    pop: str, batch: str, *spend: tuple[str, str, int], reporter: str | None = None
) -> UsageReport:
    return UsageReport(
        pop=pop,
        spend=[ModelSpend(key_id=k, model=m, num_tokens=n) for k, m, n in spend],
        spend_batch=batch,
        reporter=reporter,
    )


@pytest.mark.asyncio
async def test_spend_is_recorded_per_model_once_per_batch_and_read_back(
    cp: ControlPlaneClient,
) -> None:
    budgeted = await create_key(cp, max_budget_tokens=1000, budget_period="1h")
    plain = await create_key(cp, name="plain")
    ledger = LimitLedger(cp.services.store, LimitSharesConfig())
    b, p = budgeted["id"], plain["id"]

    first = report("new-york", "b1", (b, SMALL, 300), (b, LARGE, 200), (p, SMALL, 7))
    answer: ShareAnswer = await ledger.report(first)
    await ledger.report(first)  # its answer was lost: sent again, counted once
    await ledger.report(report("london", "b1", (b, SMALL, 100)))  # another PoP's batch
    answer = await ledger.report(report("new-york", "b2", (b, SMALL, 50)))
    (spent,) = answer.spent  # only keys with a budget
    assert (spent.key_id, spent.spent_tokens) == (b, 650)
    assert spent.period_start == period_start(time.time(), 3600)

    response = await cp.http.get(f"/v1/keys/{b}/spend", headers=cp.admin)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["key"] == b and body["budget_period"] == "1h"
    assert body["period_end"] - body["period_start"] == 3600
    assert body["period_start"] <= time.time() < body["period_end"]
    assert (body["max_budget_tokens"], body["spent_tokens"], body["remaining_tokens"]) == (
        1000,
        650,
        350,
    )
    assert body["models"] == {SMALL: 450, LARGE: 200}

    plain_spend = (await cp.http.get(f"/v1/keys/{p}/spend", headers=cp.admin)).json()
    assert plain_spend["budget_period"] == "1d" and plain_spend["remaining_tokens"] is None
    assert plain_spend["models"] == {SMALL: 7}

    await ledger.report(report("london", "b2", (b, LARGE, 600)))  # over its budget
    over = (await cp.http.get(f"/v1/keys/{b}/spend", headers=cp.admin)).json()
    assert (over["spent_tokens"], over["remaining_tokens"]) == (1250, 0)


@pytest.mark.asyncio
async def test_each_gateway_process_of_a_pop_has_its_resent_batch_counted_once(
    cp: ControlPlaneClient,
) -> None:
    key = (await create_key(cp, max_budget_tokens=10_000, budget_period="1h"))["id"]
    ledger = LimitLedger(cp.services.store, LimitSharesConfig())

    async def spent() -> int:
        return int(
            (await cp.http.get(f"/v1/keys/{key}/spend", headers=cp.admin)).json()["spent_tokens"]
        )

    # Two processes of one PoP: the first's answer is lost while the second reports, and the
    # first sends its batch again; so does the second, after a third batch of the first.
    first, second = (
        report("new-york", "a1", (key, SMALL, 100), reporter="p1"),
        report("new-york", "b1", (key, SMALL, 10), reporter="p2"),
    )
    for sent in (first, second, first):
        await ledger.report(sent)
    assert await spent() == 110
    await ledger.report(report("new-york", "a2", (key, SMALL, 1000), reporter="p1"))
    await ledger.report(second)
    assert await spent() == 1110
    # A gateway that names no process is its PoP's only one, as before.
    for _ in range(2):
        await ledger.report(report("london", "c1", (key, SMALL, 5)))
    assert await spent() == 1115


@pytest.mark.asyncio
async def test_spend_of_periods_before_each_keys_previous_one_is_pruned(
    cp: ControlPlaneClient,
) -> None:
    h = (await create_key(cp, name="hourly", max_budget_tokens=10_000, budget_period="1h"))["id"]
    d = (await create_key(cp, name="daily"))["id"]  # no budget: a UTC day
    day_s, hour_s = 86_400, 3600
    start = period_start(time.time(), day_s) - 10 * day_s
    now = [float(start)]
    ledger = LimitLedger(cp.services.store, LimitSharesConfig(), clock=lambda: now[0])

    async def spend_at(at: float, batch: str) -> list[tuple[str, str, int]]:
        """A report of both keys' spend at `at`; then every row left, by key, model, period."""
        now[0] = at
        await ledger.report(report("new-york", batch, (h, SMALL, 10), (h, LARGE, 1), (d, SMALL, 5)))

        def rows(conn: Any) -> list[tuple[str, str, int]]:
            found = conn.execute("SELECT key_id, model, period_start FROM key_spend").fetchall()
            return sorted((r["key_id"], r["model"], int(r["period_start"])) for r in found)

        return await cp.services.store.read(rows)

    for hour in range(3):
        await spend_at(start + hour * hour_s + 1, f"b{hour}")
    # Hour 3: the hourly key keeps hours 2 and 3, for both models; the day is current.
    kept = await spend_at(start + 3 * hour_s + 1, "b3")
    assert kept == sorted(
        [(h, m, start + i * hour_s) for m in (SMALL, LARGE) for i in (2, 3)] + [(d, SMALL, start)]
    )
    # A day and an hour later: the daily key keeps yesterday, the hourly key this hour alone.
    later = start + day_s + 3 * hour_s + 1
    kept = await spend_at(later, "b4")
    assert kept == sorted(
        [(h, m, later - 1) for m in (SMALL, LARGE)] + [(d, SMALL, start), (d, SMALL, start + day_s)]
    )

    def senders(conn: Any) -> list[tuple[str, str]]:
        found = conn.execute("SELECT pop, reporter FROM spend_reporters").fetchall()
        return sorted((r["pop"], r["reporter"]) for r in found)

    # The last batch of a process not heard from in a week is forgotten; a live one's is kept.
    now[0] = later + 7 * day_s + hour_s
    await ledger.report(report("london", "c1", (d, SMALL, 1), reporter="p1"))
    assert await cp.services.store.read(senders) == [("london", "p1")]


@pytest.mark.asyncio
async def test_meridian_status_shows_each_keys_spend_per_model(live_cp: ControlPlaneClient) -> None:
    budgeted = await create_key(live_cp, name="team-b", max_budget_tokens=300, budget_period="1d")
    plain = await create_key(live_cp, name="team-p")
    revoked = await create_key(live_cp, name="gone")
    await live_cp.http.delete(f"/v1/keys/{revoked['id']}", headers=live_cp.admin)
    ledger = LimitLedger(live_cp.services.store, LimitSharesConfig())
    b = budgeted["id"]
    await ledger.report(report("new-york", "b1", (b, SMALL, 250), (b, LARGE, 50)))

    # Blocking HTTP calls, as `meridian status` makes them: off the event loop.
    lines = await asyncio.to_thread(key_spends, live_cp.base_url, live_cp.admin)
    text = "\n".join(lines)
    assert revoked["id"] not in text and plain["id"] in text
    (total,) = [line.split() for line in lines if b in line]
    assert total[1:7] == ["team-b", "(all)", "300", "300", "(SPENT)", "1d"]
    by_model = {line.split()[0]: line.split()[1] for line in lines if line.startswith("    ")}
    assert by_model == {SMALL: "250", LARGE: "50"}


@pytest.mark.asyncio
async def test_a_key_stored_before_access_existed_reads_as_unlimited(
    cp: ControlPlaneClient,
) -> None:
    def insert(conn: Any) -> None:  # the columns of the schema before migration 10
        conn.execute(
            "INSERT INTO api_keys (id, name, tenant, secret_sha256, rpm, tpm, created_at) "
            "VALUES ('key_old', 'old', NULL, ?, 5, 500, 1)",
            ("0" * 64,),
        )

    cp.services.store.write_sync(insert)
    cp.services.keys.follow(cp.services.keys.feed.index + 1)  # as after another writer
    (listed,) = (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"]
    assert (listed["models"], listed["model_limits"], listed["budget_period"]) == (None, {}, None)
    (grant,) = (await snapshot(cp)).keys
    assert (grant.models, grant.model_limits, grant.max_budget_tokens) == (None, {}, None)
    spend = (await cp.http.get("/v1/keys/key_old/spend", headers=cp.admin)).json()
    assert (spend["spent_tokens"], spend["budget_period"], spend["models"]) == (0, "1d", {})
