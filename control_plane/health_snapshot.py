"""The fleet's last known health, kept in the store so that a restart does not empty the fleet.

Health is judged from heartbeats, which live in memory; a restarted control plane would count
every node unhealthy until it beats again (node agents that lost us back off, up to 30 s), and
gateways would answer `no_capacity` meanwhile. So every `SAVE_INTERVAL_S` (and once more at a
stop) the nodes that are beating are saved with their latest beat, and at start each of them is
restored as healthy, with that beat's capacity, for a grace period (`restart_grace_s`): it stays
healthy if it beats within it, and is judged by the usual rule from then on.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from control_plane.fleet import Fleet
from control_plane.store import Store, StoreBusyError
from wire.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

SAVE_INTERVAL_S = 1.0

SavedBeats = list[tuple[str, Heartbeat, float]]  # node id, its latest beat, when it arrived


def beating_nodes(fleet: Fleet) -> SavedBeats:
    """What to save, picked on the event loop (the fleet's owner). Beats are immutable, so the
    worker thread that writes them may encode them (a thousand take ~9 ms: not on the loop)."""
    return [
        (node.node_id, node.last_beat, node.last_seen_unix)
        for node in fleet.nodes.values()
        if node.is_beating and node.last_beat is not None and node.last_seen_unix is not None
    ]


def write(conn: sqlite3.Connection, saved: SavedBeats) -> None:
    conn.execute("DELETE FROM node_health")
    conn.executemany(
        "INSERT INTO node_health (node_id, beat, seen_at) VALUES (?, ?, ?)",
        [(node_id, beat.model_dump_json(), seen_at) for node_id, beat, seen_at in saved],
    )


def restore(conn: sqlite3.Connection, fleet: Fleet, grace_s: float, now_mono: float) -> int:
    """Mark the saved nodes healthy until `grace_s` from now; returns how many."""
    if grace_s <= 0:
        return 0
    num_restored = 0
    for row in conn.execute("SELECT node_id, beat, seen_at FROM node_health"):
        node = fleet.nodes.get(row["node_id"])
        if node is None or not node.is_from_heartbeats:
            continue
        node.last_beat = Heartbeat.model_validate_json(row["beat"])
        node.last_seen_unix = row["seen_at"]
        # The sweep judges silence from `last_seen_mono`: this makes it unhealthy `grace_s`
        # from now, unless it beats before.
        node.last_seen_mono = now_mono + grace_s - fleet.unhealthy_after_s
        node.is_beating = True
        num_restored += 1
    return num_restored


async def save(store: Store, fleet: Fleet) -> None:
    saved = beating_nodes(fleet)
    try:
        await store.write(lambda conn: write(conn, saved))
    except StoreBusyError:
        logger.warning("could not save the fleet's health: the database is busy")


async def save_forever(store: Store, fleet: Fleet) -> None:
    """Save every SAVE_INTERVAL_S, until cancelled."""
    while True:
        await asyncio.sleep(SAVE_INTERVAL_S)
        await save(store, fleet)
