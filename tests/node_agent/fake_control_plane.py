"""A fake control plane for heartbeat tests: a real aiohttp server on loopback that records every
heartbeat it is sent and answers as the test tells it (status, drain,
consul_deregister, may_exit, interval)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TOKEN = "node-token-for-tests-0123456789"


@dataclass
class FakeControlPlane:
    port: int
    status: int = 200
    drain: bool = False
    consul_deregister: bool = False
    may_exit: bool = False
    interval_s: float = 0.1
    beats: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[float] = field(default_factory=list)  # monotonic times of every request
    bad_auth: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/nodes/heartbeat", self._heartbeat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _heartbeat(self, request: web.Request) -> web.Response:
        self.attempts.append(time.monotonic())
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.bad_auth += 1
            return web.json_response({"error": "bad token"}, status=401)
        body = json.loads(await request.read())
        if self.status != 200:
            return web.json_response({"error": "unavailable"}, status=self.status)
        self.beats.append(body)
        return web.json_response(
            {
                "schema_version": 1,
                "drain": self.drain,
                "heartbeat_interval_s": self.interval_s,
                "region_registered": True,
                "consul_deregister": self.consul_deregister,
                "may_exit": self.may_exit,
                "a_field_from_the_future": 1,
            }
        )
