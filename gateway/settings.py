"""Gateway settings: command-line flags > environment (`MERIDIAN_GATEWAY_*`) > defaults.

The control-plane credential is `MERIDIAN_GATEWAY_TOKEN`, as for every service; the one nodes
ask of the gateway is `MERIDIAN_SERVING_TOKEN`. Built once in `__main__` (or by a test) and
passed down as `create_app(settings)`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from wire.addresses import is_loopback_host
from wire.control_plane_urls import ControlPlaneUrls
from wire.geo import LOCATIONS
from wire.heartbeat import NAME_PATTERN

MIN_TOKEN_LEN = 16
_HTTP_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_REDIS_URL = re.compile(r"^(redis|rediss|unix)://\S+$")

TlsMode = Literal["files", "self-signed", "plain"]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_GATEWAY_", validate_by_name=True, extra="forbid", frozen=True
    )

    # Who and where this gateway is: the PoP name is looked up in the shared location table.
    pop: str = Field(pattern=NAME_PATTERN, max_length=63)
    host: str = "127.0.0.1"
    port: int = Field(default=8443, ge=0, le=65535)

    # TLS: a certificate and key by path, a self-signed one made at start, or plain HTTP.
    tls_mode: TlsMode = "self-signed"
    tls_cert: Path | None = None
    tls_key: Path | None = None

    control_plane: str
    # The CA that signed an https:// control plane's certificate (default: the system's CAs).
    control_plane_ca: FilePath | None = None
    gateway_token: SecretStr = Field(
        validation_alias=AliasChoices("MERIDIAN_GATEWAY_TOKEN", "gateway_token"),
        min_length=MIN_TOKEN_LEN,
    )
    # Sent to nodes as `Authorization: Bearer ...` on every upstream request (none if unset).
    serving_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("MERIDIAN_SERVING_TOKEN", "serving_token"),
        min_length=1,
    )
    # Longest wait of one blocking query; the control plane answers sooner on any change.
    watch_wait_s: float = Field(default=30.0, gt=0.0, le=300.0)
    max_watch_backoff_s: float = Field(default=5.0, gt=0.0, le=60.0)

    # This PoP's buckets, shared by all its gateway processes (else each process's own).
    redis: str | None = None
    # After a Redis failure, limit in this process for this long before trying Redis again.
    redis_cooldown_s: float = Field(default=5.0, gt=0.0, le=600.0)
    # How often this PoP reports what each key asked of it and gets its shares of the keys'
    # limits back (gateway/limit_reports.py): it bounds how far the PoPs together overshoot.
    limit_report_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)

    # Tenants' prompts share nodes' prefix caches only if the operator says so: otherwise each
    # key's requests carry their own cache salt, so that timing cannot tell one tenant whether
    # another sent the same prefix.
    share_prefix_cache: bool = False

    # Tokens reserved for a request that gives no max_tokens (and injected upstream as its cap,
    # so that the reservation always covers what the request may use).
    default_max_tokens: int = Field(default=1024, ge=1, le=1_000_000)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)

    # What one client connection may hold (gateway/http_limits.py, wire/connection_guard.py): 431
    # past the header cap (the same at every service), a TLS handshake and a connection's first
    # request head bounded from accept, later ones by the keep-alive timeout (aiohttp's timer
    # runs from the previous answer to the next complete head), which is longer than the common
    # clients' pools keep idle connections (httpx 5 s, aiohttp 15 s).
    max_header_bytes: int = Field(default=8 * 1024, ge=1024, le=1024 * 1024)
    tls_handshake_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    header_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    keepalive_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    # Clients behind one NAT share an address; the bench opens a few hundred from one. 0: no cap
    # (behind a proxy that all clients share the address of).
    max_connections_per_address: int = Field(default=1024, ge=0)

    # Upstream timeouts. A connect is one round trip: a region's gets `connect_timeout_rtts` of
    # its expected RTT (wire/geo.py), within [min_connect_timeout_s, connect_timeout_s], so that
    # a dark region costs a fraction of a second, not the whole ceiling.
    connect_timeout_s: float = Field(default=2.0, gt=0.0, le=60.0)
    connect_timeout_rtts: float = Field(default=3.0, ge=1.0, le=1000.0)
    min_connect_timeout_s: float = Field(default=0.25, gt=0.0, le=60.0)
    # A request's whole budget, failover included; the first byte must come within it.
    request_deadline_s: float = Field(default=600.0, gt=0.0, le=3600.0)
    # A stream's first chunk must come within this (else the next region is tried). A
    # non-stream's first byte is its whole answer: it gets this plus its max_tokens at
    # `min_decode_tokens_per_s`, the slowest decoding a healthy node is expected to manage.
    first_byte_timeout_s: float = Field(default=15.0, gt=0.0, le=3600.0)
    min_decode_tokens_per_s: float = Field(default=5.0, gt=0.0)
    # Longest silence between two chunks of a stream before it is ended with an error event.
    stream_idle_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    # ... but only this long while the control plane reports the stream's node unhealthy, or
    # its region with no healthy node (a node hung with the connection open: its heartbeats
    # stopped too; the node names itself in each response's X-Meridian-Node).
    unhealthy_node_silence_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    max_attempts: int = Field(default=3, ge=1, le=10)
    # A stream that breaks after its first chunk (connection lost, silent past the limits
    # above, an error event) continues in the next region, at most this many
    # times within request_deadline_s (0: end it with an error event instead).
    max_resumes: int = Field(default=2, ge=0, le=10)
    # Send each stream's prompt (one output token, not streamed) to the region it would resume
    # in, at its first chunk, so that a continuation there finds the prompt in the prefix cache
    # (gateway/prewarm.py): a shorter resume gap for twice the prompts' prefill.
    resume_prewarm: bool = False

    # Circuit breaker per region.
    breaker_failures: int = Field(default=5, ge=1, le=1000)
    breaker_open_s: float = Field(default=5.0, gt=0.0, le=600.0)

    # Routing: a fallback prefill rate (tokens/s at one node) until summaries carry one, and how
    # fast the observed-TTFT correction forgets.
    prefill_tokens_per_s: float = Field(default=4000.0, gt=0.0)
    ttft_ewma_alpha: float = Field(default=0.2, gt=0.0, le=1.0)
    ttft_correction_half_life_s: float = Field(default=30.0, gt=0.0)
    # Absolute slack (on top of the policy's relative tolerance) for "near-best" regions.
    near_best_slack_s: float = Field(default=0.002, ge=0.0, le=10.0)

    # This PoP's own path to each region (region → URL), over the registered ingress URL.
    region_ingress: dict[str, str] = Field(default_factory=dict)
    # The model alias `auto`: the model it means at the regions (unset: no alias).
    auto_model: str | None = Field(default=None, min_length=1)
    # An edge node agent beside this PoP for light `auto` requests (gateway/edge.py), the model
    # it serves (default: auto_model) and the classifier's thresholds (gateway/tiers.py).
    edge_url: str | None = None
    edge_model: str | None = Field(default=None, min_length=1)
    edge_max_tokens: int = Field(default=64, ge=1, le=1_000_000)
    edge_max_prompt_tokens: int = Field(default=256, ge=1, le=10_000_000)
    edge_max_concurrency: int = Field(default=4, ge=1, le=100_000)
    # Per API key id: never the edge (forbid), or the edge whatever the size (force).
    edge_policy: dict[str, Literal["forbid", "force"]] = Field(default_factory=dict)

    # Prometheus `/metrics` on its own plain-HTTP listener (gateway/metrics_listener.py), never
    # on the public port; off loopback only with a token, which scrapes then send as a bearer
    # token. Counts are by API key only if asked: such labels list the tenants and their volume.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    metrics_token: SecretStr | None = Field(default=None, min_length=MIN_TOKEN_LEN)
    metrics_key_labels: bool = False

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    access_log: bool = True
    # Move what start-up allocated out of the garbage collector's way (off in tests, which run
    # many gateways in one process).
    freeze_gc: bool = True

    @field_validator("region_ingress", "edge_policy", mode="before")
    @classmethod
    def _pairs(cls, value: object) -> object:
        """`NAME=VALUE` strings (repeated flags) as a mapping."""
        if not isinstance(value, list):
            return value
        pairs = {}
        for item in value:
            name, sep, rest = str(item).partition("=")
            if not sep or not name or not rest:
                raise ValueError(f"expected NAME=VALUE, got {item!r}")
            pairs[name] = rest
        return pairs

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        bad = [
            url
            for url in (*self.region_ingress.values(), self.edge_url or "")
            if url and not _HTTP_URL.match(url)
        ]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an http(s):// URL")
        if self.min_connect_timeout_s > self.connect_timeout_s:
            raise ValueError("min_connect_timeout_s must not exceed connect_timeout_s")
        if self.edge_url is not None and self.auto_model is None:
            raise ValueError("--edge-url needs --auto-model (the edge answers only `auto`)")
        if self.pop not in LOCATIONS:
            raise ValueError(
                f"pop {self.pop!r} is not in the location table; known: {', '.join(LOCATIONS)}"
            )
        try:  # one URL, or the replicas' URLs comma-separated: the watches fail over
            urls = ControlPlaneUrls.parse(self.control_plane)
        except ValueError as exc:
            raise ValueError(f"control_plane: {exc}") from exc
        if not all(_is_safe_control_plane(url) for url in urls.urls):
            raise ValueError(
                "control_plane must be https:// unless it is on loopback: the gateway's token "
                "and every API key's hash would cross the network in the clear"
            )
        if self.metrics_token is None and not is_loopback_host(self.metrics_host):
            raise ValueError(
                "metrics off loopback need MERIDIAN_GATEWAY_METRICS_TOKEN: without it anyone "
                "who reaches the address could list the tenants and watch their volume"
            )
        if self.redis is not None and not _REDIS_URL.match(self.redis):
            raise ValueError("redis must be a redis://, rediss:// or unix:// URL")
        has_files = self.tls_cert is not None or self.tls_key is not None
        if self.tls_mode == "files":
            if self.tls_cert is None or self.tls_key is None:
                raise ValueError("--tls-cert and --tls-key must be given together")
        elif has_files:
            raise ValueError(f"--tls-cert/--tls-key cannot be combined with {self.tls_mode}")
        return self

    @property
    def serving_authorization(self) -> str | None:
        """The `Authorization` header value for nodes, if they ask for a token."""
        if self.serving_token is None:
            return None
        return "Bearer " + self.serving_token.get_secret_value()

    @property
    def control_plane_url(self) -> str:
        """The control plane's URL(s), as given (for logs)."""
        return str(ControlPlaneUrls.parse(self.control_plane))

    @property
    def scheme(self) -> str:
        return "http" if self.tls_mode == "plain" else "https"


def _is_safe_control_plane(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "https" or is_loopback_host(parts.hostname or "")
