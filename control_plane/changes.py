"""Versioned change feeds: an index that only grows, and waiters that block until it moves.

This is the seam between state and its watchers. Gateways' blocking queries wait on a feed; the
xDS server (to come) can wait on the same feed to rebuild its snapshots when the fleet changes.
"""

from __future__ import annotations

import asyncio
import re

WAIT_PATTERN = r"^[0-9]{1,6}(\.[0-9]{1,3})?(ms|s|m)?$"
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "": 1.0}


def parse_wait_s(text: str, max_wait_s: float) -> float:
    """Consul-style duration ("30s", "500ms", "1m", or plain seconds), capped at `max_wait_s`."""
    match = re.fullmatch(r"([0-9.]+)(ms|s|m)?", text)
    if match is None:
        raise ValueError(f"bad duration {text!r}")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2) or ""]
    return min(seconds, max_wait_s)


class ChangeFeed:
    """Consul-style index: `wait_past(n, t)` returns at once unless the index is still n."""

    def __init__(self, initial_index: int) -> None:
        self._index = max(1, initial_index)
        self._changed = asyncio.Event()
        self._is_closed = False

    @property
    def index(self) -> int:
        return self._index

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def advance(self) -> int:
        """Move the index forward by one and wake every waiter."""
        self._index += 1
        self._wake()
        return self._index

    def advance_to(self, index: int) -> None:
        """Adopt an index kept elsewhere (e.g. in the store), if it is ahead of ours."""
        if index > self._index:
            self._index = index
            self._wake()

    def close(self) -> None:
        """Release all waiters now (shutdown); later waits return at once."""
        self._is_closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_past(self, index: int, timeout_s: float) -> int:
        """Wait until the index differs from `index`, at most `timeout_s`; return the index.

        An index of 0 never blocks (a first read). An index ahead of ours (it came from another
        control plane, or from before a restart) is answered at once so the caller resynchronises.
        """
        if index <= 0 or timeout_s <= 0:
            return self._index
        try:
            async with asyncio.timeout(timeout_s):
                while self._index == index and not self._is_closed:
                    await self._changed.wait()
        except TimeoutError:
            pass
        return self._index
