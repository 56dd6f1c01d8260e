"""A control plane given as its replicas' URLs (`--control-plane URL[,URL...]`): clients fail over.

Every replica serves the same API, so a client that cannot reach one (a refused connection, a
timeout, a 5xx) tries the next at once, in the order given, and stays with the one that answered
until it fails in turn. Node agents (heartbeats), gateways (their watches), the admin CLI and
`meridian` share this one helper; an answer of another kind (401, 403, 404, 409...) is the
control plane's answer, not a reason to try another replica.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

_HTTP_URL = re.compile(r"^https?://[^\s/,]+(/[^\s,]*)?$")


def is_retryable_status(status_code: int) -> bool:
    """A status on which another replica may do better (this one is stopping, or overloaded)."""
    return status_code >= 500


class ControlPlaneUrls:
    def __init__(self, urls: Sequence[str]) -> None:
        cleaned = [url.strip().rstrip("/") for url in urls]
        if not cleaned or not all(cleaned):
            raise ValueError("give at least one control plane URL")
        for url in cleaned:
            if not _HTTP_URL.match(url):
                raise ValueError(f"not an http(s):// URL: {url!r}")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("a control plane URL is listed twice")
        self.urls = tuple(cleaned)
        self._current = 0

    @classmethod
    def parse(cls, text: str) -> ControlPlaneUrls:
        """`http://a:8080,http://b:8080` (one URL is a list of one)."""
        return cls(text.split(","))

    def __len__(self) -> int:
        return len(self.urls)

    def __str__(self) -> str:
        return ",".join(self.urls)

    @property
    def current(self) -> str:
        """The URL that answered last (the first one, until one fails)."""
        return self.urls[self._current]

    def in_turn(self) -> Iterator[str]:
        """Every URL once, the current one first: try each until one answers, then `settle`."""
        for offset in range(len(self.urls)):
            yield self.urls[(self._current + offset) % len(self.urls)]

    def settle(self, url: str) -> None:
        """`url` answered: start from it next time."""
        self._current = self.urls.index(url)

    def rotate(self) -> str:
        """The current URL failed: move to the next one, and return it."""
        self._current = (self._current + 1) % len(self.urls)
        return self.current
