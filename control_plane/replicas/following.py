"""Replicas on one PostgreSQL database hear of each other's changes (LISTEN/NOTIFY).

Every write names the kinds of state it changed, and on PostgreSQL each kind is announced on the
channel `meridian_changes` when the write commits (`control_plane.store.postgres`), signed with the
writer's replica id. `follow_changes` listens on a connection of its own; the kinds announced by
other replicas are gathered for `COALESCE_S` and then read back from the store, each kind alone:
fleet state (regions, nodes, drains, the beats other replicas received) by the registry, keys, the
routing policy, the model catalog and node credentials by their owners, the replicas' reports on
their Envoys (`control_plane.drain.envoy_reports`) by the drain book, and a change of Envoys' xDS
credentials by the xDS server (it closes the streams whose credential was replaced or deleted). Each
replica then publishes its summaries and xDS as for a change of its own. A health save announces
`beats=<t>`, `t` the oldest beat it wrote, so that only the rows from `t` on are read back (the
beats are an incremental feed: a save commits hundreds of them ten times a second); a mint or a
registration announces `credentials=<node id>,...`, so that only those credentials are read back
(registering 1,000 nodes one by one would otherwise read the whole table 1,000 times). Once
listening (at start, and after the connection was lost and is back) everything is read again: a
notification sent before was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Final

import psycopg

from control_plane import keys as key_store
from control_plane.catalog import registry as catalog_registry
from control_plane.drain import envoy_reports
from control_plane.services import ControlPlane
from control_plane.store.postgres import CHANNEL
from control_plane.xds import credentials as xds_credentials

logger = logging.getLogger(__name__)

COALESCE_S: Final = 0.005  # a write announces its kinds together, on commit: read them back at once
RECONNECT_S: Final = 1.0
FLEET_KINDS: Final = frozenset({"regions", "nodes", "drains", "beats"})
ALL_KINDS: Final = FLEET_KINDS | {
    "keys",
    "routing",
    catalog_registry.KIND,
    "credentials",
    envoy_reports.KIND,
    xds_credentials.KIND,
}


@dataclass(slots=True)
class Notices:
    """What other replicas announced since the last read: the kinds, the oldest beat any of
    their health saves wrote (0.0: read every saved beat, as after a reconnect, or for a save
    that names none), and the nodes whose credentials changed (None: read them all)."""

    kinds: set[str] = field(default_factory=set)
    beats_since: float = math.inf
    credential_ids: set[str] | None = field(default_factory=set)

    def note(self, payload: str, replica_id: str) -> None:
        kind, _, origin = payload.partition(" ")
        kind, _, detail = kind.partition("=")
        if origin == replica_id or kind not in ALL_KINDS:
            return
        self.kinds.add(kind)
        if kind == "beats":
            self.beats_since = min(self.beats_since, _seconds(detail))
        elif kind == "credentials" and self.credential_ids is not None:
            names = [name for name in detail.split(",") if name]
            self.credential_ids = self.credential_ids.union(names) if names else None


def _seconds(text: str) -> float:
    """A save's oldest beat; 0.0 (read them all) for none, or for anything but a finite number."""
    try:
        seconds = float(text)
    except ValueError:
        return 0.0
    return seconds if math.isfinite(seconds) else 0.0


def everything() -> Notices:
    return Notices(set(ALL_KINDS), beats_since=0.0, credential_ids=None)


async def apply_changes(services: ControlPlane, notices: Notices) -> None:
    """Memory follows the store for the kinds another replica changed; each kind is read only
    when it was named (a key minted elsewhere must not cost a read of every node credential)."""
    kinds = notices.kinds
    if kinds & FLEET_KINDS:
        await services.registry.follow(kinds & FLEET_KINDS, notices.beats_since)
    if "keys" in kinds:
        services.keys.follow(await services.store.read(key_store.read_index))
    if "routing" in kinds:
        await services.routing.follow()
    if catalog_registry.KIND in kinds:
        await services.catalog.follow()
    if "credentials" in kinds:
        await services.credentials.follow(notices.credential_ids)
    if envoy_reports.KIND in kinds:
        own_id = services.settings.replica_id
        reports = await services.store.read(partial(envoy_reports.load_reports, own_id))
        services.peer_envoys.follow(reports)
    if xds_credentials.KIND in kinds and services.xds is not None:
        await services.xds.recheck()


async def follow_changes(services: ControlPlane, url: str, replica_id: str) -> None:
    """Until cancelled: apply what other replicas change, as they commit it."""
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        except (psycopg.Error, OSError) as exc:
            logger.warning("cannot listen for other replicas' changes: %s", exc)
            await asyncio.sleep(RECONNECT_S)
            continue
        try:
            await conn.execute(f"LISTEN {CHANNEL}")
            # What committed before we listened (since the start's load, or while the
            # connection was down) was announced to nobody here: read everything once.
            await apply_changes(services, everything())
            await _listen(services, conn, replica_id)
        except (psycopg.Error, OSError) as exc:
            logger.warning("lost the connection that listens for other replicas: %s", exc)
            await asyncio.sleep(RECONNECT_S)
        finally:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()


async def _listen(
    services: ControlPlane, conn: psycopg.AsyncConnection[tuple[object, ...]], replica_id: str
) -> None:
    pending = Notices()  # kept across a failed read: read again, all of it, with the next change
    while True:
        async for notify in conn.notifies(stop_after=1):  # wait for the first ...
            pending.note(notify.payload, replica_id)
        async for notify in conn.notifies(timeout=COALESCE_S):  # ... and what comes with it
            pending.note(notify.payload, replica_id)
        if pending.kinds:
            try:
                await apply_changes(services, pending)
                pending = Notices()
            except Exception:
                logger.exception("could not follow another replica's change (%s)", pending.kinds)
