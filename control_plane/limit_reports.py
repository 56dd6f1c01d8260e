"""Gateways' usage reports, kept in the store, and the limit shares answered to them.

One report is one write transaction: it records the PoP as live, folds what it was asked per
key into that key's decayed demand there, keeps its buckets' levels, works out its share of
every key in use (`control_plane/limit_shares.py`) and of every other key (its default share),
and answers them. The state lives in the store (tables `limit_pops`, `limit_shares`), so that
control-plane replicas agree on it and a restart forgets neither shares nor a PoP's debt. Every
report first updates one `meta` row, which on PostgreSQL holds that row's lock until commit:
reports are worked out one at a time across replicas, each against the shares the others were
granted (SQLite serializes writes anyway).

A key's limits on one model are an entry of their own (`wire.limit_shares.model_entry`), shared
the same way with that model's limits. A key whose demand has died down everywhere, whose shares
are back to the PoPs' defaults and whose buckets have all refilled is forgotten (its rows
deleted); so are a revoked key's, and a removed model limit's.

The same transaction records the report's spend (`control_plane/spend.py`) and answers what
each key with a budget spent in its current period.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final

from control_plane.limit_shares import (
    MIN_DEMAND,
    LimitSharesConfig,
    PopDemand,
    decayed,
    demand_of,
    need_of,
    share_for,
)
from control_plane.spend import budgets_spent, prune_spend, record_spend
from control_plane.store.base import Connection, Row, Store, set_meta
from wire.key_snapshot import ModelLimit
from wire.limit_shares import (
    MODEL_SEPARATOR,
    KeyLevels,
    KeyShare,
    KeyUse,
    ShareAnswer,
    UsageReport,
    model_entry,
)

SECONDS_PER_MINUTE = 60.0
# A PoP that refused a request keeps the share to hold it this long: once it holds it, the
# request fits within a minute (the bucket's whole refill), and the client was told so.
NEED_HOLD_S = 75.0
LOCK_ROW = "limit_shares_lock"
SAME = 1e-9  # shares this close are the same
_IS_MODEL_ENTRY: Final = f"%{MODEL_SEPARATOR}%"  # LIKE pattern
# Limit entry -> its (rpm, tpm).
Limits = dict[str, tuple[int, int]]


@dataclass(slots=True)
class _KeyRow:
    """One key at one PoP (a row of `limit_shares`)."""

    key_id: str
    pop: str
    rpm: int
    tpm: int
    share: float | None  # None: not granted yet (the PoP holds its default share)
    demand: float
    demand_at: float
    need: float
    need_at: float
    request_level: float | None = None
    token_level: float | None = None
    levels_at: float | None = None

    @classmethod
    def of(cls, row: Row) -> _KeyRow:
        return cls(**{name: row[name] for name in _COLUMNS})

    def standing(self, now: float, half_life_s: float, claim: float | None) -> PopDemand:
        need = self.need if now - self.need_at < NEED_HOLD_S else 0.0
        demand = decayed(self.demand, now - self.demand_at, half_life_s)
        return PopDemand(demand, need, claim if self.share is None else self.share)

    def levels_now(self, now: float) -> KeyLevels | None:
        """Its buckets' levels refilled to `now`; None if unknown or full by now."""
        share = self.share
        if share is None or self.levels_at is None:
            return None
        if self.request_level is None or self.token_level is None:
            return None
        elapsed_s = max(0.0, now - self.levels_at)
        levels = KeyLevels(
            key_id=self.key_id,
            request_level=_refilled(self.request_level, self.rpm * share, elapsed_s),
            token_level=_refilled(self.token_level, self.tpm * share, elapsed_s),
        )
        is_full = levels.request_level >= self.rpm * share and levels.token_level >= (
            self.tpm * share
        )
        return None if is_full else levels


_COLUMNS = tuple(_KeyRow.__dataclass_fields__)
_STORED = tuple(name for name in _COLUMNS if name not in ("rpm", "tpm"))
# The PoP each live PoP's default share (None: a PoP without one yet, joining now).
Held = dict[str, float | None]


def _refilled(level: float, capacity: float, elapsed_s: float) -> float:
    return min(capacity, level + elapsed_s * capacity / SECONDS_PER_MINUTE)


class LimitLedger:
    def __init__(
        self, store: Store, config: LimitSharesConfig, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._config = config
        self._clock = clock

    async def report(self, report: UsageReport) -> ShareAnswer:
        return await self._store.write(partial(self._apply, report=report, now=self._clock()))

    def _apply(self, conn: Connection, report: UsageReport, now: float) -> ShareAnswer:
        set_meta(conn, LOCK_ROW, repr(now))  # one report at a time (see the module's docstring)
        pop, floor = report.pop, self._config.floor
        held = self._held_defaults(conn, pop, now)
        default_share = share_for(pop, {p: PopDemand(0.0, 0.0, c) for p, c in held.items()}, floor)
        conn.execute(
            "INSERT INTO limit_pops (pop, default_share, reported_at) VALUES (?, ?, ?) "
            "ON CONFLICT (pop) DO UPDATE SET default_share = excluded.default_share, "
            "reported_at = excluded.reported_at",
            (pop, default_share, now),
        )
        record_spend(conn, report, now)
        prune_spend(conn, now)
        model_limits = _model_limits(conn)
        rows = _load_rows(conn, model_limits)
        half_life_s = self._config.demand_half_life_s
        reported = _record_uses(conn, report, rows, model_limits, now, half_life_s)
        shares = []
        for key_id, by_pop in rows.items():
            standing = self._standing(by_pop, held, now)
            share = share_for(pop, standing, floor)
            if abs(share - default_share) < SAME and self._is_forgettable(by_pop, held, now):
                conn.execute("DELETE FROM limit_shares WHERE key_id = ?", (key_id,))
                continue
            shares.append(KeyShare(key_id=key_id, share=share))
            mine = by_pop.get(pop)
            if mine is None and abs(share - default_share) < SAME:
                continue  # the PoP's default serves
            if mine is None:
                some = next(iter(by_pop.values()))
                mine = _KeyRow(key_id, pop, some.rpm, some.tpm, None, 0.0, now, 0.0, now)
                by_pop[pop] = mine
            if key_id in reported or mine.share != share:
                mine.share = share
                _save(conn, mine)
        conn.execute(
            "DELETE FROM limit_shares WHERE key_id NOT LIKE ? AND key_id NOT IN "
            "(SELECT id FROM api_keys WHERE revoked_at IS NULL)",
            (_IS_MODEL_ENTRY,),
        )
        levels = []
        if report.wants_levels:
            mine_rows = (by_pop.get(pop) for by_pop in rows.values())
            levels = [lv for row in mine_rows if row and (lv := row.levels_now(now)) is not None]
        spent = budgets_spent(conn, now)
        return ShareAnswer(default_share=default_share, shares=shares, levels=levels, spent=spent)

    def _held_defaults(self, conn: Connection, pop: str, now: float) -> Held:
        """The default share each live PoP holds, `pop`'s included (None if it has none yet)."""
        oldest = now - self._config.pop_ttl_s
        held: Held = {
            row["pop"]: float(row["default_share"])
            for row in conn.execute("SELECT pop, default_share, reported_at FROM limit_pops")
            if row["pop"] == pop or row["reported_at"] >= oldest
        }
        held.setdefault(pop, None)
        return held

    def _standing(self, by_pop: dict[str, _KeyRow], held: Held, now: float) -> dict[str, PopDemand]:
        """Every live PoP's standing for one key (a PoP without a row: no demand, its default)."""
        half_life_s = self._config.demand_half_life_s
        return {
            p: by_pop[p].standing(now, half_life_s, claim)
            if p in by_pop
            else PopDemand(0.0, 0.0, claim)
            for p, claim in held.items()
        }

    def _is_forgettable(self, by_pop: dict[str, _KeyRow], held: Held, now: float) -> bool:
        """Unused everywhere, every live PoP at its default share, every bucket refilled: the
        key is where a key without rows would be."""
        half_life_s = self._config.demand_half_life_s
        for p, row in by_pop.items():
            if decayed(row.demand, now - row.demand_at, half_life_s) >= MIN_DEMAND:
                return False
            default = held.get(p)
            if default is not None and row.share is not None and abs(row.share - default) > SAME:
                return False
            if row.levels_now(now) is not None:
                return False
        return True


def _model_limits(conn: Connection) -> Limits:
    """The limit entry of every active key's limit on a model, with its limits."""
    limits: Limits = {}
    for row in conn.execute(
        "SELECT id, model_limits FROM api_keys "
        "WHERE revoked_at IS NULL AND model_limits IS NOT NULL"
    ):
        for model, limit in json.loads(row["model_limits"]).items():
            checked = ModelLimit.model_validate(limit)
            limits[model_entry(row["id"], model)] = (checked.rpm, checked.tpm)
    return limits


def _load_rows(conn: Connection, model_limits: Limits) -> dict[str, dict[str, _KeyRow]]:
    """Every active limit entry's rows, by entry and PoP (a removed model limit's deleted)."""
    rows: dict[str, dict[str, _KeyRow]] = defaultdict(dict)
    columns = ", ".join(f"s.{name}" for name in _STORED)
    for row in conn.execute(
        f"SELECT {columns}, k.rpm, k.tpm FROM limit_shares s JOIN api_keys k "
        "ON k.id = s.key_id WHERE k.revoked_at IS NULL"
    ):
        key_row = _KeyRow.of(row)
        rows[key_row.key_id][key_row.pop] = key_row
    gone: set[str] = set()
    for row in conn.execute(
        f"SELECT {', '.join(_STORED)} FROM limit_shares WHERE key_id LIKE ?", (_IS_MODEL_ENTRY,)
    ):
        limits = model_limits.get(row["key_id"])
        if limits is None:
            gone.add(row["key_id"])
            continue
        key_row = _KeyRow.of({**row, "rpm": limits[0], "tpm": limits[1]})
        rows[key_row.key_id][key_row.pop] = key_row
    conn.executemany("DELETE FROM limit_shares WHERE key_id = ?", [(entry,) for entry in gone])
    return rows


def _limits_of(conn: Connection, key_ids: list[str], model_limits: Limits) -> Limits:
    """The limits of each active entry among `key_ids`."""
    limits = {entry: model_limits[entry] for entry in key_ids if entry in model_limits}
    overall = [key_id for key_id in key_ids if MODEL_SEPARATOR not in key_id]
    if not overall:
        return limits
    marks = ", ".join("?" for _ in overall)
    for row in conn.execute(
        f"SELECT id, rpm, tpm FROM api_keys WHERE revoked_at IS NULL AND id IN ({marks})",
        overall,
    ):
        limits[row["id"]] = (int(row["rpm"]), int(row["tpm"]))
    return limits


def _record_uses(
    conn: Connection,
    report: UsageReport,
    rows: dict[str, dict[str, _KeyRow]],
    model_limits: Limits,
    now: float,
    half_life_s: float,
) -> set[str]:
    """Fold the report into `rows` (demand, need, levels): the entries it changed. Unknown and
    revoked keys (and model limits no longer set) are skipped."""
    limits = _limits_of(conn, [use.key_id for use in report.keys], model_limits)
    for use in report.keys:
        if use.key_id not in limits:
            continue
        row = rows[use.key_id].get(report.pop)
        if row is None:
            rpm, tpm = limits[use.key_id]
            row = _KeyRow(use.key_id, report.pop, rpm, tpm, None, 0.0, now, 0.0, now)
            rows[use.key_id][report.pop] = row
        _fold(row, use, now, half_life_s)
    return set(limits)


def _fold(row: _KeyRow, use: KeyUse, now: float, half_life_s: float) -> None:
    asked = demand_of(use.num_requests, use.num_tokens, row.rpm, row.tpm)
    row.demand = decayed(row.demand, now - row.demand_at, half_life_s) + asked
    row.demand_at = now
    if use.largest_refused_tokens is not None:
        need = need_of(use.largest_refused_tokens, row.rpm, row.tpm)
        held = row.need if now - row.need_at < NEED_HOLD_S else 0.0
        row.need, row.need_at = max(need, held), now
    row.request_level, row.token_level, row.levels_at = use.request_level, use.token_level, now


def _save(conn: Connection, row: _KeyRow) -> None:
    marks = ", ".join("?" for _ in _STORED)
    updates = ", ".join(f"{name} = excluded.{name}" for name in _STORED[2:])
    conn.execute(
        f"INSERT INTO limit_shares ({', '.join(_STORED)}) VALUES ({marks}) "
        f"ON CONFLICT (key_id, pop) DO UPDATE SET {updates}",
        [getattr(row, name) for name in _STORED],
    )
