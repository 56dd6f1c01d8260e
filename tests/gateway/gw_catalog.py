"""A model catalog and keys' model lists for gateways, put into the real control plane's
documents on their way: a forwarder between the gateways and the control plane that sets the
summaries' `catalog` and the key snapshot's `models` to what the test says, and passes
everything else through. (The control plane's own catalog and key-model admin calls write the
same fields; this lets the gateway's tests choose them directly.)

Each document's index is the control plane's times `SCALE` plus this forwarder's version, which
every change here bumps: a gateway holding the previous version is answered at once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from wire.key_snapshot import KeySnapshot
from wire.model_catalog import ModelCatalog
from wire.region_summary import RegionSummaryIndex

SCALE = 1000
SUMMARY_PATH = "/v1/regions/summary"
KEYS_PATH = "/v1/keys/snapshot"


@dataclass
class CatalogForwarder:
    control_plane_url: str
    catalog: ModelCatalog = field(default_factory=ModelCatalog)
    key_models: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key id -> its list
    version: int = 1
    port: int = 0
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_catalog(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog
        self.version += 1

    def set_key_models(self, key_id: str, models: tuple[str, ...]) -> None:
        self.key_models[key_id] = models
        self.version += 1

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_get(SUMMARY_PATH, self._summary)
        app.router.add_get(KEYS_PATH, self._keys)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _summary(self, request: web.Request) -> web.Response:
        body = await self._watched(request)
        document = RegionSummaryIndex.model_validate_json(body)
        index = document.index * SCALE + self.version
        changed = document.model_copy(update={"index": index, "catalog": self.catalog})
        return web.Response(body=changed.model_dump_json(), content_type="application/json")

    async def _keys(self, request: web.Request) -> web.Response:
        body = await self._watched(request)
        snapshot = KeySnapshot.model_validate_json(body)
        keys = [
            grant.model_copy(update={"models": self.key_models.get(grant.id, grant.models)})
            for grant in snapshot.keys
        ]
        index = snapshot.index * SCALE + self.version
        changed = snapshot.model_copy(update={"index": index, "keys": keys})
        return web.Response(body=changed.model_dump_json(), content_type="application/json")

    async def _watched(self, request: web.Request) -> bytes:
        """The control plane's answer to the blocking query, at once if the gateway holds an
        older version of this forwarder's part."""
        held = int(request.query.get("index", "0"))
        params = {"index": str(held // SCALE), "wait": request.query.get("wait", "0s")}
        if held % SCALE != self.version:
            params = {"index": "0", "wait": "0s"}
        assert self._session is not None
        headers = {"Authorization": request.headers.get("Authorization", "")}
        url = self.control_plane_url + request.path
        async with self._session.get(url, params=params, headers=headers) as response:
            response.raise_for_status()
            return await response.read()

    async def _pass(self, request: web.Request) -> web.Response:
        assert self._session is not None
        headers = {name: value for name, value in request.headers.items() if name != "Host"}
        async with self._session.request(
            request.method,
            self.control_plane_url + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as response:
            body = await response.read()
            content_type = response.headers.get("Content-Type", "application/json")
            return web.Response(
                body=body, status=response.status, content_type=content_type.split(";")[0]
            )
