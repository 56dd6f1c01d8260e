"""Node agent settings: command-line flags > environment > YAML (`--config FILE`) > defaults.

Environment variables take the prefix `MERIDIAN_NODE_AGENT_` (`MERIDIAN_NODE_AGENT_PORT=9002`),
except the control-plane credential, which is `MERIDIAN_NODE_TOKEN` as for every service, the
token clients of the OpenAI API must present, `MERIDIAN_SERVING_TOKEN` (the gateways send the same
one), and the Consul token, `CONSUL_HTTP_TOKEN` as Consul's own tools read it. YAML keys are the
field names.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, FilePath, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from engine.config import EngineConfig
from engine.core_liveness import LivenessLimits
from engine.model_store import DEFAULT_MODEL
from wire.addresses import is_loopback_host
from wire.cache_events import stream_url
from wire.capacity import DEFAULT_MAX_NUM_WAITING_REQUESTS
from wire.control_plane_urls import ControlPlaneUrls
from wire.deflection import DEFAULT_DEFLECT_AT_WAITING
from wire.heartbeat import NAME_PATTERN

MIN_TOKEN_LEN = 16
_HTTP_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")


class NodeConfigError(ValueError):
    """A setting the node cannot run with; its message is one line for the operator."""


class NodeAgentSettings(BaseSettings):
    """Everything a node agent is told at start; built once in `__main__`, passed down."""

    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_NODE_AGENT_", validate_by_name=True, extra="forbid", frozen=True
    )

    config_file: Path | None = None

    # What to serve.
    model: str = DEFAULT_MODEL
    # The name clients put in `model` (default: the model name, or a path's file stem).
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=1024)
    dtype: str = "auto"
    # How the weights are kept (engine/config.py): as `dtype` ("none"), "int8" or a GGUF's own
    # Q4_1 blocks; auto: what the engine judges fastest here.
    quantization: Literal["auto", "none", "int8", "q4_1"] = "auto"
    block_size: int = Field(default=16, ge=1, le=1024)
    # The KV cache's element type (engine/config.py KV_CACHE_DTYPES): auto (the model's dtype)
    # or fp8, half of bf16's bytes: twice the blocks in kv_cache_gib.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    kv_cache_gib: float = Field(default=2.0, gt=0.0)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    # The most choices (OpenAI's `n`) one request may ask for; each is a sequence of the batch.
    max_num_choices: int = Field(default=8, ge=1, le=128)
    max_num_prefill_only_tokens: int | None = Field(default=2048, ge=1)
    # The engine core (scheduler and model stepping) in a process of its own, so that HTTP and
    # the event loop do not take cores from its threads; False: on a thread of this process.
    engine_process: bool = True
    # That process does not answer when it gives no sign of life for `engine_max_silence_s`
    # (stopped, frozen) or one step of its loop runs `engine_max_step_s`: the node then fails
    # its requests and reports itself unhealthy until it answers again (engine/core_liveness.py).
    engine_max_silence_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    engine_max_step_s: float = Field(default=60.0, gt=0.0, le=86400.0)

    # Where to listen, and who this node is.
    host: str = "127.0.0.1"
    port: int = Field(default=9001, ge=0, le=65535)
    region: str = Field(default="local", pattern=NAME_PATTERN, max_length=63)
    node_id: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=63)
    # The URL the control plane and Consul hand out for this node (default http://host:port).
    advertise_url: str | None = None
    # The bearer token every /v1 request must carry; required to listen beyond loopback.
    serving_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("MERIDIAN_SERVING_TOKEN"),
        min_length=MIN_TOKEN_LEN,
    )

    # What one connection and one request may hold (wire/connection_guard.py and
    # wire/request_limits.py): 413 past the body cap, 431 past the header cap, before any token
    # is checked. A gateway forwards bodies of up to its own cap (4 MiB) plus a continuation's
    # token ids, hence twice that here.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    max_header_bytes: int = Field(default=8 * 1024, ge=1024, le=1024 * 1024)
    # A connection's first request head must be complete this long after it is accepted, and
    # every head this long after its first byte.
    header_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    # The gateways keep idle connections to nodes for 4 s: closing at 5 s spares them a reuse
    # race.
    keepalive_timeout_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    # Gateways and Envoys open one connection per request in flight, and in a local stack they
    # all come from 127.0.0.1: the cap is far above what the node admits at once
    # (max_num_seqs + max_num_waiting_requests), against a runaway client. 0: no cap.
    max_connections_per_address: int = Field(default=4096, ge=0)

    # Admission control: requests queued or in prefill before new ones get 429.
    max_num_waiting_requests: int = Field(default=DEFAULT_MAX_NUM_WAITING_REQUESTS, ge=0)
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    # An early Envoy attempt is sent to another node (429, wire/deflection.py) once this many
    # requests here wait for their first token; 0: never.
    deflect_at_waiting: int = Field(default=DEFAULT_DEFLECT_AT_WAITING, ge=0)
    # How long a drain waits for in-flight requests before giving up on them, and how long an
    # exit (SIGTERM) waits for the control plane's `may_exit`.
    drain_timeout_s: float = Field(default=600.0, gt=0.0)

    # Control plane: a URL, or its replicas' URLs comma-separated (wire/control_plane_urls.py).
    control_plane: str | None = None
    # The CA that signed an https:// control plane's certificate (default: the system's CAs).
    control_plane_ca: FilePath | None = None
    node_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("MERIDIAN_NODE_TOKEN"),
        min_length=MIN_TOKEN_LEN,
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)
    heartbeat_timeout_s: float = Field(default=2.0, gt=0.0, le=60.0)
    max_heartbeat_backoff_s: float = Field(default=30.0, gt=0.0, le=600.0)

    # Consul (optional): `HOST:PORT` or `http(s)://HOST:PORT`.
    consul: str | None = None
    consul_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("CONSUL_HTTP_TOKEN")
    )
    consul_service_name: str = "meridian-node"

    # The region's picker (http(s):// or ws(s)://HOST:PORT): the node streams its prefix
    # cache's events to it (node_agent/cache_stream.py); unset, the engine records none.
    picker_url: str | None = None
    # Batches of events queued for a slow picker before they are dropped for a snapshot.
    cache_events_max_pending: int = Field(default=1024, ge=1, le=1_000_000)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = getattr(init_settings, "init_kwargs", {}).get("config_file")
        if config_file is not None:
            path = Path(config_file)
            if not path.is_file():
                raise NodeConfigError(f"--config {path}: no such file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @model_validator(mode="after")
    def _check(self) -> NodeAgentSettings:
        if self.control_plane is not None:
            try:  # one URL, or the replicas' URLs comma-separated: heartbeats fail over
                ControlPlaneUrls.parse(self.control_plane)
            except ValueError as exc:
                raise ValueError(f"control_plane: {exc}") from exc
            if self.node_token is None:
                raise ValueError("MERIDIAN_NODE_TOKEN must be set to report to a control plane")
        if self.serving_token is None and not is_loopback_host(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable beyond this machine: set "
                "MERIDIAN_SERVING_TOKEN so that only authenticated clients are served"
            )
        if self.advertise_url is not None and not _HTTP_URL.match(self.advertise_url):
            raise ValueError("advertise_url must be an http(s):// URL")
        if self.picker_url is not None:
            stream_url(self.picker_url)  # its ValueError names the rule
        if self.heartbeat_timeout_s > self.max_heartbeat_backoff_s:
            raise ValueError("heartbeat_timeout_s must not exceed max_heartbeat_backoff_s")
        return self

    @property
    def model_name(self) -> str:
        """The name this node serves its model under."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else self.model

    @property
    def resolved_node_id(self) -> str:
        if self.node_id is not None:
            return self.node_id
        host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "node"
        return f"{host[:50]}-{self.port}"

    @property
    def url(self) -> str:
        if self.advertise_url is not None:
            return self.advertise_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def engine_liveness(self) -> LivenessLimits:
        """When the engine core process counts as not answering."""
        return LivenessLimits(self.engine_max_silence_s, self.engine_max_step_s)

    def engine_config(self) -> EngineConfig:
        """The engine's settings."""
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            quantization=self.quantization,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_kv_cache_gib=self.kv_cache_gib,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_prefill_only_tokens=self.max_num_prefill_only_tokens,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
