"""The prefix keys this node served lately, for its heartbeats (wire/prefix_key.py).

The gateway names each chat's system prompt by its key; a node that served one within
`max_age_s` most likely still holds its blocks (the prefix cache drops the least recently used
first), so it reports the key and the region's summary counts it. Bounded: the `max_keys` most
recent, and a beat carries the MAX_HOT_PREFIXES most recent of those, sorted, so that an
unchanged set of keys leaves the summary unchanged.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from wire.prefix_key import MAX_HOT_PREFIXES, is_prefix_key

DEFAULT_MAX_AGE_S = 300.0


class HotPrefixes:
    def __init__(
        self,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_keys: int = MAX_HOT_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_keys < 1 or max_keys > MAX_HOT_PREFIXES:
            raise ValueError(f"max_keys must be within 1..{MAX_HOT_PREFIXES}")
        self._max_age_s = max_age_s
        self._max_keys = max_keys
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # key -> last served, oldest first

    def seen(self, key: str | None) -> None:
        """A request with `key` (the header's value; not a key: ignored) is being served."""
        if not is_prefix_key(key):
            return
        assert key is not None
        self._seen[key] = self._clock()
        self._seen.move_to_end(key)
        while len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)

    def hot(self) -> tuple[str, ...]:
        """The keys served within the last `max_age_s`, sorted."""
        oldest_s = self._clock() - self._max_age_s
        while self._seen:
            key, at_s = next(iter(self._seen.items()))
            if at_s >= oldest_s:
                break
            del self._seen[key]
        return tuple(sorted(self._seen))
