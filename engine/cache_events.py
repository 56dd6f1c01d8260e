"""What entered and left the prefix cache, for whoever mirrors it (the node agent, for its region's
picker).

A full block entering the cache is "stored" under its hash (engine/kv_cache_manager.py's chain,
salted per tenant); a hash dropped (its block reused for other tokens, or the cache reset) is
"removed". The KV cache manager records them only once someone watches; the engine core hands
them over once per turn of its loop, netted: a hash stored and removed again within one turn
appears in neither list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """One turn's changes, or (`is_snapshot`) every hash the cache holds now in `stored`."""

    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...] = ()
    is_snapshot: bool = False


class CacheEventRecorder:
    """Nets the changes between two `take` calls. A hash's changes alternate (the cache stores
    only a hash it does not hold and drops only one it holds), so two in a row cancel."""

    def __init__(self) -> None:
        # hash -> whether the cache holds it now; present only if that differs from the last take
        self._changes: dict[bytes, bool] = {}

    def stored(self, block_hash: bytes) -> None:
        self._change(block_hash, True)

    def removed(self, block_hash: bytes) -> None:
        self._change(block_hash, False)

    def take(self) -> CacheEvents | None:
        """The changes since the last take (None: none)."""
        if not self._changes:
            return None
        changes, self._changes = self._changes, {}
        return CacheEvents(
            tuple(h for h, held in changes.items() if held),
            tuple(h for h, held in changes.items() if not held),
        )

    def _change(self, block_hash: bytes, held: bool) -> None:
        if self._changes.get(block_hash) is (not held):
            del self._changes[block_hash]  # back to what the last take saw
        else:
            self._changes[block_hash] = held
