"""Replicas on one PostgreSQL database hear of each other's changes (LISTEN/NOTIFY).

Every write names the kinds of state it changed, and on PostgreSQL each kind is announced on the
channel `meridian_changes` when the write commits (`control_plane.store_postgres`), signed with
the writer's replica id. `follow_changes` listens on a connection of its own; the kinds announced
by other replicas are gathered for `COALESCE_S` and then read back from the store: fleet state
(regions, nodes, drains, the beats other replicas received) by the registry, keys, the routing
policy and node credentials by their owners. Each replica then publishes its summaries and xDS
as for a change of its own. Once listening (at start, and after the connection was lost and is
back) everything is read again: a notification sent before was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

import psycopg

from control_plane import keys as key_store
from control_plane.node_credentials import load_credentials
from control_plane.routing import load_policy
from control_plane.services import ControlPlane
from control_plane.store_postgres import CHANNEL

logger = logging.getLogger(__name__)

COALESCE_S: Final = 0.02  # a write announces several kinds at once: read them back together
RECONNECT_S: Final = 1.0
FLEET_KINDS: Final = frozenset({"regions", "nodes", "drains", "beats"})
ALL_KINDS: Final = FLEET_KINDS | {"keys", "routing", "credentials"}


async def apply_changes(services: ControlPlane, kinds: set[str]) -> None:
    """Memory follows the store for `kinds` changed by another replica."""
    if kinds & FLEET_KINDS:
        await services.registry.follow(kinds & FLEET_KINDS)
    if kinds & {"keys", "routing", "credentials"}:
        index, policy, credentials = await services.store.read(
            lambda conn: (
                key_store.read_index(conn),
                load_policy(conn),
                load_credentials(conn),
            )
        )
        if "keys" in kinds:
            services.keys.follow(index)
        if "routing" in kinds:
            services.routing.follow(policy)
        if "credentials" in kinds:
            services.registry.credentials.reset(credentials)


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
            await apply_changes(services, set(ALL_KINDS))
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
    while True:
        pending: set[str] = set()
        async for notify in conn.notifies(stop_after=1):  # wait for the first ...
            _note(pending, notify.payload, replica_id)
        async for notify in conn.notifies(timeout=COALESCE_S):  # ... and what comes with it
            _note(pending, notify.payload, replica_id)
        if pending:
            try:
                await apply_changes(services, pending)
            except Exception:  # the next change reads everything of its kinds again
                logger.exception("could not follow another replica's change (%s)", pending)


def _note(pending: set[str], payload: str, replica_id: str) -> None:
    kind, _, origin = payload.partition(" ")
    if origin != replica_id and kind in ALL_KINDS:
        pending.add(kind)
