"""Watching a control-plane document with Consul-style blocking queries.

`GET {url}?index=N&wait=30s` answers at once when the document's index differs from N, else when
it changes or the wait ends. The loop applies each new version, keeps the last good one while the
control plane is away (retrying with capped, jittered backoff), and adopts whatever index the
server reports (a restarted control plane may start elsewhere). Given several replicas' URLs
(shared by the gateway's watches), a failed poll moves on to the next one at once; only when
every replica has failed in a row does the loop back off.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from gateway.control_plane_client import CALL_FAILURES, ControlPlaneClient

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
# Room on top of `wait` for the server to answer before the client gives up on a long poll.
WAIT_SLACK_S = 10.0


class Indexed(Protocol):
    @property
    def index(self) -> int: ...


D = TypeVar("D", bound=Indexed)


class Watch(Generic[D]):
    def __init__(
        self,
        client: ControlPlaneClient,
        path: str,
        parse: Callable[[bytes], D],
        apply: Callable[[D], None],
        wait_s: float,
        max_backoff_s: float,
    ) -> None:
        self._client = client
        self._urls = client.urls
        self._path = path
        self._parse = parse
        self._apply = apply
        self._wait_s = wait_s
        self._max_backoff_s = max_backoff_s
        self.index = 0
        self.num_updates = 0
        self.num_failures = 0  # consecutive
        self.loaded = asyncio.Event()

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            try:
                document = await self.poll()
            except CALL_FAILURES as exc:
                await self._fail_over_or_back_off(exc)
                continue
            if self.num_failures:
                logger.info("watch %s is back after %d failures", self._url, self.num_failures)
                self.num_failures = 0
            if document.index != self.index or not self.loaded.is_set():
                self._apply(document)
                self.num_updates += 1
                self.index = document.index
                self.loaded.set()

    @property
    def _url(self) -> str:
        return self._client.url_of(self._path)

    async def poll(self) -> D:
        wait_s = self._wait_s if self.loaded.is_set() else 0.0
        params = {"index": str(self.index), "wait": f"{wait_s:g}s"}
        body = await self._client.call("GET", self._path, wait_s + WAIT_SLACK_S, params=params)
        return self._parse(body)

    async def _fail_over_or_back_off(self, exc: Exception) -> None:
        self.num_failures += 1
        if self.num_failures % len(self._urls) != 0:  # a replica not yet tried in this streak
            failed = self._url
            logger.warning("watch %s failed (%s): trying %s", failed, exc, self._urls.rotate())
            return
        self._urls.rotate()
        ceiling_s = min(self._max_backoff_s, FIRST_BACKOFF_S * 2**self.num_failures)
        log = logger.warning if self.num_failures in (1, 10) else logger.debug
        log("watch %s failed (%d in a row): %s", self._url, self.num_failures, exc or type(exc))
        await asyncio.sleep(ceiling_s * random.uniform(0.5, 1.0))
