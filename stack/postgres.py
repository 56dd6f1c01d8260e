"""A local PostgreSQL server from Debian's binaries (`/usr/lib/postgresql/<version>/bin`), for the
control plane's replicas in `meridian up`, its tests and its benchmark.

`LocalPostgres(data_dir).start()` runs `initdb` once (trust authentication, loopback and a unix
socket in the data directory only), then `pg_ctl start`; `stop()` is `pg_ctl stop -m fast`.
`meridian up` instead runs `server_argv()` (the `postgres` server in the foreground) as one of
its supervised children, after `initdb()`.
PostgreSQL refuses to run as root: run by root, the server runs as the `postgres` user that
Debian's package creates, and owns its data directory (whose parents it must be able to enter).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

BIN_GLOB: Final = "/usr/lib/postgresql/*/bin"
START_TIMEOUT_S: Final = 30
SUPERUSER: Final = "meridian"
SERVER_USER_WHEN_ROOT: Final = "postgres"


class PostgresNotFoundError(Exception):
    """No PostgreSQL server binaries on this machine."""


def find_bin_dir() -> Path:
    """The newest `/usr/lib/postgresql/<version>/bin` that has initdb and pg_ctl."""
    candidates = [
        path
        for path in Path("/").glob(BIN_GLOB.lstrip("/"))
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file()
    ]
    if not candidates:
        raise PostgresNotFoundError(
            f"no PostgreSQL server binaries in {BIN_GLOB} (apt-get install postgresql)"
        )
    return max(candidates, key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0))


def _run(args: Sequence[str]) -> None:
    """Run a server binary (as the `postgres` user when we are root); its stderr on failure."""
    is_root = os.geteuid() == 0
    result = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        check=False,
        user=SERVER_USER_WHEN_ROOT if is_root else None,
        group=SERVER_USER_WHEN_ROOT if is_root else None,
        extra_groups=[] if is_root else None,
    )
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"{Path(args[0]).name} failed: {detail[-1] if detail else result}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalPostgres:
    data_dir: Path
    port: int = 0  # 0: a free loopback port, chosen at start

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    @property
    def _log(self) -> Path:
        return self.data_dir / "server.log"

    def initdb(self) -> None:
        """Create the cluster in `data_dir` unless it is there."""
        bin_dir = find_bin_dir()
        if not (self.data_dir / "PG_VERSION").exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                shutil.chown(self.data_dir, SERVER_USER_WHEN_ROOT, SERVER_USER_WHEN_ROOT)
            _run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    SUPERUSER,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",  # a scratch database: speed over durability of the cluster
                ]
            )

    def _settings(self) -> list[str]:
        return [
            *("-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}"),
            *("-c", f"unix_socket_directories={self.data_dir}", "-c", "fsync=off"),
            *("-c", "max_connections=200", "-c", "shared_buffers=32MB"),
        ]

    def server_argv(self) -> list[str]:
        """The server in the foreground (it stops on SIGTERM); as root, as the `postgres` user
        (`setpriv` execs it, so the recorded PID is the server's own)."""
        server = [str(find_bin_dir() / "postgres"), "-D", str(self.data_dir), *self._settings()]
        if os.geteuid() != 0:
            return server
        user = SERVER_USER_WHEN_ROOT
        return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *server]

    def start(self) -> None:
        self.initdb()
        if self.port == 0:
            self.port = free_port()
        options = " ".join(self._settings())
        bin_dir = find_bin_dir()
        _run(
            [
                str(bin_dir / "pg_ctl"),
                "start",
                "-D",
                str(self.data_dir),
                "-l",
                str(self._log),
                "-o",
                options,
                "-w",
                "-t",
                str(START_TIMEOUT_S),
            ]
        )

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        psql = find_bin_dir() / "psql"
        host = ["-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "-d", "postgres"]
        _run([str(psql), *host, "-q", "-c", f'CREATE DATABASE "{name}"'])
        return self.url(name)

    def stop(self) -> None:
        _run([str(find_bin_dir() / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w"])
