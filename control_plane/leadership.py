"""Which control plane does the work that must run once: drain sequences and their writes.

With SQLite there is one control plane, `SoleLeader`, which always leads. Replicas on PostgreSQL
elect one with `control_plane.leader_lease.LeaderLease`; the others follow what it writes.
"""

from __future__ import annotations

from typing import Protocol


class Leadership(Protocol):
    @property
    def is_leader(self) -> bool: ...

    @property
    def epoch(self) -> int | None:
        """The lease's epoch while leading (its writes carry it); None for a sole leader."""
        ...


class SoleLeader:
    """One control plane on its own database: it always leads."""

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def epoch(self) -> int | None:
        return None
