"""The current snapshot of each Envoy group, and the streams waiting for it to change."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from control_plane.xds.groups import EnvoyGroup
from control_plane.xds.snapshot import Snapshot


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshots: dict[EnvoyGroup, Snapshot] = {}
        self._watchers: defaultdict[EnvoyGroup, set[asyncio.Event]] = defaultdict(set)

    def get(self, group: EnvoyGroup) -> Snapshot | None:
        return self._snapshots.get(group)

    def items(self) -> list[tuple[EnvoyGroup, Snapshot]]:
        return list(self._snapshots.items())

    def set_snapshot(self, group: EnvoyGroup, snapshot: Snapshot) -> bool:
        """Make `snapshot` current for `group`, unchecked (callers validate; tests inject).

        Wakes the group's streams only if some type's version changed; returns whether one did.
        """
        old = self._snapshots.get(group)
        self._snapshots[group] = snapshot
        if old is not None and old.versions == snapshot.versions:
            return False
        for event in self._watchers.get(group, ()):
            event.set()
        return True

    def watch(self, group: EnvoyGroup, event: asyncio.Event) -> None:
        self._watchers[group].add(event)

    def unwatch(self, group: EnvoyGroup, event: asyncio.Event) -> None:
        """Stop waking `event`; a group nobody watches is forgotten (rebuilt on next connect)."""
        watchers = self._watchers.get(group)
        if watchers is None:
            return
        watchers.discard(event)
        if not watchers:
            del self._watchers[group]
            self._snapshots.pop(group, None)

    def watched_groups(self) -> list[EnvoyGroup]:
        return list(self._watchers)
