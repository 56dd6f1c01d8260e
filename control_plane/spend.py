"""What each key spent, per model and period (table `key_spend`): recorded from the gateways'
usage reports, answered to them per key with a budget, and read back for operators
(`GET /v1/keys/{id}/spend`, `meridian status`).

A key's period is its budget's (`budget_period_s`), or a UTC day for a key without a budget;
tokens count in the period holding the moment the control plane hears of them. Changing a key's
period starts counting anew: spend recorded under the old period's starts counts only where
such a start falls inside the new current period.

A report's spend counts once: each gateway process (`UsageReport.reporter`, a PoP may run
several) sends its batches one at a time, the unanswered one again until answered, so a batch
equal to the last one applied from the same process is a resend (table `spend_reporters`).

Rows of periods that ended before a key's previous one are deleted (`prune_spend`, from the
usage reports' transaction, at most once per `PRUNE_INTERVAL_S`): nothing reads them, and the
table would otherwise grow by every key's models each period for ever; so are the last batches
of processes not heard from in `REPORTER_RETENTION_S`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Final

from control_plane.key_schemas import KeySpend
from control_plane.store.base import Connection, get_meta, set_meta
from wire.key_snapshot import DEFAULT_SPEND_PERIOD_S, period_start
from wire.limit_shares import KeySpent, UsageReport


def _period_of(budget_period_s: int | None) -> int:
    return budget_period_s or DEFAULT_SPEND_PERIOD_S


def record_spend(conn: Connection, report: UsageReport, now: float) -> None:
    """Add the report's spend, unless its batch is the last one applied from the process that
    sent it (a report sent again after its answer was lost). Unknown and revoked keys are
    skipped."""
    if not report.spend or report.spend_batch is None:
        return
    sender = (report.pop, report.reporter or "")  # a gateway that names no process: its PoP
    row = conn.execute(
        "SELECT spend_batch FROM spend_reporters WHERE pop = ? AND reporter = ?", sender
    ).fetchone()
    if row is not None and row["spend_batch"] == report.spend_batch:
        return
    conn.execute(
        "INSERT INTO spend_reporters (pop, reporter, spend_batch, applied_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (pop, reporter) DO UPDATE "
        "SET spend_batch = excluded.spend_batch, applied_at = excluded.applied_at",
        (*sender, report.spend_batch, now),
    )
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for spend in report.spend:
        totals[spend.key_id, spend.model] += spend.num_tokens
    periods = _periods_of(conn, {key_id for key_id, _ in totals})
    conn.executemany(
        "INSERT INTO key_spend (key_id, model, period_start, tokens) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (key_id, period_start, model) DO UPDATE "
        "SET tokens = key_spend.tokens + excluded.tokens",
        [
            (key_id, model, period_start(now, periods[key_id]), tokens)
            for (key_id, model), tokens in totals.items()
            if key_id in periods and tokens > 0
        ],
    )


PRUNE_INTERVAL_S: Final = 3600
PRUNED_ROW: Final = "key_spend_pruned"  # meta: the last PRUNE_INTERVAL_S slot pruned in
# A process that has not had a batch applied for this long is forgotten: a row per process start,
# and a batch held unanswered for longer (its control plane out of reach a week) counts again.
REPORTER_RETENTION_S: Final = 7 * 86_400


def prune_spend(conn: Connection, now: float) -> int:
    """Delete the spend of periods that ended before each key's previous one (its current and
    previous periods stay, per model) and the batches of processes long gone, unless that was
    done in this `PRUNE_INTERVAL_S` slot already. Returns the spend rows deleted."""
    slot = str(int(now // PRUNE_INTERVAL_S))
    if get_meta(conn, PRUNED_ROW) == slot:
        return 0
    set_meta(conn, PRUNED_ROW, slot)
    conn.execute("DELETE FROM spend_reporters WHERE applied_at < ?", (now - REPORTER_RETENTION_S,))
    num_deleted = 0
    periods = conn.execute(
        "SELECT DISTINCT COALESCE(budget_period_s, ?) AS period_s FROM api_keys",
        (DEFAULT_SPEND_PERIOD_S,),
    )
    for row in periods.fetchall():
        period_s = int(row["period_s"])
        kept_from = period_start(now, period_s) - period_s  # the previous period's start
        deleted = conn.execute(
            "DELETE FROM key_spend WHERE period_start < ? AND key_id IN "
            "(SELECT id FROM api_keys WHERE COALESCE(budget_period_s, ?) = ?)",
            (kept_from, DEFAULT_SPEND_PERIOD_S, period_s),
        )
        num_deleted += max(0, deleted.rowcount)
    return num_deleted


def _periods_of(conn: Connection, key_ids: Iterable[str]) -> dict[str, int]:
    """The spend period of each active key among `key_ids`."""
    ids = list(key_ids)
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    return {
        row["id"]: _period_of(row["budget_period_s"])
        for row in conn.execute(
            "SELECT id, budget_period_s FROM api_keys "
            f"WHERE revoked_at IS NULL AND id IN ({marks})",
            ids,
        )
    }


def budgets_spent(conn: Connection, now: float) -> list[KeySpent]:
    """What each active key with a budget spent in its current period (those that spent)."""
    starts = {
        row["id"]: period_start(now, row["budget_period_s"])
        for row in conn.execute(
            "SELECT id, budget_period_s FROM api_keys "
            "WHERE revoked_at IS NULL AND max_budget_tokens IS NOT NULL"
        )
    }
    if not starts:
        return []
    spent: dict[str, int] = defaultdict(int)
    for row in conn.execute(
        "SELECT key_id, period_start, SUM(tokens) AS tokens FROM key_spend "
        "WHERE period_start >= ? GROUP BY key_id, period_start",
        (min(starts.values()),),
    ):
        start = starts.get(row["key_id"])
        if start is not None and row["period_start"] >= start:
            spent[row["key_id"]] += int(row["tokens"])
    return [
        KeySpent(key_id=key_id, period_start=starts[key_id], spent_tokens=tokens)
        for key_id, tokens in sorted(spent.items())
    ]


def spend_of(
    conn: Connection,
    key_id: str,
    max_budget_tokens: int | None,
    budget_period_s: int | None,
    now: float,
) -> KeySpend:
    """One key's spend in its current period, per model."""
    period_s = _period_of(budget_period_s)
    start = period_start(now, period_s)
    models = {
        row["model"]: int(row["tokens"])
        for row in conn.execute(
            "SELECT model, SUM(tokens) AS tokens FROM key_spend WHERE key_id = ? "
            "AND period_start >= ? AND period_start < ? GROUP BY model ORDER BY model",
            (key_id, start, start + period_s),
        )
    }
    spent = sum(models.values())
    remaining = None if max_budget_tokens is None else max(0, max_budget_tokens - spent)
    return KeySpend(
        key=key_id,
        period_start=start,
        period_end=start + period_s,
        budget_period=period_s,
        max_budget_tokens=max_budget_tokens,
        spent_tokens=spent,
        remaining_tokens=remaining,
        models=models,
    )
