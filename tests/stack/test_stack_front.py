"""The Anycast front (`python -m stack.front`) as a real process in front of real TLS servers
standing for the PoPs (on their own loopback addresses, certificates from the stack CA): each
client city's port reaches its nearest announced PoP, TLS end to end, one RTT later; the
operator withdraws and announces through the admin HTTP (never the last PoP); a PoP that dies
is skipped at once and withdrawn by its health check, and comes back when it answers again."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from bounded_wait import wait_until

from gateway.anycast import Anycast, pops_at
from stack.certs import ensure_pop_tls
from stack.front import CHECK_INTERVAL_S, FAILURES_DOWN, AnycastFront, Endpoint
from wire.geo import LOCATIONS, locate

pytestmark = pytest.mark.slow  # starts processes

POPS = {"new-york": "127.0.1.1", "london": "127.0.1.2", "singapore": "127.0.1.3"}
CITIES = ("tokyo", "paris", "chicago")
NEAREST = {"tokyo": "singapore", "paris": "london", "chicago": "new-york"}


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class FakePops:
    """A TLS server per PoP on its own address (the same port for all), on one loop thread:
    `/health` and `/whoami` (its name)."""

    def __init__(self, tls_dir: Path) -> None:
        self.tls = ensure_pop_tls(tls_dir, {pop: (address,) for pop, address in POPS.items()})
        self.port = _free_port("127.0.1.1")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: dict[str, web.AppRunner] = {}
        for pop in POPS:
            self.start(pop)

    @property
    def ca_cert(self) -> Path:
        return self.tls["new-york"].ca_cert

    def _run(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def start(self, pop: str) -> None:
        async def start() -> None:
            async def whoami(request: web.Request) -> web.Response:
                return web.json_response({"pop": pop})

            app = web.Application()
            app.router.add_get("/health", whoami)
            app.router.add_get("/whoami", whoami)
            runner = web.AppRunner(app)
            await runner.setup()
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.tls[pop].cert, self.tls[pop].key)
            site = web.TCPSite(runner, POPS[pop], self.port, ssl_context=context)
            await site.start()
            self.runners[pop] = runner

        self._run(start())

    def stop(self, pop: str) -> None:
        self._run(self.runners.pop(pop).cleanup())

    def close(self) -> None:
        for pop in list(self.runners):
            self.stop(pop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Front:
    def __init__(self, pops: FakePops, log: Path) -> None:
        self.admin = _free_port()
        self.ports = {city: _free_port() for city in CITIES}
        argv = [
            sys.executable,
            "-m",
            "stack.front",
            *("--admin", f"127.0.0.1:{self.admin}", "--health-ca", str(pops.ca_cert)),
            *(a for pop, host in POPS.items() for a in ("--pop", f"{pop}={host}:{pops.port}")),
            *(a for c, port in self.ports.items() for a in ("--client", f"{c}=127.0.0.1:{port}")),
        ]
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.verify = ssl.create_default_context(cafile=str(pops.ca_cert))
        wait_until(self._is_up, 20, "the front's admin API", interval_s=0.05)

    def _is_up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(self.admin_url).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}/v1/anycast"

    def pop_of(self, city: str) -> str:
        """The PoP a new connection from `city` reaches (a fresh TLS connection each time)."""
        with httpx.Client(verify=self.verify) as client:
            response = client.get(f"https://127.0.0.1:{self.ports[city]}/whoami")
        pop: str = response.json()["pop"]
        return pop

    def state(self) -> dict[str, object]:
        body: dict[str, object] = httpx.get(self.admin_url).json()
        return body

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def pops(tmp_path: Path) -> Iterator[FakePops]:
    fake = FakePops(tmp_path / "tls")
    yield fake
    fake.close()


@pytest.fixture
def front(pops: FakePops, tmp_path: Path) -> Iterator[Front]:
    started = Front(pops, tmp_path / "front.log")
    yield started
    started.close()


def test_each_city_reaches_its_nearest_pop_one_rtt_later(front: Front) -> None:
    table = Anycast(pops_at(POPS, LOCATIONS))
    for city in CITIES:
        assert front.pop_of(city) == NEAREST[city] == table.reach(locate(city)).pop
    state = front.state()
    assert state["clients"]["tokyo"]["pop"] == "singapore"  # type: ignore[index]
    # The TLS handshake and the request each cross the simulated path: at least two RTTs.
    rtt_s = table.reach(locate("tokyo")).rtt_ms / 1000
    started = time.monotonic()
    front.pop_of("tokyo")
    assert time.monotonic() - started >= 2 * rtt_s


def test_withdraw_moves_new_connections_and_the_last_pop_is_never_withdrawn(
    front: Front,
) -> None:
    withdrawn = httpx.post(f"http://127.0.0.1:{front.admin}/v1/anycast/singapore/withdraw")
    assert withdrawn.status_code == 200
    assert front.pop_of("tokyo") == "london"  # the next-nearest to Tokyo
    assert front.pop_of("paris") == "london"
    httpx.post(f"http://127.0.0.1:{front.admin}/v1/anycast/london/withdraw")
    assert front.pop_of("tokyo") == "new-york"
    last = httpx.post(f"http://127.0.0.1:{front.admin}/v1/anycast/new-york/withdraw")
    assert last.status_code == 409
    assert "new-york is the last PoP announcing" in last.json()["error"]
    assert front.pop_of("tokyo") == "new-york"  # nothing changed
    unknown = httpx.post(f"http://127.0.0.1:{front.admin}/v1/anycast/atlantis/withdraw")
    assert unknown.status_code == 404 and "unknown PoP 'atlantis'" in unknown.json()["error"]
    httpx.post(f"http://127.0.0.1:{front.admin}/v1/anycast/singapore/announce")
    assert front.pop_of("tokyo") == "singapore"


def test_a_dead_pop_is_skipped_at_once_withdrawn_and_announced_again(
    front: Front, pops: FakePops
) -> None:
    assert front.pop_of("tokyo") == "singapore"
    pops.stop("singapore")
    assert front.pop_of("tokyo") == "london"  # the refused connect went on to the next PoP
    pops_state = front.state()["pops"]
    assert pops_state["singapore"]["announced"] is False  # type: ignore[index]
    pops.start("singapore")
    wait_until(
        lambda: front.pop_of("tokyo") == "singapore",
        10 * CHECK_INTERVAL_S * FAILURES_DOWN + 5,
        "singapore to be announced again",
        interval_s=0.05,
    )


def test_a_check_begun_before_a_refused_connect_does_not_announce_the_pop_again() -> None:
    front = AnycastFront(
        [Endpoint(pop, host, 443) for pop, host in POPS.items()],
        [Endpoint("tokyo", "127.0.0.1", 1)],
    )
    in_flight = time.monotonic()  # a health check sent while singapore still answered...
    front.record_refused("singapore")  # ... then singapore refused a client's connection
    front.record_check("singapore", True, in_flight)
    assert "singapore" not in front.table.announcing
    front.record_check("singapore", True, time.monotonic())  # a check begun after it
    assert "singapore" in front.table.announcing
