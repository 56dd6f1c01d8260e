"""`python -m stack.front`: the Anycast front, standing for the one anycast address of every PoP.

    python -m stack.front --admin 127.0.0.1:8600 --health-ca ca.pem \\
        --pop new-york=127.0.1.1:8443 --pop london=127.0.1.2:8443 \\
        --client tokyo=127.0.0.1:8601 --client paris=127.0.0.1:8602

Each `--client CITY=HOST:PORT` is a simulated client city: every TCP connection accepted there
goes to the nearest PoP that announces the prefix, by the real `gateway/anycast.py` table, and
its bytes are delayed by half the city's RTT to that PoP each way (the RTT proxy's pipe), over
the public internet: with seeded jitter and loss (stack/path_delays.py; `--jitter-share`,
`--loss-per-100-ms`, `--seed`). Only bytes pass: TLS stays end to end between the client and the
PoP.

A PoP is announced unless the operator withdrew it (admin HTTP, `meridian anycast withdraw`) or
it is down: its `/health` failed `FAILURES_DOWN` checks in a row, or a connection to it was
refused (then that connection goes on to the next-nearest PoP at once, so a crashed PoP costs no
client a failed connect). It comes back on its first good check. Withdrawing the last announced
PoP is refused, and changes nothing. Admin HTTP (loopback): `GET /v1/anycast`,
`POST /v1/anycast/{pop}/withdraw`, `POST /v1/anycast/{pop}/announce`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from gateway.anycast import Anycast, Route, pops_at
from stack.path_delays import (
    PathDelays,
    PublicPath,
    add_path_arguments,
    connection_rng,
    public_path_of,
)
from stack.rtt_proxy import close_writer, connect, host_port, pipe_delayed
from stack.server_process import add_log_level_argument, run_server, stop_on_signals
from wire.geo import LOCATIONS, locate

logger = logging.getLogger("stack.front")

CHECK_INTERVAL_S: Final = 0.25
CHECK_TIMEOUT_S: Final = 0.5
FAILURES_DOWN: Final = 2


class FrontError(Exception):
    """An admin request the front refuses; `status` is its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # a PoP or a client city (a place in wire/geo.py)
    host: str
    port: int


def parse_endpoint(text: str) -> Endpoint:
    """`NAME=HOST:PORT` (argparse type)."""
    name, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=HOST:PORT")
    if name not in LOCATIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not a place in wire/geo.py")
    return Endpoint(name, host, int(port))


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (argparse type)."""
    try:
        return host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class AnycastFront:
    def __init__(
        self,
        pops: list[Endpoint],
        clients: list[Endpoint],
        public: PublicPath | None = None,
        seed: int = 0,
    ) -> None:
        """`public`: how the cities' paths treat their bytes (None: steady, no draws)."""
        self.pops = {pop.name: pop for pop in pops}
        self.clients = {client.name: client for client in clients}
        self.public = public
        self.seed = seed
        self._num_accepted = dict.fromkeys(self.clients, 0)
        self.table = Anycast(pops_at(self.pops, LOCATIONS))
        self.withdrawn: set[str] = set()  # by the operator
        self._num_failures = dict.fromkeys(self.pops, 0)
        self._refused_at = dict.fromkeys(self.pops, -math.inf)  # time.monotonic()
        self.num_connections = dict.fromkeys(self.pops, 0)

    # Announcements.

    def is_down(self, pop: str) -> bool:
        return self._num_failures[pop] >= FAILURES_DOWN

    def _apply(self) -> None:
        for name in self.pops:
            if name in self.withdrawn or self.is_down(name):
                if name in self.table.announcing:
                    logger.warning("PoP %s withdrawn (%s)", name, self._why(name))
                self.table.withdraw(name)
            else:
                if name not in self.table.announcing:
                    logger.warning("PoP %s announced", name)
                self.table.announce(name)

    def _why(self, pop: str) -> str:
        return "by the operator" if pop in self.withdrawn else "health check failed"

    def _known(self, pop: str) -> None:
        if pop not in self.pops:
            known = ", ".join(self.pops)
            raise FrontError(f"unknown PoP {pop!r}; known: {known}", 404)

    def withdraw(self, pop: str) -> None:
        self._known(pop)
        if self.table.announcing == {pop}:
            raise FrontError(
                f"refused: {pop} is the last PoP announcing {self.table.prefix}; withdrawing it "
                "would cut every client off (announce another first)",
                409,
            )
        self.withdrawn.add(pop)
        self._apply()

    def announce(self, pop: str) -> None:
        self._known(pop)
        self.withdrawn.discard(pop)
        self._apply()

    def record_check(self, pop: str, is_ok: bool, started: float) -> None:
        """A check's result; `started`: when it began (time.monotonic())."""
        if is_ok and started < self._refused_at[pop]:
            return  # answered before the PoP refused a connection: says nothing of it now
        self._num_failures[pop] = 0 if is_ok else self._num_failures[pop] + 1
        self._apply()

    def record_refused(self, pop: str) -> None:
        """`pop` refused a connection: down now, whatever a check in flight says."""
        self._num_failures[pop] = FAILURES_DOWN
        self._refused_at[pop] = time.monotonic()
        self._apply()

    def state(self) -> dict[str, object]:
        return {
            "prefix": self.table.prefix,
            "pops": {
                name: {
                    "address": f"{pop.host}:{pop.port}",
                    "announced": name in self.table.announcing,
                    "withdrawn_by_operator": name in self.withdrawn,
                    "healthy": not self.is_down(name),
                    "num_connections": self.num_connections[name],
                }
                for name, pop in self.pops.items()
            },
            "clients": {
                city: {"address": f"{client.host}:{client.port}", **self._route_of(city)}
                for city, client in self.clients.items()
            },
        }

    def _route_of(self, city: str) -> dict[str, object]:
        routes = self.table.routes(locate(city))
        if not routes:
            return {"pop": None, "rtt_ms": None}
        return {"pop": routes[0].pop, "rtt_ms": round(routes[0].rtt_ms, 1)}

    # Traffic.

    def delays_of(self, city: str, route: Route, connection: int) -> tuple[PathDelays, PathDelays]:
        """The delay schedules of `city`'s `connection`-th connection: to the PoP, back."""
        one_way_s = route.rtt_ms / 2000.0
        port = self.clients[city].port
        return (
            PathDelays(one_way_s, self.public, connection_rng(self.seed, port, connection, "up")),
            PathDelays(one_way_s, self.public, connection_rng(self.seed, port, connection, "down")),
        )

    async def handle(
        self, city: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One client connection: to the nearest announced PoP; if it refuses, the next."""
        connection = self._num_accepted[city]
        self._num_accepted[city] += 1
        for route in self.table.routes(locate(city)):
            pop = self.pops[route.pop]
            try:
                upstream = await connect((pop.host, pop.port))
            except (OSError, TimeoutError) as exc:
                logger.warning("PoP %s refused a connection from %s: %s", pop.name, city, exc)
                self.record_refused(pop.name)
                continue
            self.num_connections[pop.name] += 1
            await pipe_delayed((reader, writer), upstream, self.delays_of(city, route, connection))
            return
        logger.warning("no PoP announces %s: closing a connection from %s", self.table.prefix, city)
        await close_writer(writer)

    async def check_health(self, context: ssl.SSLContext) -> None:
        """Every PoP's `/health`, every CHECK_INTERVAL_S, until cancelled."""
        timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)
        connector = aiohttp.TCPConnector(ssl=context, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:
                names = list(self.pops)
                started = time.monotonic()
                results = await asyncio.gather(*(self._check(session, n) for n in names))
                for name, is_ok in zip(names, results, strict=True):
                    self.record_check(name, is_ok, started)
                await asyncio.sleep(CHECK_INTERVAL_S)

    async def _check(self, session: aiohttp.ClientSession, name: str) -> bool:
        pop = self.pops[name]
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with session.get(f"https://{pop.host}:{pop.port}/health") as response:
                return response.status == 200
        return False


def admin_app(front: AnycastFront) -> web.Application:
    async def show(request: web.Request) -> web.Response:
        return web.json_response(front.state())

    async def change(request: web.Request) -> web.Response:
        pop, action = request.match_info["pop"], request.match_info["action"]
        try:
            if action == "withdraw":
                front.withdraw(pop)
            elif action == "announce":
                front.announce(pop)
            else:
                raise FrontError(f"unknown action {action!r}: withdraw or announce", 404)
        except FrontError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return web.json_response(front.state())

    app = web.Application()
    app.router.add_get("/v1/anycast", show)
    app.router.add_post("/v1/anycast/{pop}/{action}", change)
    return app


async def serve(front: AnycastFront, admin: tuple[str, int], context: ssl.SSLContext) -> None:
    servers = []
    for city, client in front.clients.items():

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, city: str = city
        ) -> None:
            await front.handle(city, reader, writer)

        servers.append(
            await asyncio.start_server(handle, client.host, client.port, reuse_address=True)
        )
        logger.info("client %s on %s:%d", city, client.host, client.port)
    runner = web.AppRunner(admin_app(front), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, *admin, reuse_address=True).start()
    checking = asyncio.create_task(front.check_health(context))
    stopped = stop_on_signals()
    logger.info("Anycast front ready: admin on http://%s:%d", *admin)
    try:
        await stopped.wait()
    finally:
        checking.cancel()
        await asyncio.gather(checking, return_exceptions=True)
        for server in servers:
            server.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.front", description=__doc__)
    parser.add_argument("--pop", type=parse_endpoint, action="append", required=True)
    parser.add_argument("--client", type=parse_endpoint, action="append", required=True)
    parser.add_argument("--admin", type=parse_listen, required=True, help="HOST:PORT")
    parser.add_argument("--health-ca", required=True, help="PEM CA file the PoPs' TLS is from")
    add_path_arguments(parser)
    add_log_level_argument(parser)
    args = parser.parse_args(argv)
    public = public_path_of(args, parser)
    try:
        context = ssl.create_default_context(cafile=args.health_ca)
    except (OSError, ssl.SSLError) as exc:
        print(f"front: error: cannot load --health-ca: {exc}", file=sys.stderr)
        return 1
    front = AnycastFront(args.pop, args.client, public, args.seed)
    return run_server("front", args.log_level, serve(front, args.admin, context))


if __name__ == "__main__":
    sys.exit(main())
