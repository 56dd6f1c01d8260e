"""What one node agent holds while it runs: settings, engine, admission, drain, metrics.

Built in `create_app` (so a server can hook into it before start-up); the app's lifespan loads
the engine into it and starts the background loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.async_engine import AsyncEngine
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.core_client import DEFAULT_LIVENESS, EngineCoreClient
from engine.core_liveness import LivenessLimits
from engine.llm_engine import EngineStats
from node_agent.admission import Admission, Ticket
from node_agent.drain import Drain
from node_agent.errors import ModelNotFoundError, UnavailableError
from node_agent.hot_prefixes import HotPrefixes
from node_agent.metrics import NodeMetrics
from node_agent.model_identity import model_identity, weights_id_of
from node_agent.serving import Serving
from node_agent.settings import NodeAgentSettings
from wire.heartbeat import Heartbeat, HeartbeatReply, ModelIdentity

logger = logging.getLogger(__name__)

CONTROL_PLANE_DRAIN = "the control plane asked"


def load_engine(
    config: EngineConfig, separate_process: bool, liveness: LivenessLimits = DEFAULT_LIVENESS
) -> AsyncEngine:
    """The engine core in a process of its own (the default; watched for signs of life by
    `liveness`), or on a thread of this one."""
    if separate_process:
        return EngineCoreClient.from_config(config, liveness)
    return AsyncLLM.from_config(config)


class NodeRuntime:
    def __init__(self, settings: NodeAgentSettings):
        self.settings = settings
        self.model_name = settings.model_name
        self.node_id = settings.resolved_node_id
        self.started_at = int(time.time())
        self.llm: AsyncEngine | None = None
        # What the loaded model is (its heartbeats carry it); None until loaded, or for an
        # engine attached without its weights' id.
        self.model_identity: ModelIdentity | None = None
        self.serving: Serving | None = None
        self.load_error: BaseException | None = None
        self.admission = Admission(
            settings.max_num_waiting_requests, settings.retry_after_s, settings.deflect_at_waiting
        )
        self.drain = Drain(self.admission, settings.drain_timeout_s)
        self.metrics = NodeMetrics(self.model_name, self.stats)
        self.hot_prefixes = HotPrefixes()  # the system prompts served lately, for the beats
        # Set by whoever runs the server: ends the process (after a drain, or a failed load).
        self.stop_server: Callable[[], None] | None = None
        self.drain.on_drained = self._request_stop
        # Whether the last heartbeat reached the control plane (the heartbeat loop keeps it).
        self.control_plane_reachable = False
        self.drain.control_plane_reachable = lambda: self.control_plane_reachable
        # The control plane said `consul_deregister` during this drain: stay out of Consul.
        self.consul_withdrawn = False

    # --- engine ---

    async def load(self) -> None:
        """Identify the weights and load the engine in a thread (seconds); on failure, record it
        and stop the server."""
        try:
            weights_id, llm = await asyncio.to_thread(self._load)
        except Exception as exc:  # any load failure ends the node; it is reported, not raised
            logger.error("could not load %s: %s", self.settings.model, exc)
            self.load_error = exc
            self._request_stop()
            return
        llm.start()
        self.attach(llm, weights_id)

    def _load(self) -> tuple[str, AsyncEngine]:
        weights_id = weights_id_of(self.settings.model)
        settings = self.settings
        llm = load_engine(
            settings.engine_config(), settings.engine_process, settings.engine_liveness()
        )
        return weights_id, llm

    def attach(self, llm: AsyncEngine, weights_id: str | None) -> None:
        """Serve with `llm`, loaded from weights of `weights_id` (None: not known)."""
        self.llm = llm
        self.serving = Serving(llm, self.model_name, self.settings.max_num_choices)
        if weights_id is not None:
            self.model_identity = model_identity(weights_id, llm)
        stats = llm.stats()
        logger.info(
            "serving %s as %r: %d KV blocks of %d tokens, context %d tokens, %s",
            self.settings.model,
            self.model_name,
            stats.kv_blocks_total,
            stats.block_size,
            llm.max_model_len,
            self.model_identity or "weights not identified",
        )

    def stats(self) -> EngineStats | None:
        return self.llm.stats() if self.llm is not None else None

    @property
    def is_engine_dead(self) -> bool:
        return self.llm is not None and not self.llm.is_running

    @property
    def is_ready(self) -> bool:
        return self.not_ready_reason() is None

    def health_problem(self) -> str | None:
        """Why this node cannot serve whatever it is asked (None: it can)."""
        if self.load_error is not None:
            return "the model failed to load"
        if self.is_engine_dead:
            return "the engine has stopped"
        if self.llm is not None and self.llm.unresponsive_reason is not None:
            return f"the engine core does not answer: {self.llm.unresponsive_reason}"
        return None

    def not_ready_reason(self) -> str | None:
        problem = self.health_problem()
        if problem is not None:
            return problem
        if self.llm is None:
            return "the model is loading"
        if self.drain.is_draining:
            return "the node is draining"
        return None

    # --- admission ---

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.settings.model):
            raise ModelNotFoundError(
                f"The model {name!r} does not exist on this node; it serves {self.model_name!r}",
                param="model",
            )

    def admit(self, attempt: int | None = None) -> tuple[Serving, Ticket]:
        """A place for a new request, or the error that refuses it (503 or 429); `attempt` is
        Envoy's attempt number (None when not sent through Envoy)."""
        reason = self.not_ready_reason()
        if reason is not None or self.serving is None:
            self.metrics.count_rejected(503)
            code = "draining" if self.drain.is_draining else "not_ready"
            raise UnavailableError(f"{reason or 'not ready'}; try another node", code=code)
        stats = self.stats()
        try:
            ticket = self.admission.admit(stats.num_waiting if stats is not None else 0, attempt)
        except Exception:
            self.metrics.count_rejected(429)
            raise
        return self.serving, ticket

    # --- control plane ---

    def heartbeat(self) -> Heartbeat | None:
        """This node's capacity report; None until the model is loaded."""
        stats = self.stats()
        if stats is None:
            return None
        return Heartbeat(
            node_id=self.node_id,
            region=self.settings.region,
            url=self.settings.url,
            model=self.model_name,
            model_identity=self.model_identity,
            tp_size=self.settings.tensor_parallel_size,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=min(stats.kv_blocks_free, stats.kv_blocks_total),
            block_size=stats.block_size,
            num_running=stats.num_running,
            num_waiting=self.admission.queue_depth(stats.num_waiting),
            num_waiting_prefill_tokens=stats.num_waiting_prefill_tokens,
            num_running_prefill_tokens=stats.num_running_prefill_tokens,
            decode_tokens_per_s=max(stats.decode_tokens_per_s, 0.0),
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            step_s=stats.step_s,
            draining=self.drain.is_draining or self.is_engine_dead,
            engine_alive=self.health_problem() is None,
            num_in_flight=self.admission.num_in_flight,
            hot_prefixes=self.hot_prefixes.hot(),
            timestamp=time.time(),
        )

    def on_heartbeat_reply(self, reply: HeartbeatReply) -> None:
        """Follow the control plane's drain sequence: drain, consul_deregister, may_exit."""
        wants_drain = reply.drain or reply.consul_deregister or reply.may_exit
        if wants_drain and not self.drain.is_draining:
            self.drain.begin(CONTROL_PLANE_DRAIN, exit_when_drained=False)
        elif not wants_drain and self.drain.reason == CONTROL_PLANE_DRAIN:
            self.drain.cancel()
        if reply.consul_deregister and self.drain.is_draining:
            if not self.consul_withdrawn:
                logger.info("the control plane asked to leave Consul")
            self.consul_withdrawn = True
        elif not self.drain.is_draining:
            self.consul_withdrawn = False
        if reply.may_exit:
            self.drain.allow_exit()

    def _request_stop(self) -> None:
        if self.stop_server is not None:
            self.stop_server()
