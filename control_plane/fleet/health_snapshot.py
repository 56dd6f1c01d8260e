"""The fleet's last known health, kept in the store so that a restart does not empty the fleet,
and so that replicas share the beats each of them receives.

Health is judged from heartbeats, which live in memory; a restarted control plane would count
every node unhealthy until it beats again (node agents that lost us back off, up to 30 s), and
gateways would answer `no_capacity` meanwhile. So every `save_every_s` (and once more at a stop)
the beats this control plane received since its last save are written (`Registry.save_health`;
the newest beat of each node is kept, table `node_health`), and at start the nodes that were
beating at the last save are restored as healthy, with that beat's capacity, for a grace period
(`restart_grace_s`): each stays healthy if it beats within it, and is judged by the usual rule
from then on. Replicas on PostgreSQL read each other's saves as they commit (`Registry.follow`).
"""

from __future__ import annotations

import asyncio

from control_plane.fleet.registry import Registry
from control_plane.fleet.sql import SavedBeats
from control_plane.model import Fleet

SAVE_EVERY_S = 1.0
# How soon the other replicas learn of a beat: a capacity change reaches their summaries and
# xDS about half of this later (they read only what each save wrote, and publish at once).
SAVE_EVERY_S_REPLICAS = 0.1


def restore(saved: SavedBeats, fleet: Fleet, grace_s: float, now_mono: float) -> int:
    """Mark the saved nodes healthy until `grace_s` from now; returns how many."""
    if grace_s <= 0 or not saved:
        return 0
    # Beating at the last save: heard from within the heartbeat limit of the newest saved beat.
    newest = max(seen_at for _, _, seen_at in saved)
    num_restored = 0
    for node_id, beat, seen_at in saved:
        if seen_at < newest - fleet.unhealthy_after_s:
            continue
        node = fleet.nodes.get(node_id)
        if node is None or not node.is_from_heartbeats:
            continue
        node.last_beat = beat
        node.last_seen_unix = seen_at
        # The sweep judges silence from `last_seen_mono`: this makes it unhealthy `grace_s`
        # from now, unless it beats before.
        node.last_seen_mono = now_mono + grace_s - fleet.unhealthy_after_s
        node.is_beating = True
        num_restored += 1
    return num_restored


async def save_forever(registry: Registry, save_every_s: float) -> None:
    """Save every `save_every_s`, until cancelled."""
    while True:
        await asyncio.sleep(save_every_s)
        await registry.save_health()
