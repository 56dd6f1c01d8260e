"""Heartbeat: node agent → control plane (`POST /v1/nodes/heartbeat`), and the reply.

Versioned by `schema_version`; unknown fields are ignored so that either side can grow fields
without breaking the other. A receiver rejects a version it does not know (a breaking change bumps
it) and validates values: counts are non-negative and free KV blocks never exceed the total.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wire.prefix_key import MAX_HOT_PREFIXES, PrefixKey

HEARTBEAT_SCHEMA_VERSION: Final = 1

# A node or region name: lower-case DNS-label style, so it can appear in URLs, xDS names and DNS.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=63)]
MAX_URL_LEN = 2048
# The node agent names itself (its heartbeats' `node_id`) on every response, so that a gateway
# knows which node a stream comes from and can match it against the region summary's health.
NODE_ID_HEADER: Final = "x-meridian-node"


# An http(s) URL with a host; a pattern (not pydantic's HttpUrl) so the value travels byte for byte
# as the node sent it and the JSON schema states the rule for non-Python peers.
URL_PATTERN = r"^https?://[^\s/?#@]+([/?#]\S*)?$"
HttpUrlStr = Annotated[
    str,
    Field(
        min_length=8,
        max_length=MAX_URL_LEN,
        pattern=URL_PATTERN,
        examples=["http://127.0.0.1:9001"],
    ),
]
Count = Annotated[int, Field(ge=0, le=2**40)]
# A drain phase's name; a pattern rather than a fixed list, so new phases do not break old agents.
DrainPhaseName = Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]


class ModelIdentity(BaseModel):
    """What a node's model is, beyond the name it serves it under: two nodes continue each
    other's streams (a failover, a resume) only when their weights are the same."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # The weights' content: the first 16 bytes of the SHA-256 of the weights file(s), in hex
    # (node_agent/model_identity.py), so the same file under two names is the same weights.
    weights_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    context_length: Annotated[int, Field(ge=1, le=2**24)]  # the most tokens one request may hold
    dtype: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,16}$")]  # what it computes in: bf16, fp32
    quantization: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,16}$")]  # none, int8, q4_1

    @property
    def serving_key(self) -> str:
        """Equal for two nodes exactly when they write the same text: the same weights, kept
        and computed the same way (a Q4_1 file run as fp32 is other numbers)."""
        return f"{self.weights_id}:{self.quantization}:{self.dtype}"


class Heartbeat(BaseModel):
    """One capacity report from a node agent (sent every heartbeat interval, default 1 s)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = HEARTBEAT_SCHEMA_VERSION
    node_id: Name
    region: Name
    url: HttpUrlStr
    model: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
    # Optional: a node agent that does not send it serves weights no other node is known to share.
    model_identity: ModelIdentity | None = None
    tp_size: Annotated[int, Field(ge=1, le=1024)] = 1
    kv_blocks_total: Count
    kv_blocks_free: Count
    block_size: Annotated[int, Field(ge=1, le=2**20)]
    num_running: Count = 0
    num_waiting: Count = 0
    num_waiting_prefill_tokens: Count = 0  # prompt tokens of requests the engine has not admitted
    # Prompt tokens of admitted requests still to prefill (a chunked prefill under way, or queued
    # behind others in the batch): work ahead of a new request that the waiting count misses.
    num_running_prefill_tokens: Count = 0
    decode_tokens_per_s: Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)] = 0.0
    # Prompt tokens per second the node prefills (its measured rate, or its hardware's
    # calibration). Optional: gateways assume their own fleet-wide rate for a node without it.
    prefill_tokens_per_s: Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)] | None = None
    # Seconds a step takes besides its prompt tokens (the decodes it carries, launch, sampling),
    # as the node measures it lately; longer on a busier or slower node. Optional, as above.
    step_s: Annotated[float, Field(gt=0.0, le=1e3, allow_inf_nan=False)] | None = None
    draining: bool = False
    # False while the node's engine cannot serve (it died, or its core process does not answer:
    # stopped, or stuck in one step): the node is unhealthy, though it beats. Optional: an agent
    # that does not send it is judged by its beats alone.
    engine_alive: bool = True
    # Requests admitted and not yet answered in full (streams included), as the node's HTTP layer
    # counts them. Optional: without it the control plane uses num_running + num_waiting.
    num_in_flight: Count | None = None
    # The prefix keys (wire/prefix_key.py) of the requests this node served lately, sorted.
    # Optional: a node agent that does not send them adds nothing to its region's digest.
    hot_prefixes: tuple[PrefixKey, ...] = Field(default=(), max_length=MAX_HOT_PREFIXES)
    # Unix seconds at the node when the report was made (informational: health is judged by the
    # control plane's own clock when the beat arrives, so node clock skew cannot keep a node alive).
    timestamp: Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False)]

    @model_validator(mode="after")
    def _free_within_total(self) -> Heartbeat:
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError("kv_blocks_free must not exceed kv_blocks_total")
        return self


class HeartbeatReply(BaseModel):
    """What the control plane tells a node in answer to each heartbeat."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = HEARTBEAT_SCHEMA_VERSION
    # An operator asked this node to drain: stop admitting new requests, finish in-flight ones.
    drain: bool
    # The interval the control plane judges health by; a node missing 3 beats is unhealthy.
    heartbeat_interval_s: float
    # False when the node's region is not registered: the node is known but receives no traffic.
    region_registered: bool
    # The drain sequence (docs/control_plane.md, control_plane/drain.py). Optional fields, so a node
    # agent that does not know them keeps working. `drain_phase` is the step under way
    # (admissions, envoy, summaries, dns, consul, in_flight, exit, done), for logs.
    drain_phase: DrainPhaseName | None = None
    # From the consul step on: deregister this node's Consul service now and do not register it
    # again while draining (the control plane waits to see it gone from Consul).
    consul_deregister: bool = False
    # The node is out of every route and nothing it reported is in flight: exit (status 0) once
    # the requests it still holds are finished.
    may_exit: bool = False
