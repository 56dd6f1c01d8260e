"""Which nodes' cache event streams broke: a node whose stream ends without the control plane
having dropped it is most likely dead (its agent's socket closed with it), and is held out of the
picker's choices at once, rather than after the missed heartbeats that the control plane waits
for. A node that streams again is back; one whose stream stays away is picked again after
`hold_out_s` (longer than the control plane takes to drop a dead node), its cache then guessed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

# The control plane drops a node after 3 missed 1 s beats (its heartbeat_interval_s x
# missed_beats); a live node's stream reconnects within its backoff's first steps.
DEFAULT_HOLD_OUT_S: Final = 10.0


@dataclass(slots=True)
class NodeStreams:
    hold_out_s: float = DEFAULT_HOLD_OUT_S
    clock: Callable[[], float] = time.monotonic
    _lost_at: dict[str, float] = field(default_factory=dict)

    def opened(self, node_id: str) -> None:
        """The node streams (again): it has sent a snapshot."""
        self._lost_at.pop(node_id, None)

    def lost(self, node_id: str) -> None:
        """The node's current stream ended."""
        self._lost_at[node_id] = self.clock()

    def forget(self, node_id: str) -> None:
        """The control plane no longer lists the node."""
        self._lost_at.pop(node_id, None)

    def is_held_out(self, node_id: str) -> bool:
        lost_at = self._lost_at.get(node_id)
        return lost_at is not None and self.clock() - lost_at < self.hold_out_s
