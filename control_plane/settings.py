"""Control-plane settings: command-line arguments > environment > defaults, validated at start."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from control_plane.consul_sync import parse_consul_addr
from control_plane.dns.config import DnsConfig
from control_plane.limit_shares import LimitSharesConfig
from control_plane.picker_address import picker_address
from control_plane.store.base import is_postgres_url
from control_plane.upstream_urls import UpstreamAllowlist
from wire.addresses import is_loopback_host

MIN_TOKEN_LEN = 16
MEMORY_DB = ":memory:"


def _token_field(env_name: str) -> SecretStr | None:
    return Field(None, validation_alias=AliasChoices(env_name), min_length=MIN_TOKEN_LEN)


class DrainConfig(BaseModel):
    """Bounds on the drain sequence's waits (control_plane/drain.py); a step that runs out of time
    is recorded as timed out and the sequence goes on. The wait for the node to report draining
    is bounded by `unhealthy_after_s`, the DNS wait is one DNS TTL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    envoy_ack_timeout_s: float = Field(default=5.0, gt=0.0, le=600.0)
    consul_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    in_flight_timeout_s: float = Field(default=900.0, gt=0.0, le=86400.0)


class Settings(BaseSettings):
    """One settings object for the control plane, built once in `__main__`."""

    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_CP_", validate_by_name=True, extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    xds_port: int = Field(default=18000, ge=0, le=65535)  # ADS for Envoy, on `host`; 0: any free
    dns_port: int = Field(default=8053, ge=0, le=65535)  # UDP, on `host`; 0: any free
    dns: DnsConfig = Field(default_factory=DnsConfig)  # zone, TTL, subnets, shedding
    drain: DrainConfig = Field(default_factory=DrainConfig)  # bounds on the drain sequence's waits
    # Gateway PoPs' shares of each key's limits (control_plane/limit_shares.py).
    limit_shares: LimitSharesConfig = Field(default_factory=LimitSharesConfig)
    # Consul (optional): `HOST:PORT` or `http(s)://HOST:PORT`; node agents found there are merged
    # with heartbeats. Its ACL token, if any, comes from CONSUL_HTTP_TOKEN (read by py-consul).
    consul_addr: str | None = None
    consul_service_name: str = Field(default="meridian-node", min_length=1, max_length=128)
    # A SQLite file (the embedded default), or a `postgresql://` URL that replicas share.
    db_path: str = "meridian-control-plane.db"
    # TLS (PEM files) for the admin API and the xDS port alike; both or neither. Without them
    # bearer tokens cross the network in the clear: fine on loopback only.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # How long a write waits for a lock another connection holds before answering 503.
    db_busy_timeout_s: float = Field(default=5.0, gt=0.0, le=60.0)

    # Bearer tokens, read from MERIDIAN_ADMIN_TOKEN / MERIDIAN_GATEWAY_TOKEN. Node agents have
    # none in common: each has its own credential, minted through the admin API.
    admin_token: SecretStr | None = _token_field("MERIDIAN_ADMIN_TOKEN")
    gateway_token: SecretStr | None = _token_field("MERIDIAN_GATEWAY_TOKEN")
    # Where tokens generated on loopback are kept (default: next to the database, `<db>.tokens`).
    token_file: Path | None = None

    heartbeat_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)
    # A node that has not been heard from for `missed_beats` intervals is unhealthy.
    missed_beats: int = Field(default=3, ge=1, le=100)
    # A restarted control plane keeps the nodes that were beating healthy (with their last
    # capacity) for this many heartbeat timeouts, so gateways do not see an empty fleet while
    # nodes come back to it (control_plane/health_snapshot.py). 0: every node starts unhealthy.
    restart_grace_timeouts: float = Field(default=3.0, ge=0.0, le=100.0)
    # Replicas on PostgreSQL: each one's name (in logs and the leader lease; default
    # `<host>-<pid>`), and how long a leader's lease lasts unrenewed before another takes over.
    replica_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        min_length=1,
        max_length=128,
    )
    leader_lease_s: float = Field(default=3.0, ge=0.5, le=60.0)
    # How often health is re-judged and summaries recomputed; bounds how late a gateway hears of
    # a change caused by time passing (a node going silent), so keep it well under a second.
    sweep_interval_s: float = Field(default=0.25, gt=0.0, le=1.0)
    # Caps checked before routing (wire/request_limits.py): 413 and 431 past them. The biggest
    # legitimate bodies (a routing policy, a region) are a few KiB; headers are the same cap as
    # at the gateway and the nodes.
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    max_header_bytes: int = Field(default=8 * 1024, ge=1024, le=1024 * 1024)
    # Bounds on connections (wire/connection_guard.py): a TLS handshake, a connection's first
    # request head (from accept) and every head (from its first byte), and idle keep-alive.
    tls_handshake_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    header_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    keepalive_timeout_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    # Nodes hold one connection each (heartbeats), gateways a few (watches); behind a NAT a
    # region's nodes share one address. 0: no cap.
    max_connections_per_address: int = Field(default=512, ge=0)
    # The hosts region ingresses and node addresses may name (control_plane/upstream_urls.py): IP
    # networks and DNS names (a name allows its subdomains), comma-separated in the environment.
    # Empty: any URL that passes the rule (http(s)://HOST[:PORT], no link-local address...).
    allowed_upstreams: Annotated[tuple[str, ...], NoDecode] = ()
    # Refused calls (401, 403, refused xDS streams) written to the log and the audit log in a
    # minute, per client address and in all (control_plane/refusals.py); the rest are counted
    # and summed up in one entry when the minute ends.
    max_refusals_audited_per_address: int = Field(default=10, ge=0, le=10_000)
    max_refusals_audited: int = Field(default=100, ge=0, le=100_000)
    # Upper bound on a blocking query's `wait` (Consul caps at 10 minutes).
    max_wait_s: float = Field(default=300.0, gt=0.0, le=600.0)
    # Regions with an endpoint picker (region_picker/), and where it listens ("IP:PORT"): their
    # ingress Envoys ask it which node takes each request (control_plane/xds/picker.py).
    region_pickers: dict[str, str] = Field(default_factory=dict)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("region_pickers")
    @classmethod
    def _valid_pickers(cls, pickers: dict[str, str]) -> dict[str, str]:
        for region, address in pickers.items():
            if picker_address(address) is None:
                raise ValueError(f"the picker of {region!r} is IP:PORT, not {address!r}")
        return pickers

    @property
    def pickers(self) -> dict[str, tuple[str, int]]:
        """`region_pickers` as the xDS plan takes them."""
        return {region: picker_address(a) or ("", 0) for region, a in self.region_pickers.items()}

    @field_validator("consul_addr")
    @classmethod
    def _valid_consul_addr(cls, addr: str | None) -> str | None:
        if addr is not None:
            parse_consul_addr(addr)
        return addr

    @field_validator("allowed_upstreams", mode="before")
    @classmethod
    def _split_upstreams(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("allowed_upstreams")
    @classmethod
    def _valid_upstreams(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        UpstreamAllowlist.parse(entries)
        return entries

    @property
    def upstream_allowlist(self) -> UpstreamAllowlist:
        return UpstreamAllowlist.parse(self.allowed_upstreams)

    @model_validator(mode="after")
    def _tls_files_together(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        for name, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {path}: no such file")
        return self

    @property
    def is_tls(self) -> bool:
        return self.tls_cert is not None

    @model_validator(mode="after")
    def _tokens_required_off_loopback(self) -> Settings:
        tokens = {
            "MERIDIAN_ADMIN_TOKEN": self.admin_token,
            "MERIDIAN_GATEWAY_TOKEN": self.gateway_token,
        }
        missing = [name for name, value in tokens.items() if value is None]
        if missing and not is_loopback_host(self.host):
            raise ValueError(
                f"{', '.join(missing)} must be set to serve on non-loopback host {self.host!r}"
            )
        values = [v.get_secret_value() for v in tokens.values() if v is not None]
        if len(set(values)) != len(values):
            raise ValueError("the admin and gateway tokens must differ")
        return self

    @property
    def unhealthy_after_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_beats

    @property
    def restart_grace_s(self) -> float:
        return self.unhealthy_after_s * self.restart_grace_timeouts

    @property
    def resolved_token_file(self) -> Path:
        if self.token_file is not None:
            return self.token_file
        if self.db_path == MEMORY_DB or is_postgres_url(self.db_path):
            return Path("meridian-control-plane.tokens")
        return Path(self.db_path + ".tokens")
