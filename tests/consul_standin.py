"""A STAND-IN for the subset of Consul's HTTP API that Meridian uses — for tests only; not Consul.

No Consul can be installed here, so tests run against this; the same tests run against a real
agent when `CONSUL_HTTP_ADDR` is set (see `consul_address`). One agent node, one datacenter.

Agent endpoints (what node agents call through `py-consul`):
`PUT /v1/agent/service/register` (`?replace-existing-checks`), `PUT /v1/agent/service/deregister/
{id}`, `PUT /v1/agent/check/{pass,warn,fail}/{id}?note=...`, `PUT /v1/agent/check/update/{id}`,
`GET /v1/agent/services`, `GET /v1/agent/checks`. Body keys match without regard to case, as in
Consul; only TTL checks are supported.

Catalog and health endpoints (what the control plane's sync calls), all blocking queries:
`GET /v1/catalog/services`, `GET /v1/catalog/service/{name}`, `GET /v1/health/service/{name}`
(`?passing`), `GET /v1/health/checks/{name}`; plus `GET /v1/status/leader`.

Consul semantics kept: every response carries `X-Consul-Index`; the index moves on each change to
services or to a check's status (an output-only update does not move it, as with Consul's
`check_update_interval`); a query with `?index=N` blocks until the index of what it reads passes N,
or until `wait` (Go duration, default 5 m, at most 10 m) has passed, then answers with the same
index; a TTL check not updated within its TTL turns critical; checks start critical unless given
a `Status`; `DeregisterCriticalServiceAfter` reaps a service whose check stays critical (Consul
waits at least a minute; the stand-in honours any value, so tests can be quick).
Not kept: ACLs, tags and filters, other check kinds, datacenters, KV, sessions, wait jitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

NODE_NAME = "consul-standin"
DATACENTER = "dc1"
DEFAULT_WAIT_S = 300.0
MAX_WAIT_S = 600.0
TTL_SWEEP_S = 0.05
_VERBS = {"pass": "passing", "warn": "warning", "fail": "critical"}
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(text: str) -> float:
    """A Go duration ("10s", "1m30s", "250ms") in seconds."""
    parts = re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}")
    return sum(float(number) * _UNITS_S[unit] for number, unit in parts)


def _get(body: dict[str, Any], key: str, default: Any = None) -> Any:
    for name, value in body.items():
        if name.lower() == key.lower():
            return value
    return default


@dataclass
class _Check:
    check_id: str
    name: str
    service_id: str
    service_name: str
    status: str
    notes: str
    ttl_s: float | None
    deregister_after_s: float | None
    output: str = ""
    updated_mono: float = field(default_factory=time.monotonic)
    critical_since_mono: float | None = None
    index: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "Node": NODE_NAME,
            "CheckID": self.check_id,
            "Name": self.name,
            "Status": self.status,
            "Notes": self.notes,
            "Output": self.output,
            "ServiceID": self.service_id,
            "ServiceName": self.service_name,
            "ServiceTags": [],
            "Type": "ttl",
            "CreateIndex": self.index,
            "ModifyIndex": self.index,
        }


@dataclass
class _Service:
    service_id: str
    name: str
    tags: list[str]
    address: str
    port: int
    meta: dict[str, str]
    index: int = 0

    def as_agent_json(self) -> dict[str, Any]:
        return {
            "ID": self.service_id,
            "Service": self.name,
            "Tags": self.tags,
            "Meta": self.meta,
            "Port": self.port,
            "Address": self.address,
            "Weights": {"Passing": 1, "Warning": 1},
            "EnableTagOverride": False,
            "Datacenter": DATACENTER,
        }


class ConsulStandIn:
    """The stand-in server; `start()` and `stop()` run on the caller's event loop."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.index = 1
        self._services: dict[str, _Service] = {}
        self._checks: dict[str, _Check] = {}
        self._modified: dict[str, int] = {}  # service name → index of its last change
        self._changed = asyncio.Event()
        self._node_id = str(uuid.uuid4())
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_put("/v1/agent/service/register", self._register)
        app.router.add_put("/v1/agent/service/deregister/{service_id}", self._deregister)
        app.router.add_put("/v1/agent/check/update/{check_id}", self._update)
        app.router.add_put("/v1/agent/check/{verb}/{check_id}", self._ttl)
        app.router.add_get("/v1/agent/services", self._agent_services)
        app.router.add_get("/v1/agent/checks", self._agent_checks)
        app.router.add_get("/v1/catalog/services", self._catalog_services)
        app.router.add_get("/v1/catalog/service/{name}", self._catalog_service)
        app.router.add_get("/v1/health/service/{name}", self._health_service)
        app.router.add_get("/v1/health/checks/{name}", self._health_checks)
        app.router.add_get("/v1/status/leader", self._leader)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._sweeper = asyncio.create_task(self._sweep_ttls())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._runner is not None:
            self._wake()  # let blocking queries answer now
            await self._runner.cleanup()
            self._runner = None

    def forget_everything(self) -> None:
        """What an agent restarted without persisted state looks like to its clients."""
        names = {service.name for service in self._services.values()}
        self._services.clear()
        self._checks.clear()
        self._bump(*names)

    # --- state ---

    def _bump(self, *service_names: str) -> None:
        self.index += 1
        for name in service_names:
            self._modified[name] = self.index
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_status(self, check: _Check, status: str, output: str | None) -> None:
        if output is not None:
            check.output = output
        check.updated_mono = time.monotonic()
        if status == check.status:
            return
        check.status = status
        check.critical_since_mono = time.monotonic() if status == "critical" else None
        self._bump(check.service_name)
        check.index = self.index

    def _remove_service(self, service_id: str) -> None:
        service = self._services.pop(service_id)
        for check_id in [c for c, check in self._checks.items() if check.service_id == service_id]:
            del self._checks[check_id]
        self._bump(service.name)

    async def _sweep_ttls(self) -> None:
        while True:
            await asyncio.sleep(TTL_SWEEP_S)
            now = time.monotonic()
            for check in list(self._checks.values()):
                is_live = check.status != "critical"
                if is_live and check.ttl_s is not None and now - check.updated_mono > check.ttl_s:
                    self._set_status(check, "critical", "TTL expired")
                since, limit = check.critical_since_mono, check.deregister_after_s
                is_expired = since is not None and limit is not None and now - since > limit
                if is_expired and check.service_id in self._services:
                    self._remove_service(check.service_id)

    # --- agent endpoints ---

    async def _register(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        name = _get(body, "name")
        if not name:
            return web.Response(status=400, text="Missing service name")
        service_id = _get(body, "id") or name
        definitions = list(_get(body, "checks") or [])
        if _get(body, "check"):
            definitions.append(_get(body, "check"))
        try:
            checks = [
                self._check_of(definition, number, len(definitions), service_id, name)
                for number, definition in enumerate(definitions, start=1)
            ]
        except ValueError as exc:
            return web.Response(status=400, text=str(exc))
        old = self._services.get(service_id)
        self._bump(name, *([old.name] if old is not None else []))
        self._services[service_id] = _Service(
            service_id=service_id,
            name=name,
            tags=list(_get(body, "tags") or []),
            address=_get(body, "address") or "",
            port=int(_get(body, "port") or 0),
            meta=dict(_get(body, "meta") or {}),
            index=self.index,
        )
        if request.query.get("replace-existing-checks") in ("true", "1"):
            for check_id in [c for c, v in self._checks.items() if v.service_id == service_id]:
                del self._checks[check_id]
        for check in checks:
            check.index = self.index
            self._checks[check.check_id] = check
        return web.Response(status=200)

    def _check_of(
        self, definition: dict[str, Any], number: int, count: int, service_id: str, name: str
    ) -> _Check:
        if not _get(definition, "ttl"):
            raise ValueError("the stand-in supports TTL checks only")
        default_id = f"service:{service_id}" + (f":{number}" if count > 1 else "")
        check_id = _get(definition, "checkid") or _get(definition, "id") or default_id
        old = self._checks.get(check_id)
        # Re-registering keeps a check's status unless the definition gives one.
        status = _get(definition, "status") or (old.status if old else "critical")
        after = _get(definition, "deregistercriticalserviceafter")
        return _Check(
            check_id=check_id,
            name=_get(definition, "name") or f"Service '{name}' check",
            service_id=service_id,
            service_name=name,
            status=status,
            notes=_get(definition, "notes") or "",
            ttl_s=parse_duration_s(_get(definition, "ttl")),
            deregister_after_s=parse_duration_s(after) if after else None,
            output=old.output if old else "",
            critical_since_mono=time.monotonic() if status == "critical" else None,
        )

    async def _deregister(self, request: web.Request) -> web.Response:
        service_id = request.match_info["service_id"]
        if service_id not in self._services:
            return web.Response(status=404, text=f'Unknown service ID "{service_id}"')
        self._remove_service(service_id)
        return web.Response(status=200)

    async def _ttl(self, request: web.Request) -> web.Response:
        status = _VERBS.get(request.match_info["verb"])
        if status is None:
            return web.Response(status=405)
        return self._update_check(request.match_info["check_id"], status, request.query.get("note"))

    async def _update(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        status = _get(body, "status", "critical")
        return self._update_check(request.match_info["check_id"], status, _get(body, "output"))

    def _update_check(self, check_id: str, status: str, output: str | None) -> web.Response:
        check = self._checks.get(check_id)
        if check is None:
            return web.Response(status=404, text=f'Unknown check ID "{check_id}"')
        self._set_status(check, status, output or "")
        return web.Response(status=200)

    async def _agent_services(self, request: web.Request) -> web.Response:
        body = {sid: s.as_agent_json() for sid, s in self._services.items()}
        return web.json_response(body)

    async def _agent_checks(self, request: web.Request) -> web.Response:
        return web.json_response({cid: c.as_json() for cid, c in self._checks.items()})

    async def _leader(self, request: web.Request) -> web.Response:
        return web.json_response("127.0.0.1:8300")

    # --- catalog and health (blocking queries) ---

    async def _block(self, request: web.Request, name: str | None) -> int:
        """Wait as a blocking query does; return the index to answer with."""

        def current() -> int:
            return self.index if name is None else self._modified.get(name, 1)

        try:
            index = int(request.query.get("index", "0") or 0)
            wait_s = parse_duration_s(request.query["wait"]) if "wait" in request.query else 0
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc
        wait_s = min(wait_s or DEFAULT_WAIT_S, MAX_WAIT_S)
        deadline = time.monotonic() + wait_s
        while index > 0 and current() <= index and self._runner is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return current()

    def _indexed(self, body: Any, index: int) -> web.Response:
        headers = {
            "X-Consul-Index": str(index),
            "X-Consul-KnownLeader": "true",
            "X-Consul-LastContact": "0",
        }
        return web.json_response(body, headers=headers)

    def _node_json(self) -> dict[str, Any]:
        return {
            "ID": self._node_id,
            "Node": NODE_NAME,
            "Address": "127.0.0.1",
            "Datacenter": DATACENTER,
            "TaggedAddresses": {"lan": "127.0.0.1", "wan": "127.0.0.1"},
            "Meta": {},
        }

    def _serf_check(self) -> dict[str, Any]:
        return {
            "Node": NODE_NAME,
            "CheckID": "serfHealth",
            "Name": "Serf Health Status",
            "Status": "passing",
            "Notes": "",
            "Output": "Agent alive and reachable",
            "ServiceID": "",
            "ServiceName": "",
            "Type": "",
        }

    def _instances(self, name: str) -> list[_Service]:
        found = [s for s in self._services.values() if s.name == name]
        return sorted(found, key=lambda s: s.service_id)

    def _checks_of(self, service_id: str) -> list[_Check]:
        return [c for c in self._checks.values() if c.service_id == service_id]

    async def _catalog_services(self, request: web.Request) -> web.Response:
        index = await self._block(request, None)
        body: dict[str, list[str]] = {}
        for service in self._services.values():
            tags = body.setdefault(service.name, [])
            tags.extend(tag for tag in service.tags if tag not in tags)
        return self._indexed(body, index)

    async def _catalog_service(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        index = await self._block(request, name)
        body = [
            {
                "ID": self._node_id,
                "Node": NODE_NAME,
                "Address": "127.0.0.1",
                "Datacenter": DATACENTER,
                "NodeMeta": {},
                "ServiceID": s.service_id,
                "ServiceName": s.name,
                "ServiceTags": s.tags,
                "ServiceAddress": s.address,
                "ServicePort": s.port,
                "ServiceMeta": s.meta,
                "ServiceWeights": {"Passing": 1, "Warning": 1},
                "ServiceEnableTagOverride": False,
                "CreateIndex": s.index,
                "ModifyIndex": s.index,
            }
            for s in self._instances(name)
        ]
        return self._indexed(body, index)

    async def _health_service(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        index = await self._block(request, name)
        only_passing = "passing" in request.query and request.query["passing"] not in ("0", "false")
        body = []
        for s in self._instances(name):
            checks = [self._serf_check(), *(c.as_json() for c in self._checks_of(s.service_id))]
            if only_passing and any(c["Status"] != "passing" for c in checks):
                continue
            service = s.as_agent_json() | {"CreateIndex": s.index, "ModifyIndex": s.index}
            body.append({"Node": self._node_json(), "Service": service, "Checks": checks})
        return self._indexed(body, index)

    async def _health_checks(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        index = await self._block(request, name)
        checks = [c.as_json() for c in self._checks.values() if c.service_name == name]
        return self._indexed(checks, index)


@dataclass(frozen=True)
class ConsulTarget:
    """Where tests find Consul: a real agent (`CONSUL_HTTP_ADDR`) or the stand-in."""

    addr: str
    standin: ConsulStandIn | None

    @property
    def is_standin(self) -> bool:
        return self.standin is not None


@contextlib.asynccontextmanager
async def consul_address() -> AsyncIterator[ConsulTarget]:
    """A real agent when `CONSUL_HTTP_ADDR` is set; else the stand-in on this event loop."""
    real = os.environ.get("CONSUL_HTTP_ADDR")
    if real:
        yield ConsulTarget(real, None)
        return
    standin = ConsulStandIn()
    await standin.start()
    try:
        yield ConsulTarget(standin.addr, standin)
    finally:
        await standin.stop()
