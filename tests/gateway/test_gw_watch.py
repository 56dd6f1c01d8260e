"""The gateway's watch over several control-plane replicas (gateway/watch.py with
wire/control_plane_urls.py): real aiohttp servers on loopback stand for the replicas; when the one
watched goes away, the next poll goes to the other at once, with no backoff; a list of URLs is
checked at start."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.control_plane_client import ControlPlaneClient
from gateway.watch import Watch
from wire.control_plane_urls import ControlPlaneUrls

PATH = "/v1/regions/summary"
MAX_BACKOFF_S = 30.0  # a backoff would stall the test: failing over must not wait for one


@dataclass(frozen=True)
class Document:
    index: int
    replica: str


@dataclass
class Replica:
    """One replica's summary endpoint: answers `index` at once, or holds the poll 0.2 s."""

    name: str
    index: int = 1
    num_polls: int = 0
    runner: web.AppRunner | None = None
    port: int = field(default=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._summary)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _summary(self, request: web.Request) -> web.Response:
        self.num_polls += 1
        if request.query.get("index") == str(self.index):
            await asyncio.sleep(0.2)  # nothing new: hold the blocking query a little
        return web.json_response({"index": self.index, "replica": self.name})


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = Replica("a", index=10), Replica("b", index=20)
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


def parse(body: bytes) -> Document:
    return Document(**json.loads(body))


@pytest.mark.asyncio
async def test_the_watch_fails_over_to_the_next_replica_at_once(
    replicas: tuple[Replica, Replica], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = replicas
    seen: list[Document] = []
    async with aiohttp.ClientSession() as session:
        urls = ControlPlaneUrls([a.url, b.url])
        client = ControlPlaneClient(session, urls, "token")
        watch = Watch(client, PATH, parse, seen.append, 0.2, MAX_BACKOFF_S)
        task = asyncio.create_task(watch.run())
        try:
            async with asyncio.timeout(10):
                await watch.loaded.wait()
                assert seen == [Document(10, "a")]
                await a.stop()  # a goes away mid-watch
                while not seen or seen[-1].replica != "b":
                    await asyncio.sleep(0.01)
            assert seen[-1] == Document(20, "b") and urls.current == b.url
            assert watch.num_failures == 0  # b answered: the streak is over
            failovers = [r.getMessage() for r in caplog.records if "trying" in r.getMessage()]
            assert failovers and all(m.endswith(f"trying {b.url}") for m in failovers)
            assert not [r for r in caplog.records if "in a row" in r.getMessage()]  # no backoff
        finally:
            task.cancel()


def test_a_url_list_is_checked() -> None:
    urls = ControlPlaneUrls.parse("http://127.0.0.1:8080/, http://127.0.0.1:8081")
    assert urls.urls == ("http://127.0.0.1:8080", "http://127.0.0.1:8081")
    assert list(urls.in_turn()) == list(urls.urls)
    urls.settle("http://127.0.0.1:8081")
    assert list(urls.in_turn()) == ["http://127.0.0.1:8081", "http://127.0.0.1:8080"]
    assert urls.rotate() == "http://127.0.0.1:8080"
    for bad, message in [
        ("", "at least one"),
        ("http://a:1,,http://b:2", "at least one"),
        ("ftp://a:1", "not an http"),
        ("http://a:1,http://a:1/", "listed twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            ControlPlaneUrls.parse(bad)
