"""The stack's state directory: what `up` started (PIDs and start times), its tokens, its logs.

    $MERIDIAN_STACK_DIR, else $MERIDIAN_HOME/stack (default ~/.cache/meridian/stack)
      state.json       the running stack: its processes, URLs, CA path (removed by `down`)
      tokens.env       the admin, gateway and serving tokens (mode 0600; each node agent's
                       own control-plane credential is minted at start and only in its env)
      control-plane.db the fleet registry (SQLite)
      postgres/        or its PostgreSQL cluster (`control_plane: {db: postgres}`; run by root
                       under a home closed to others, in the temp directory instead)
      tls/             the local CA and the gateway's certificate
      envoy/           each region Envoy's bootstrap
      logs/            one log file per process

A process is identified by its PID *and* its start time, so a PID the kernel has since reused
for something else is never signalled.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from stack.errors import StackError
from stack.postgres import is_enterable_by_others

STATE_VERSION: Final = 1
STATE_FILE: Final = "state.json"
TOKENS_FILE: Final = "tokens.env"


def default_state_dir() -> Path:
    explicit = os.environ.get("MERIDIAN_STACK_DIR")
    if explicit:
        return Path(explicit)
    home = os.environ.get("MERIDIAN_HOME") or Path.home() / ".cache" / "meridian"
    return Path(home) / "stack"


def process_start_time(pid: int) -> str | None:
    """An identity for the process now holding `pid` (its start time), or None if there is none
    or it is a zombie. Linux: ticks since boot from /proc; elsewhere `ps -o lstart`."""
    if pid <= 0:
        return None
    stat_path = Path(f"/proc/{pid}/stat")
    if sys.platform.startswith("linux"):
        try:
            stat = stat_path.read_text()
        except OSError:
            return None
        # Fields after the command name (which may hold spaces and parentheses).
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):  # exited, not yet reaped
            return None
        return fields[19]  # field 22 of proc(5): starttime
    try:
        done = subprocess.run(
            ["ps", "-o", "stat=,lstart=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.strip()
    if done.returncode != 0 or not out or out.startswith("Z"):
        return None
    return out.split(None, 1)[1] if " " in out else out


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    """One process `up` started."""

    name: str  # e.g. "node us-east-00"
    kind: str  # postgres, control-plane, node, envoy, rtt-proxy, redis, gateway, anycast-front
    pid: int
    start_time: str
    log: str
    url: str | None = None

    def is_running(self) -> bool:
        """Whether this very process (not merely its PID) is still alive."""
        return process_start_time(self.pid) == self.start_time


@dataclass(slots=True)
class StackState:
    """What `status` and `down` need, written by `up` as it goes."""

    supervisor: ProcessRecord  # the `meridian up` process itself
    config: str
    detached: bool = False
    control_plane_url: str = ""  # the first replica's
    control_planes: dict[str, str] = field(default_factory=dict)  # each replica → its URL
    gateway_url: str = ""
    ca_cert: str = ""
    ready: bool = False
    pops: dict[str, str] = field(default_factory=dict)  # PoP → its gateway's URL
    pop_metrics: dict[str, str] = field(default_factory=dict)  # PoP → its gateway's /metrics
    clients: dict[str, str] = field(default_factory=dict)  # client city → its Anycast URL
    anycast_url: str = ""  # the Anycast front's admin
    dns_name: str = ""
    dns_port: int = 0  # the first replica's
    dns_ports: list[int] = field(default_factory=list)  # every replica's, the first first
    limits: str = ""  # which limits mode is live, in words
    processes: list[ProcessRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackState:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unknown state version {data.get('version')!r}")
        fields = {k: v for k, v in data.items() if k != "version"}
        fields["supervisor"] = ProcessRecord(**fields["supervisor"])
        fields["processes"] = [ProcessRecord(**p) for p in fields.get("processes", [])]
        return cls(**fields)

    def running(self) -> list[ProcessRecord]:
        return [record for record in self.processes if record.is_running()]


class StateDir:
    """The files under one state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def state_path(self) -> Path:
        return self.root / STATE_FILE

    @property
    def tokens_path(self) -> Path:
        return self.root / TOKENS_FILE

    @property
    def db_path(self) -> Path:
        return self.root / "control-plane.db"

    @property
    def postgres_dir(self) -> Path:
        """The PostgreSQL cluster's directory. Run by root, the server runs as an unprivileged
        user (`stack/postgres.py`), which must enter every directory above it: where one above
        the state directory is closed to others (root's home is 0700), the cluster lives in the
        system's temp directory instead, under a name taken from the state directory's path."""
        inside = self.root / "postgres"
        if os.geteuid() != 0 or all(map(is_enterable_by_others, self.root.parents)):
            return inside
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"meridian-postgres-{digest}"

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def envoy_dir(self) -> Path:
        return self.root / "envoy"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def log_path(self, name: str) -> Path:
        return self.logs_dir / (name.replace(" ", "-") + ".log")

    def prepare(self) -> None:
        for path in (self.root, self.tls_dir, self.envoy_dir, self.logs_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)

    def read(self) -> StackState | None:
        """The recorded stack, or None if there is none; StackError if the file is damaged."""
        try:
            text = self.state_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StackError(f"cannot read {self.state_path}: {exc.strerror}") from exc
        try:
            return StackState.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            raise StackError(
                f"{self.state_path} is damaged ({exc}); check for leftover processes with "
                f"`ps`, then delete it"
            ) from exc

    def write(self, state: StackState) -> None:
        """Replace the state file atomically (readers never see half a file)."""
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.state_path)

    def clear(self) -> None:
        self.state_path.unlink(missing_ok=True)

    def write_tokens(self, tokens: dict[str, str]) -> None:
        self.tokens_path.unlink(missing_ok=True)
        fd = os.open(self.tokens_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.writelines(f"{name}={value}\n" for name, value in tokens.items())

    def read_tokens(self) -> dict[str, str]:
        try:
            lines = self.tokens_path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in lines if "=" in line)
