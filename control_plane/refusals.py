"""Refused calls (401, 403, and refused xDS streams), in the log and the audit log, at a bounded
rate.

Every refusal of a credential is worth knowing about (a scan with guessed tokens, a node beating
for another node's region, an Envoy with a stolen token), but one client can make thousands a
second. So a refusal is written (a WARNING line and an `auth.refused` audit entry) only while its
client address has had fewer than `max_per_address` recorded in the current window (a minute),
and the whole control plane fewer than `max_total`; the others are counted, and when the window
ends one `auth.suppressed` entry says how many were left out, from how many addresses, and the
busiest few. The store thus takes at most `max_total` + 1 entries a minute however fast refusals
come, from however many addresses. Writing never changes the answer: a refusal whose entry cannot
be written (the database is busy) is still refused, and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from control_plane import audit
from control_plane.audit import Actor
from control_plane.store.base import Connection, Store

logger = logging.getLogger(__name__)

WINDOW_S: Final = 60.0
# Addresses counted one by one within a window; beyond, a flood from many addresses is counted
# under one name, so memory stays bounded too.
MAX_TRACKED_ADDRESSES: Final = 10_000
OTHER_ADDRESSES: Final = "other addresses"
NUM_TOP_ADDRESSES: Final = 5
MAX_TEXT_CHARS: Final = 300
SUPPRESSED_ACTOR: Final = Actor(kind="control_plane", client="refusal audit")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused call."""

    address: str  # the client's IP: what the rate is counted by
    actor: Actor  # the kind of credential presented ("anonymous": none valid) and the client
    status: int  # 401 or 403 (xDS: the HTTP status of its gRPC code)
    code: str
    target: str  # "POST /v1/nodes/heartbeat", or "xds"
    message: str


@dataclass(frozen=True, slots=True)
class RefusalLimits:
    max_per_address: int  # refusals written per address per window
    max_total: int  # ... and for all addresses together
    window_s: float = WINDOW_S


@dataclass(frozen=True, slots=True)
class Suppressed:
    """The refusals a window left out."""

    num_suppressed: int
    num_addresses: int
    top: tuple[tuple[str, int], ...]  # the busiest addresses, most first

    def detail(self, window_s: float) -> audit.AuditDetail:
        return {
            "num_suppressed": self.num_suppressed,
            "num_addresses": self.num_addresses,
            "top_addresses": ", ".join(f"{address} ({n})" for address, n in self.top),
            "window_s": window_s,
        }


@dataclass(slots=True)
class RefusalCounter:
    """Which refusals are written, and how many were not: plain values, any clock."""

    limits: RefusalLimits
    window_started_at: float | None = None
    num_recorded: int = 0
    recorded_by_address: Counter[str] = field(default_factory=Counter)
    suppressed_by_address: Counter[str] = field(default_factory=Counter)

    def note(self, address: str, now: float) -> tuple[bool, Suppressed | None]:
        """Whether to write a refusal from `address` now, and the summary of a window that has
        just ended with refusals left out."""
        ended = self.tick(now)
        if self.window_started_at is None:
            self.window_started_at = now
        limits = self.limits
        is_recorded = (
            self.num_recorded < limits.max_total
            and self.recorded_by_address[address] < limits.max_per_address
        )
        if is_recorded:
            self.num_recorded += 1
            self.recorded_by_address[address] += 1
        else:
            self._count_suppressed(address)
        return is_recorded, ended

    def tick(self, now: float) -> Suppressed | None:
        """End the window if its time is up; the summary of what it left out, if anything."""
        started = self.window_started_at
        if started is None or now - started < self.limits.window_s:
            return None
        suppressed = self.suppressed_by_address
        ended = None
        if suppressed:
            ended = Suppressed(
                num_suppressed=sum(suppressed.values()),
                num_addresses=len(suppressed),
                top=tuple(suppressed.most_common(NUM_TOP_ADDRESSES)),
            )
        self.window_started_at = None
        self.num_recorded = 0
        self.recorded_by_address = Counter()
        self.suppressed_by_address = Counter()
        return ended

    def _count_suppressed(self, address: str) -> None:
        counted = self.suppressed_by_address
        is_tracked = address in counted or len(counted) < MAX_TRACKED_ADDRESSES
        counted[address if is_tracked else OTHER_ADDRESSES] += 1


def printable(text: str) -> str:
    """Caller-chosen text (a path, a User-Agent) as one safe line: escapes for anything not
    printable, cut to MAX_TEXT_CHARS."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text[:MAX_TEXT_CHARS]


class RefusalAudit:
    """Writes refusals as `RefusalCounter` allows; `run` closes windows when refusals stop."""

    def __init__(
        self, store: Store, limits: RefusalLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._counter = RefusalCounter(limits)
        self._window_s = limits.window_s
        self._clock = clock

    async def record(self, refusal: Refusal) -> None:
        is_recorded, ended = self._counter.note(refusal.address, self._clock())
        if ended is not None:
            await self._write_suppressed(ended)
        if not is_recorded:
            return
        logger.warning(
            "refused %s from %s (%s): %d %s: %s",
            refusal.target,
            refusal.actor.client,
            refusal.actor.kind,
            refusal.status,
            refusal.code,
            refusal.message,
        )
        detail: audit.AuditDetail = {
            "status": refusal.status,
            "code": refusal.code,
            "message": refusal.message,
        }
        await self._write(refusal.actor, "auth.refused", refusal.target, detail)

    async def run(self) -> None:
        """Until cancelled: write the summary of a window that ended with no refusal after it."""
        while True:
            await asyncio.sleep(self._window_s / 4)
            ended = self._counter.tick(self._clock())
            if ended is not None:
                await self._write_suppressed(ended)

    async def _write_suppressed(self, ended: Suppressed) -> None:
        detail = ended.detail(self._window_s)
        logger.warning(
            "%d more refusals in the last %.0f s not recorded one by one (%d addresses: %s)",
            ended.num_suppressed,
            self._window_s,
            ended.num_addresses,
            detail["top_addresses"],
        )
        await self._write(SUPPRESSED_ACTOR, "auth.suppressed", "refusals", detail)

    async def _write(
        self, actor: Actor, action: str, target: str, detail: audit.AuditDetail
    ) -> None:
        def change(conn: Connection) -> None:
            audit.record(conn, actor, action, target, detail)

        try:
            await self._store.write(change)
        except Exception as exc:  # the refusal stands; only its entry is lost
            logger.warning("could not write the audit entry of a refusal: %s", exc)
