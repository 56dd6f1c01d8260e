"""`meridian up`: the whole local fleet, in order, each part waited on until it is ready.

1. checks: the config, Envoy (auto: warn and go on without it, unless a region serves several
   models), no stack already running, every port free, the models (pulled if missing, with
   progress);
2. the control plane (a fresh SQLite database: the YAML is the fleet's source of truth), or with
   `control_plane: {replicas: N, db: postgres}` a fresh PostgreSQL in the state directory and N
   replicas on it; then the regions registered through its admin API with their ingress URLs,
   and the models, their fallbacks and aliases in its catalog;
3. the node agents (and edge node agents beside PoPs), the region Envoys (bootstrapped by
   `envoy-bootstrap`) and endpoint pickers (`picker: on`), the RTT proxy (a route per PoP and
   region), the redis-server of shared limits, a gateway per PoP (HTTPS on its own loopback
   address, with its certificate from the stack CA) and the Anycast front, all at once; each is
   ready when its health says so (`/ready`, a heartbeat seen by the control plane, a request
   through Envoy and the RTT proxy, a picker's /metrics, each gateway's `/health` with every
   region healthy, the front's admin);
4. a fresh API key, checked through every PoP; then the URLs, key, CA path and examples.

Then it stays in the foreground, saying when a process exits, until Ctrl-C or SIGTERM (which
`meridian down` sends) stops everything it started, in order; with `--detach` it returns instead
and `meridian down` stops the recorded processes itself.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from control_plane.admin_cli import AdminClient
from stack import commands
from stack.certs import GatewayTls, ensure_pop_tls
from stack.config import DEFAULT_CONFIG, StackConfig, load_config
from stack.envoy_bootstraps import write_envoy_bootstraps
from stack.errors import StackError
from stack.interrupts import Interrupted, no_interrupts, signals_interrupt
from stack.layout import StackLayout, check_ports_free, plan_layout
from stack.postgres import LocalPostgres
from stack.preflight import (
    check_not_running,
    ensure_kernels,
    ensure_model,
    find_envoy,
    find_postgres,
    find_redis,
    fresh_tokens,
    locked,
)
from stack.probes import HttpProbes, port_is_open, postgres_accepts
from stack.registration import Credentials, create_api_key, register_models, register_regions
from stack.state import ProcessRecord, StackState, StateDir, process_start_time
from stack.summary import limits_mode, render_summary
from stack.supervisor import ReadyCheck, Say, Supervisor

CONTROL_PLANE_TIMEOUT_S: Final = 60.0
NODE_TIMEOUT_S: Final = 240.0  # model load on a busy machine, several nodes at once
DOWNSTREAM_TIMEOUT_S: Final = 300.0  # Envoy, proxy, gateway: they wait on the nodes
REDIS_TIMEOUT_S: Final = 30.0
KEY_TIMEOUT_S: Final = 30.0
WATCH_INTERVAL_S: Final = 0.5


@dataclass(frozen=True, slots=True)
class UpOptions:
    config_path: Path | None
    state_dir: Path
    detach: bool = False


def _remove_database(db_path: Path) -> None:
    for suffix in ("", "-wal", "-shm", ".tokens"):
        Path(str(db_path) + suffix).unlink(missing_ok=True)


class StackStarter:
    """One run of `meridian up`, from checks to the printed summary."""

    def __init__(self, config: StackConfig, options: UpOptions, say: Say) -> None:
        self.config = config
        self.options = options
        self.say = say
        self.state_dir = StateDir(options.state_dir)
        self.envoy_path = find_envoy(config.envoy, say)
        self.redis_path = find_redis(config.limits, say)
        find_postgres(config.control_plane.db)  # a machine without it hears so before anything
        self.layout: StackLayout = plan_layout(
            config, use_envoy=self.envoy_path is not None, has_redis=self.redis_path is not None
        )
        self.tokens = fresh_tokens()
        self.credentials = Credentials()  # minted at registration
        self._probes: HttpProbes | None = None  # once prepare() has made the stack's CA
        self.tls: dict[str, GatewayTls] = {}  # by PoP
        self.api_key = ""

    def close(self) -> None:
        if self._probes is not None:
            self._probes.close()

    @property
    def probes(self) -> HttpProbes:
        assert self._probes is not None, "prepare() makes the probes"
        return self._probes

    # --- checks, before anything starts ---

    def prepare(self) -> StackState:
        check_not_running(self.state_dir)
        check_ports_free(self.layout)
        sources = [model.weights for model in self.config.fleet_models]
        if self.config.edge is not None:
            sources.append(self.config.edge.model)
        for source in dict.fromkeys(sources):
            ensure_model(source, self.say)
        ensure_kernels(self.say)
        names = {
            pop.name: (pop.address, self.layout.dns_name, f"{pop.name}.{self.layout.dns_name}")
            for pop in self.layout.pops
        }
        self.tls = ensure_pop_tls(self.state_dir.tls_dir, names)
        self._probes = HttpProbes(self.layout, self.tokens[commands.ADMIN_TOKEN], self.ca_cert)
        _remove_database(self.state_dir.db_path)
        shutil.rmtree(self.state_dir.postgres_dir, ignore_errors=True)
        self.state_dir.write_tokens(self.tokens)
        me = ProcessRecord(
            "meridian up", "supervisor", os.getpid(), process_start_time(os.getpid()) or "", ""
        )
        state = StackState(
            supervisor=me,
            config=str(self.options.config_path or DEFAULT_CONFIG),
            detached=self.options.detach,
            control_plane_url=self.layout.control_plane_url,
            control_planes={replica.name: replica.url for replica in self.layout.control_planes},
            gateway_url=self.layout.gateway_url,
            ca_cert=str(self.ca_cert),
            pops={pop.name: pop.url for pop in self.layout.pops},
            pop_metrics={pop.name: pop.metrics_url for pop in self.layout.pops},
            clients={client.city: client.url for client in self.layout.clients},
            anycast_url=self.layout.anycast_admin_url or "",
            dns_name=self.layout.dns_name,
            dns_port=self.layout.dns_port,
            dns_ports=[replica.dns_port for replica in self.layout.control_planes],
            limits=limits_mode(self.layout),
        )
        self.state_dir.write(state)
        return state

    @property
    def ca_cert(self) -> Path:
        return next(iter(self.tls.values())).ca_cert

    # --- the steps ---

    def start_postgres(self, supervisor: Supervisor) -> None:
        """A fresh cluster in the state directory, its server a supervised child."""
        port = self.layout.postgres_port
        assert port is not None and self.layout.postgres_url is not None
        server = LocalPostgres(self.state_dir.postgres_dir, port)
        if os.geteuid() == 0:
            # The server runs as `postgres`: it must enter the state directory (entering only,
            # not listing; the tokens file stays 0600).
            self.state_dir.root.chmod(0o711)
        try:
            server.initdb()
        except RuntimeError as exc:
            as_root = " (as root it runs as `postgres`, which must be able to enter it)"
            hint = as_root if os.geteuid() == 0 else ""
            raise StackError(f"PostgreSQL in {server.data_dir}{hint}: {exc}") from exc
        probe = postgres_accepts(self.layout.postgres_url)
        child = supervisor.start(commands.postgres(server.server_argv(), self.layout))
        supervisor.wait_ready([ReadyCheck("postgres", probe, CONTROL_PLANE_TIMEOUT_S, child)])

    def start_control_plane(self, supervisor: Supervisor) -> None:
        """Every replica at once (on PostgreSQL, once it is up), each ready on its own status."""
        if self.layout.postgres_port is not None:
            self.start_postgres(supervisor)
        checks = []
        for command in commands.control_planes(
            self.layout, self.state_dir.db_path, self.tokens, self.ca_cert
        ):
            child = supervisor.start(command)
            probe = self.probes.ok_as_admin(f"{command.url}/v1/status")
            checks.append(ReadyCheck(command.name, probe, CONTROL_PLANE_TIMEOUT_S, child))
        supervisor.wait_ready(checks)

    def _admin_client(self) -> AdminClient:
        return AdminClient(self.layout.control_plane_urls, self.tokens[commands.ADMIN_TOKEN])

    def register_regions(self) -> None:
        """The regions and the credentials of their parts, and the model catalog."""
        client = self._admin_client()
        try:
            self.credentials = register_regions(client, self.layout, self.say)
            register_models(client, self.config.catalog(), self.say)
        finally:
            client.close()

    def start_fleet(self, supervisor: Supervisor) -> None:
        """Node agents, Envoys, the RTT proxy, redis, the gateways and the Anycast front, all at
        once; then wait for all."""
        checks = []
        node_commands = commands.node_agents(
            self.config, self.layout, self.tokens, self.credentials.node_tokens
        )
        for command in node_commands:
            child = supervisor.start(command)
            node_id = command.name.removeprefix("node ")
            assert command.url is not None
            probe = self.probes.node_is_ready(node_id, command.url)
            checks.append(ReadyCheck(command.name, probe, NODE_TIMEOUT_S, child))
        for command in commands.edge_nodes(self.config, self.layout, self.tokens):
            child = supervisor.start(command)
            probe = self.probes.ok(f"{command.url}/ready")
            checks.append(ReadyCheck(command.name, probe, NODE_TIMEOUT_S, child))
        if self.envoy_path is not None:
            bootstraps = write_envoy_bootstraps(
                self.layout, self.credentials.xds_tokens, self.state_dir.envoy_dir
            )
            for region in self.layout.regions:
                command = commands.envoy(self.envoy_path, region, bootstraps[region.name])
                child = supervisor.start(command)
                probe = self.probes.ok(f"{command.url}/ready")
                label = f"envoy {region.name} (ingress → its nodes)"
                checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        for region in self.layout.regions:
            if region.picker is not None:
                command = commands.picker(self.config, self.layout, region, self.tokens)
                child = supervisor.start(command)
                probe = self.probes.ok(region.picker.metrics_url)
                label = f"{command.name} (its tokenizers loaded)"
                checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        if self.layout.has_rtt_proxy:
            child = supervisor.start(commands.rtt_proxy(self.layout, self.config.paths))
            for region in self.layout.regions:
                for path in region.paths:
                    probe = self.probes.ok(f"{region.ingress_url_of(path.rtt_proxy_port)}/ready")
                    label = f"rtt-proxy {path.pop} → {region.name} (+{path.rtt_ms:g} ms)"
                    checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
            for client in self.layout.clients:
                if (direct := client.direct) is not None:
                    probe = self.probes.ok(f"{direct.url}/ready")
                    label = (
                        f"rtt-proxy {client.city} → {direct.region} (public, +{direct.rtt_ms:g} ms)"
                    )
                    checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        for pop in self.layout.pops:
            if self.redis_path is None or pop.redis_port is None:
                continue
            command = commands.redis_server(self.redis_path, pop, self.state_dir.root)
            child = supervisor.start(command)
            label = f"{command.name} (its buckets)"
            checks.append(ReadyCheck(label, port_is_open(pop.redis_port), REDIS_TIMEOUT_S, child))
        for pop in self.layout.pops:
            command = commands.gateway(
                self.config, self.layout, pop, self.tls[pop.name], self.tokens
            )
            child = supervisor.start(command)
            label = f"{command.name} (every region healthy)"
            probe = self.probes.gateway_is_ready(pop)
            checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        if self.layout.anycast_admin_url is not None:
            child = supervisor.start(
                commands.anycast_front(self.layout, self.ca_cert, self.config.paths)
            )
            probe = self.probes.ok(f"{self.layout.anycast_admin_url}/v1/anycast")
            label = f"anycast-front ({len(self.layout.clients)} client cities)"
            checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        supervisor.wait_ready(checks)

    def create_api_key(self, supervisor: Supervisor) -> None:
        client = self._admin_client()
        try:
            self.api_key = create_api_key(client, self.config.api_key)
        finally:
            client.close()
        supervisor.wait_ready(
            [
                ReadyCheck(
                    f"API key (through {pop.name})",
                    self.probes.key_is_accepted(pop, self.api_key),
                    KEY_TIMEOUT_S,
                )
                for pop in self.layout.pops
            ]
        )

    def summary(self, ready_s: float) -> str:
        head = f"Meridian is up (in {ready_s:.1f} s): "
        return head + render_summary(
            self.layout,
            self.config.catalog(),
            self.config.default_model.served,
            self.api_key,
            str(self.ca_cert),
            self.state_dir.root,
        )


def _watch(supervisor: Supervisor) -> None:
    """Run until interrupted (or until every process is gone), saying when one exits."""
    while True:
        supervisor.report_exits()
        if all(child.exit_status() is not None for child in supervisor.children):
            supervisor.say("every process of the stack has exited")
            return
        time.sleep(WATCH_INTERVAL_S)


def up(options: UpOptions, say: Say) -> int:
    config = load_config(options.config_path)
    started_at = time.monotonic()
    say(f"meridian up: {options.config_path or DEFAULT_CONFIG}, state in {options.state_dir}")
    starter = StackStarter(config, options, say)
    supervisor: Supervisor | None = None
    is_ready = is_detached = False
    with signals_interrupt():
        try:
            starter.state_dir.prepare()
            with locked(starter.state_dir):
                state = starter.prepare()
                supervisor = Supervisor(starter.state_dir, state, say)
                starter.start_control_plane(supervisor)
                starter.register_regions()
                starter.start_fleet(supervisor)
                starter.create_api_key(supervisor)
                state.ready = is_ready = True
                starter.state_dir.write(state)
                say(starter.summary(time.monotonic() - started_at))
                if options.detach:
                    is_detached = True
                    say(f"Detached (PIDs in {starter.state_dir.state_path}).")
                    return 0
                say("Running in the foreground: Ctrl-C stops everything.")
                _watch(supervisor)
        except Interrupted as exc:
            say(f"\n{exc}: stopping the stack…")
        except StackError:
            if supervisor is not None and supervisor.children:
                say("start-up failed: stopping what was started…")
            raise
        finally:
            starter.close()
            if supervisor is not None and not is_detached:
                with no_interrupts():
                    supervisor.stop_all()
                    starter.state_dir.clear()
    say("stopped.")
    return 0 if is_ready else 130
