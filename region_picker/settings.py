"""The picker's settings: flags, else MERIDIAN_PICKER_* environment variables, else defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from wire.addresses import is_loopback_host
from wire.heartbeat import NAME_PATTERN

DEFAULT_PORT = 9100  # gRPC, for Envoy's ext_proc filter
DEFAULT_METRICS_PORT = 9101
DEFAULT_CACHE_EVENTS_PORT = 9102  # the nodes' cache event streams (websocket)


class PickerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_PICKER_", validate_by_name=True, extra="forbid", frozen=True
    )

    region: str = Field(pattern=NAME_PATTERN, max_length=63)
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    # Where the nodes stream their prefix caches' events (on `host`; their --picker-url).
    cache_events_port: int = Field(default=DEFAULT_CACHE_EVENTS_PORT, ge=0, le=65535)
    control_plane: str
    # The gateways' read-only token: the picker watches what gateways watch, per node.
    gateway_token: SecretStr = Field(
        validation_alias=AliasChoices("MERIDIAN_GATEWAY_TOKEN", "gateway_token"), min_length=1
    )
    # The nodes' serving token (the gateways' to them): a node's cache stream presents it, and
    # one without it is refused, since a forged stream would steer the picker's choices.
    # Unset, any stream is taken: only while `host` is loopback.
    serving_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("MERIDIAN_SERVING_TOKEN", "serving_token"),
        min_length=1,
    )
    # Served model name → its checkpoint (a model store name or a path), for the tokenizer.
    # A model not listed is picked for by load alone.
    models: dict[str, str] = Field(default_factory=dict)
    # (node, block) pairs the approximate cache view remembers.
    routed_blocks: int = Field(default=1_000_000, ge=1)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _check(self) -> PickerSettings:
        if self.serving_token is None and not is_loopback_host(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable beyond this machine: set "
                "MERIDIAN_SERVING_TOKEN so that only the region's nodes stream their caches"
            )
        return self
