"""Gateway PoPs report what was asked of them per key and get their shares of each key's limits
(`control_plane/limit_reports.py`)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.auth import GatewayAuth
from control_plane.errors import ERROR_RESPONSES
from control_plane.limit_reports import LimitLedger
from control_plane.services import ServicesDep
from wire.limit_shares import ShareAnswer, UsageReport

router = APIRouter(prefix="/v1/limits", tags=["limits"], responses=ERROR_RESPONSES)


@router.post("/report")
async def report_usage(
    actor: GatewayAuth, services: ServicesDep, report: UsageReport
) -> ShareAnswer:
    """One PoP's usage since its last report; the answer is its share of every key (and, if it
    asks, its buckets' last known levels)."""
    ledger = LimitLedger(services.store, services.settings.limit_shares)
    return await ledger.report(report)
