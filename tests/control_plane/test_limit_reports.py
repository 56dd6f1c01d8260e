"""Gateway PoPs' usage reports and the shares answered (control_plane/limit_reports.py), on each
store backend with a fake clock; and the route's authentication."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import ControlPlaneClient

from control_plane.limit_reports import LimitLedger
from control_plane.limit_shares import LimitSharesConfig
from control_plane.store import open_store
from control_plane.store.base import Connection
from wire.limit_shares import KeyUse, ShareAnswer, UsageReport, model_entry

CONFIG = LimitSharesConfig(floor=0.06, demand_half_life_s=2.0, pop_ttl_s=15.0)
KEY = "key_a"


class Ledger:
    """A ledger on a fresh database, with one key (60 rpm, 6,000 tpm) and a clock to move."""

    def __init__(self, db: str) -> None:
        self.now = 1000.0
        self.store = open_store(db)
        self.add_key(KEY)
        self.ledger = LimitLedger(self.store, CONFIG, clock=lambda: self.now)

    def add_key(self, key_id: str, rpm: int = 60, tpm: int = 6000) -> None:
        def insert(conn: Connection) -> None:
            conn.execute(
                "INSERT INTO api_keys (id, name, tenant, secret_sha256, rpm, tpm, created_at) "
                "VALUES (?, 'k', NULL, ?, ?, ?, 0)",
                (key_id, key_id.ljust(64, "0"), rpm, tpm),
            )

        self.store.write_sync(insert)

    def report(self, pop: str, *uses: KeyUse, wants_levels: bool = False) -> ShareAnswer:
        report = UsageReport(pop=pop, wants_levels=wants_levels, keys=list(uses))
        return asyncio.run(self.ledger.report(report))

    def share(self, pop: str, *uses: KeyUse) -> float:
        answer = self.report(pop, *uses)
        return next((s.share for s in answer.shares if s.key_id == KEY), answer.default_share)

    def rows(self) -> int:
        return int(
            self.store.read_sync(
                lambda conn: conn.execute("SELECT COUNT(*) AS n FROM limit_shares").fetchone()["n"]
            )
        )


@pytest.fixture
def ledger(db: str) -> Iterator[Ledger]:
    made = Ledger(db)
    yield made
    made.store.close()


def use(num_tokens: int = 600, token_level: float = 0.0, **fields: object) -> KeyUse:
    values: dict[str, object] = {
        "key_id": KEY,
        "num_requests": 1,
        "num_tokens": num_tokens,
        "request_level": 10.0,
        "token_level": token_level,
    }
    return KeyUse.model_validate(values | fields)


def test_a_pop_alone_holds_the_whole_key_and_joining_pops_split_it(ledger: Ledger) -> None:
    assert ledger.report("new-york").default_share == pytest.approx(1.0)
    ledger.now += 1
    # A joining PoP gets its part at once; the others give theirs up at their next report.
    assert ledger.report("london").default_share == pytest.approx(0.5)
    ledger.now += 1
    assert ledger.report("new-york").default_share == pytest.approx(0.5)
    assert ledger.report("singapore").default_share == pytest.approx(1 / 3)
    assert ledger.report("london").default_share == pytest.approx(1 / 3)
    assert ledger.report("new-york").default_share == pytest.approx(1 / 3)


def test_shares_follow_demand_and_never_add_up_to_more_than_one(ledger: Ledger) -> None:
    pops = ("new-york", "london", "singapore")
    for pop in pops:
        ledger.report(pop)
    for pop in pops:  # all at a third now
        ledger.report(pop)
    held = {pop: 1 / 3 for pop in pops}
    for _ in range(4):  # every second, the key's clients ask london only
        for pop in pops:
            held[pop] = ledger.share(pop, use()) if pop == "london" else ledger.share(pop)
            assert sum(held.values()) <= 1.0 + 1e-9
        ledger.now += 1
    assert held == pytest.approx({"new-york": 0.02, "london": 0.96, "singapore": 0.02})


def test_a_pop_that_refused_a_large_request_gets_room_for_it(ledger: Ledger) -> None:
    for pop in ("new-york", "london"):
        ledger.report(pop)
    for _ in range(3):  # the key's whole rate asked at new-york: london keeps the floor's part
        ledger.share("new-york", use(num_tokens=6000))
        ledger.share("london")
        ledger.now += 1
    assert ledger.share("london") == pytest.approx(0.03)
    # london refused a request of 3,000 tokens, half the key: by demand it would get a sixth,
    # but it needs half. New-york gives it up at its next report, then london takes it.
    refused = use(num_tokens=3000, largest_refused_tokens=3000)
    assert ledger.share("london", refused) == pytest.approx(0.03)
    assert ledger.share("new-york") == pytest.approx(0.5)
    assert ledger.share("london") == pytest.approx(0.5)


def test_levels_come_back_refilled_when_asked(ledger: Ledger) -> None:
    ledger.report("new-york", use(token_level=-300.0, request_level=2.0))
    ledger.now += 6.0  # 6 s at the whole key (this PoP holds it all): 600 tokens, 6 requests
    answer = ledger.report("new-york", wants_levels=True)
    [levels] = answer.levels
    assert (levels.key_id, levels.request_level, levels.token_level) == (KEY, 8.0, 300.0)
    assert ledger.report("new-york").levels == []  # only when asked
    ledger.now += 60.0  # full again: nothing to start from
    assert ledger.report("new-york", wants_levels=True).levels == []


def test_a_silent_pop_gives_its_share_back_after_the_ttl(ledger: Ledger) -> None:
    ledger.report("new-york")
    ledger.report("london")
    ledger.report("new-york")
    ledger.now += 10.0
    assert ledger.report("new-york").default_share == pytest.approx(0.5)
    ledger.now += 10.0  # london silent for 20 s
    assert ledger.report("new-york").default_share == pytest.approx(1.0)


def test_an_idle_key_is_forgotten_and_a_revoked_one_at_once(ledger: Ledger) -> None:
    ledger.report("new-york", use(token_level=3000.0))
    assert ledger.rows() == 1
    ledger.now += 300.0  # no demand since, and refilled
    answer = ledger.report("new-york")
    assert answer.shares == [] and ledger.rows() == 0
    ledger.report("new-york", use())
    ledger.store.write_sync(
        lambda conn: conn.execute("UPDATE api_keys SET revoked_at = 1 WHERE id = ?", (KEY,))
    )
    assert ledger.report("new-york").shares == [] and ledger.rows() == 0


def test_unknown_keys_in_a_report_are_skipped(ledger: Ledger) -> None:
    answer = ledger.report("new-york", use(key_id="key_nobody"))
    assert answer.shares == [] and ledger.rows() == 0


def test_a_keys_limit_on_a_model_is_shared_as_an_entry_of_its_own(ledger: Ledger) -> None:
    entry = model_entry(KEY, "m-1")
    ledger.store.write_sync(
        lambda conn: conn.execute(
            "UPDATE api_keys SET model_limits = ? WHERE id = ?",
            ('{"m-1": {"rpm": 6, "tpm": 600}}', KEY),
        )
    )
    for pop in ("new-york", "london"):
        ledger.report(pop)
    for _ in range(3):  # the model's whole rate (its own 600 TPM) asked at new-york
        ledger.report("new-york", use(key_id=entry, num_tokens=600))
        ledger.report("london")
        ledger.now += 1
    shares = {s.key_id: s.share for s in ledger.report("new-york").shares}
    assert shares[entry] == pytest.approx(0.97) and KEY not in shares  # the key: unasked
    ledger.store.write_sync(
        lambda conn: conn.execute("UPDATE api_keys SET model_limits = NULL WHERE id = ?", (KEY,))
    )
    assert ledger.report("new-york", use(key_id=entry)).shares == [] and ledger.rows() == 0


@pytest.mark.asyncio
async def test_only_gateways_may_report(cp: ControlPlaneClient) -> None:
    body = UsageReport(pop="new-york").model_dump(mode="json")
    for headers, status in ((cp.gateway, 200), (cp.admin, 403), ({}, 401)):
        response = await cp.http.post("/v1/limits/report", json=body, headers=headers)
        assert response.status_code == status, response.text
    answer = ShareAnswer.model_validate_json(
        (await cp.http.post("/v1/limits/report", json=body, headers=cp.gateway)).content
    )
    assert answer.default_share == pytest.approx(1.0)
    bad = body | {"pop": "New York"}
    response = await cp.http.post("/v1/limits/report", json=bad, headers=cp.gateway)
    assert response.status_code == 422
