"""`python -m stack.rtt_proxy`: a TCP proxy that delays traffic by a simulated round-trip time.

    python -m stack.rtt_proxy --route 127.0.0.1:10201=127.0.0.1:10001@76.5 [--route ...] \
        [--public-route 127.0.0.1:10601=127.0.0.1:10001@92.0 --jitter-share 0.05 \
         --loss-per-100-ms 0.005 --seed 0]

Each `--route LISTEN=UPSTREAM[,UPSTREAM...]@RTT_MS` listens on LISTEN and forwards every
connection to one upstream (round robin over the list), holding each chunk of bytes for half
the RTT in each direction, so a request and its answer together take one RTT longer, as over a
real path of that length: a PoP's path to a region over the private backbone, steady. A
`--public-route` (same form) is a client's path over the public internet instead: each chunk
also takes a seeded exponential jitter and, now and then, a lost packet's retransmission
(stack/path_delays.py). Chunks keep their order and their spacing (a stream's tokens arrive
as far apart as they were sent), and a full queue pushes back on the sender. The gateway computes
the same RTT from wire/geo.py for its routing; this makes it real. One process serves every
route. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import sys
from dataclasses import dataclass, replace

from stack.path_delays import (
    PathDelays,
    PathKind,
    PublicPath,
    add_path_arguments,
    connection_rng,
    public_path_of,
)
from stack.server_process import add_log_level_argument, run_server, stop_on_signals

logger = logging.getLogger("stack.rtt_proxy")

CHUNK_BYTES = 64 * 1024
MAX_QUEUED_CHUNKS = 256
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Route:
    listen: tuple[str, int]
    upstreams: tuple[tuple[str, int], ...]
    rtt_ms: float
    kind: PathKind = "backbone"


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_route(text: str) -> Route:
    """`LISTEN=UP[,UP...]@RTT_MS` → Route (argparse type)."""
    try:
        listen, rest = text.split("=", 1)
        upstreams, rtt = rest.rsplit("@", 1)
        rtt_ms = float(rtt)
        if not 0.0 <= rtt_ms <= 10_000.0:
            raise ValueError("RTT must be 0-10000 ms")
        return Route(
            host_port(listen),
            tuple(host_port(up) for up in upstreams.split(",")),
            rtt_ms,
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--route {text!r}: {exc} (expected LISTEN=UPSTREAM[,UPSTREAM...]@RTT_MS)"
        ) from exc


async def _delayed_pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delays: PathDelays
) -> None:
    """Copy reader → writer, each chunk its path's delay after it was read, never before the
    chunk ahead of it; EOF is passed on late too."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)
    last_due = 0.0

    async def put(chunk: bytes) -> None:
        nonlocal last_due
        last_due = max(last_due, loop.time() + delays.next_s())
        await queue.put((last_due, chunk))

    async def read() -> None:
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                await put(chunk)
        except ConnectionError:
            pass
        finally:
            await put(b"")

    reading = asyncio.create_task(read())
    try:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        return
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


async def close_writer(*writers: asyncio.StreamWriter) -> None:
    """Close every one of `writers` at once, then wait for them: a wait cancelled part way
    (the proxy closing) leaves none of them open, which Python 3.12's `Server.wait_closed`
    would wait on forever."""
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def connect(upstream: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the upstream; OSError or TimeoutError if it cannot be had in time."""
    return await asyncio.wait_for(asyncio.open_connection(*upstream), CONNECT_TIMEOUT_S)


async def pipe_delayed(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    delays: tuple[PathDelays, PathDelays],
) -> None:
    """Bytes both ways (`delays`: to the upstream, back), each as late as its path makes it,
    until both sides are done; then both closed."""
    (client_reader, client_writer), (up_reader, up_writer) = client, upstream
    try:
        await asyncio.gather(
            _delayed_pipe(client_reader, up_writer, delays[0]),
            _delayed_pipe(up_reader, client_writer, delays[1]),
        )
    finally:
        await close_writer(up_writer, client_writer)


async def relay(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    upstream: tuple[str, int],
    delays: tuple[PathDelays, PathDelays],
) -> None:
    try:
        opened = await connect(upstream)
    except (OSError, TimeoutError) as exc:
        logger.warning("cannot reach %s:%d: %s", *upstream, exc)
        await close_writer(client_writer)
        return
    await pipe_delayed((client_reader, client_writer), opened, delays)


class RttProxy:
    def __init__(self, routes: list[Route], public: PublicPath | None = None, seed: int = 0):
        """`public`: how public routes treat their bytes (default: PublicPath's defaults)."""
        self.routes = routes
        self.public = public or PublicPath()
        self.seed = seed
        self._servers: list[asyncio.Server] = []
        self._relays: set[asyncio.Task[None]] = set()  # one per open connection

    def delays_of(self, route: Route, connection: int) -> tuple[PathDelays, PathDelays]:
        """The delay schedules of `route`'s `connection`-th connection: to the upstream, back."""
        public = self.public if route.kind == "public" else None
        one_way_s = route.rtt_ms / 2000.0
        port = route.listen[1]
        return (
            PathDelays(one_way_s, public, connection_rng(self.seed, port, connection, "up")),
            PathDelays(one_way_s, public, connection_rng(self.seed, port, connection, "down")),
        )

    async def start(self) -> None:
        for route in self.routes:
            upstreams = itertools.cycle(route.upstreams)
            connections = itertools.count()

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                route: Route = route,
                upstreams: itertools.cycle[tuple[str, int]] = upstreams,
                connections: itertools.count[int] = connections,
            ) -> None:
                task = asyncio.current_task()
                assert task is not None
                self._relays.add(task)
                delays = self.delays_of(route, next(connections))
                try:
                    await relay(reader, writer, next(upstreams), delays)
                finally:
                    self._relays.discard(task)

            server = await asyncio.start_server(handle, *route.listen, reuse_address=True)
            self._servers.append(server)
            logger.info(
                "%s:%d → %s, RTT +%.1f ms (%s)",
                *route.listen,
                ", ".join(f"{h}:{p}" for h, p in route.upstreams),
                route.rtt_ms,
                route.kind,
            )

    async def close(self) -> None:
        """Stop listening and end every open connection."""
        for server in self._servers:
            server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()


async def _serve(routes: list[Route], public: PublicPath, seed: int) -> None:
    proxy = RttProxy(routes, public, seed)
    await proxy.start()
    await stop_on_signals().wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.rtt_proxy", description=__doc__)
    parser.add_argument("--route", type=parse_route, action="append", default=[])
    parser.add_argument("--public-route", type=parse_route, action="append", default=[])
    add_path_arguments(parser)
    add_log_level_argument(parser)
    args = parser.parse_args(argv)
    routes = args.route + [replace(route, kind="public") for route in args.public_route]
    if not routes:
        parser.error("at least one --route or --public-route")
    public = public_path_of(args, parser)
    return run_server("rtt_proxy", args.log_level, _serve(routes, public, args.seed))


if __name__ == "__main__":
    sys.exit(main())
