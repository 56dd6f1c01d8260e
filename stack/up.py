"""`meridian up`: the whole local fleet, in order, each part waited on until it is ready.

1. checks: the config, Envoy (auto: warn and go on without it), no stack already running,
   every port free, the model (pulled if missing, with progress);
2. the control plane (a fresh SQLite database: the YAML is the fleet's source of truth), or with
   `control_plane: {replicas: N, db: postgres}` a fresh PostgreSQL in the state directory and N
   replicas on it; then the regions registered through its admin API with their ingress URLs;
3. the node agents (and edge node agents beside PoPs), the region Envoys (bootstrapped by
   `envoy-bootstrap`), the RTT proxy (a route per PoP and region), the redis-server of shared
   limits, a gateway per PoP (HTTPS on its own loopback address, with its certificate from the
   stack CA) and the Anycast front, all at once; each is ready when its health says so (`/ready`,
   a heartbeat seen by the control plane, a request through Envoy and the RTT proxy, each
   gateway's `/health` with every region healthy, the front's admin);
4. a fresh API key, checked through every PoP; then the URLs, key, CA path and examples.

Then it stays in the foreground, saying when a process exits, until Ctrl-C or SIGTERM (which
`meridian down` sends) stops everything it started, in order; with `--detach` it returns instead
and `meridian down` stops the recorded processes itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx

from control_plane.admin_cli import (
    AdminClient,
    AdminCliError,
    RegionSpec,
    mint_node_credential,
    mint_xds_credential,
    put_region,
    write_private,
)
from control_plane.xds.bootstrap import TOKEN_ENV
from stack import commands
from stack.certs import GatewayTls, ensure_pop_tls
from stack.config import DEFAULT_CONFIG, StackConfig, load_config
from stack.errors import StackError
from stack.layout import PopLayout, StackLayout, check_ports_free, plan_layout
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
from stack.state import ProcessRecord, StackState, StateDir, process_start_time
from stack.summary import limits_mode, render_summary, served_model
from stack.supervisor import ReadyCheck, Say, Supervisor

CONTROL_PLANE_TIMEOUT_S: Final = 60.0
NODE_TIMEOUT_S: Final = 240.0  # model load on a busy machine, several nodes at once
DOWNSTREAM_TIMEOUT_S: Final = 300.0  # Envoy, proxy, gateway: they wait on the nodes
KEY_TIMEOUT_S: Final = 30.0
BOOTSTRAP_TIMEOUT_S: Final = 60.0
PROBE_TIMEOUT_S: Final = 2.0
WATCH_INTERVAL_S: Final = 0.5


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop what was started."""


@dataclass(frozen=True, slots=True)
class UpOptions:
    config_path: Path | None
    state_dir: Path
    detach: bool = False


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted (once: a stop in progress is not interrupted)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
        self.node_tokens: dict[str, str] = {}  # each node agent's own, minted at registration
        self.xds_tokens: dict[str, str] = {}  # each region Envoy's, by region
        self.http = httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False)
        self.gateway_http: httpx.Client | None = None
        self.tls: dict[str, GatewayTls] = {}  # by PoP
        self.api_key = ""
        self.model = config.model
        self.edge_model = config.model

    def close(self) -> None:
        self.http.close()
        if self.gateway_http is not None:
            self.gateway_http.close()

    # --- checks, before anything starts ---

    def prepare(self) -> StackState:
        check_not_running(self.state_dir)
        check_ports_free(self.layout)
        self.model = ensure_model(self.config.model, self.say)
        edge = self.config.edge
        self.edge_model = ensure_model(edge.model, self.say) if edge is not None else self.model
        ensure_kernels(self.say)
        names = {
            pop.name: (pop.address, self.layout.dns_name, f"{pop.name}.{self.layout.dns_name}")
            for pop in self.layout.pops
        }
        self.tls = ensure_pop_tls(self.state_dir.tls_dir, names)
        self.gateway_http = httpx.Client(
            timeout=PROBE_TIMEOUT_S,
            verify=ssl.create_default_context(cafile=str(self.ca_cert)),
            trust_env=False,
        )
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

    # --- probes ---

    def _get(
        self, url: str, client: httpx.Client | None = None, **kwargs: Any
    ) -> httpx.Response | None:
        try:
            return (client or self.http).get(url, **kwargs)
        except httpx.HTTPError:
            return None

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[commands.ADMIN_TOKEN]}"}

    def _is_ok(self, url: str) -> bool:
        response = self._get(url)
        return response is not None and response.status_code == 200

    def _control_plane_get(self, path: str) -> httpx.Response | None:
        """The admin answer of the first replica that gives one (as clients fail over)."""
        for replica in self.layout.control_planes:
            response = self._get(replica.url + path, headers=self._admin_headers())
            if response is not None and response.status_code < 500:
                return response
        return None

    def _node_is_ready(self, node_id: str, url: str) -> Callable[[], bool]:
        def probe() -> bool:
            if not self._is_ok(url + "/ready"):
                return False
            seen = self._control_plane_get(f"/v1/nodes/{node_id}")
            return seen is not None and seen.status_code == 200 and seen.json()["is_healthy"]

        return probe

    def _gateway_is_ready(self, pop: PopLayout) -> Callable[[], bool]:
        def probe() -> bool:
            response = self._get(pop.url + "/health", self.gateway_http)
            if response is None or response.status_code != 200:
                return False
            regions = response.json().get("regions", {})
            return all(
                regions.get(region.name, {}).get("healthy_nodes", 0) >= len(region.nodes)
                for region in self.layout.regions
            )

        return probe

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
        import psycopg  # the `postgres` extra, only here: find_postgres has checked it is there

        child = supervisor.start(commands.postgres(server.server_argv(), self.layout))
        url = self.layout.postgres_url

        def probe() -> bool:
            try:
                psycopg.connect(url, connect_timeout=1).close()
            except psycopg.Error:
                return False
            return True

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
            checks.append(
                ReadyCheck(
                    command.name,
                    self._probe_ok_as_admin(f"{command.url}/v1/status"),
                    CONTROL_PLANE_TIMEOUT_S,
                    child,
                )
            )
        supervisor.wait_ready(checks)

    def _probe_ok_as_admin(self, url: str) -> Callable[[], bool]:
        def probe() -> bool:
            response = self._get(url, headers=self._admin_headers())
            return response is not None and response.status_code == 200

        return probe

    def _admin_client(self) -> AdminClient:
        return AdminClient(self.layout.control_plane_urls, self.tokens[commands.ADMIN_TOKEN])

    def register_regions(self) -> None:
        client = self._admin_client()
        try:
            for region in self.layout.regions:
                spec = RegionSpec(region.name, region.lat, region.lon, region.ingress_url, 1.0)
                put_region(client, spec)
                rtts = ", ".join(f"{path.pop} {path.rtt_ms:g}" for path in region.paths)
                self.say(
                    f"  region {region.name} registered ({region.lat:g}, {region.lon:g}; "
                    f"ingress {region.ingress_url}; RTT ms from {rtts})"
                )
                for node in region.nodes:
                    self.node_tokens[node.node_id] = mint_node_credential(
                        client, node.node_id, region.name, node.url
                    )
                if region.envoy_port is not None:
                    name = f"envoy-{region.name}"
                    self.xds_tokens[region.name] = mint_xds_credential(client, name, region.name)
        except AdminCliError as exc:
            raise StackError(f"registering regions: {exc}") from exc
        finally:
            client.close()

    def _envoy_bootstraps(self) -> dict[str, Path]:
        """Each region's bootstrap from `envoy-bootstrap`, written under envoy/ (in parallel)."""
        running = {}
        for region in self.layout.regions:
            argv = commands.envoy_bootstrap(self.layout, region)
            running[region.name] = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=commands.base_env() | {TOKEN_ENV: self.xds_tokens[region.name]},
            )
        paths = {}
        for name, popen in running.items():
            try:
                out, err = popen.communicate(timeout=BOOTSTRAP_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                popen.kill()
                popen.communicate()
                raise StackError(f"envoy-bootstrap for {name} took over {exc.timeout} s") from exc
            if popen.returncode != 0:
                message = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise StackError(f"envoy-bootstrap for {name} failed: {message[0]}")
            path = self.state_dir.envoy_dir / f"{name}.yaml"
            write_private(path, out.decode())  # it holds the region's xDS token
            paths[name] = path
        return paths

    def start_fleet(self, supervisor: Supervisor) -> None:
        """Node agents, Envoys, the RTT proxy, redis, the gateways and the Anycast front, all at
        once; then wait for all."""
        checks = []
        node_commands = commands.node_agents(
            self.config, self.layout, self.model, self.tokens, self.node_tokens
        )
        for command in node_commands:
            child = supervisor.start(command)
            node_id = command.name.removeprefix("node ")
            assert command.url is not None
            probe = self._node_is_ready(node_id, command.url)
            checks.append(ReadyCheck(command.name, probe, NODE_TIMEOUT_S, child))
        for command in commands.edge_nodes(self.config, self.layout, self.edge_model, self.tokens):
            child = supervisor.start(command)
            probe = self._probe_ok(f"{command.url}/ready")
            checks.append(ReadyCheck(command.name, probe, NODE_TIMEOUT_S, child))
        if self.envoy_path is not None:
            bootstraps = self._envoy_bootstraps()
            for region in self.layout.regions:
                command = commands.envoy(self.envoy_path, region, bootstraps[region.name])
                child = supervisor.start(command)
                probe = self._probe_ok(f"{command.url}/ready")
                label = f"envoy {region.name} (ingress → its nodes)"
                checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        if self.layout.has_rtt_proxy:
            child = supervisor.start(commands.rtt_proxy(self.layout))
            for region in self.layout.regions:
                for path in region.paths:
                    url = region.ingress_url_of(path.rtt_proxy_port)
                    label = f"rtt-proxy {path.pop} → {region.name} (+{path.rtt_ms:g} ms)"
                    checks.append(
                        ReadyCheck(
                            label, self._probe_ok(f"{url}/ready"), DOWNSTREAM_TIMEOUT_S, child
                        )
                    )
        for pop in self.layout.pops:
            if self.redis_path is None or pop.redis_port is None:
                continue
            command = commands.redis_server(self.redis_path, pop, self.state_dir.root)
            child = supervisor.start(command)
            probe = self._redis_is_up(pop.redis_port)
            checks.append(ReadyCheck(f"{command.name} (its buckets)", probe, 30.0, child))
        for pop in self.layout.pops:
            command = commands.gateway(
                self.config, self.layout, pop, self.tls[pop.name], self.tokens, self.model
            )
            child = supervisor.start(command)
            label = f"{command.name} (every region healthy)"
            checks.append(
                ReadyCheck(label, self._gateway_is_ready(pop), DOWNSTREAM_TIMEOUT_S, child)
            )
        if self.layout.anycast_admin_url is not None:
            child = supervisor.start(commands.anycast_front(self.layout, self.ca_cert))
            probe = self._probe_ok(f"{self.layout.anycast_admin_url}/v1/anycast")
            label = f"anycast-front ({len(self.layout.clients)} client cities)"
            checks.append(ReadyCheck(label, probe, DOWNSTREAM_TIMEOUT_S, child))
        supervisor.wait_ready(checks)

    def _redis_is_up(self, port: int) -> Callable[[], bool]:
        def probe() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
            except OSError:
                return False
            return True

        return probe

    def _probe_ok(self, url: str) -> Callable[[], bool]:
        return lambda: self._is_ok(url)

    def create_api_key(self, supervisor: Supervisor) -> None:
        body = {
            "name": self.config.api_key.name,
            "rpm": self.config.api_key.rpm,
            "tpm": self.config.api_key.tpm,
        }
        client = self._admin_client()
        try:
            response = client.call("POST", "/v1/keys", body)
        except AdminCliError as exc:
            raise StackError(f"creating an API key: {exc}") from exc
        finally:
            client.close()
        if response.status_code != 201:
            raise StackError(f"creating an API key: {response.status_code} {response.text[:200]}")
        self.api_key = response.json()["secret"]
        headers = {"Authorization": f"Bearer {self.api_key}"}

        def probe(url: str) -> Callable[[], bool]:
            def seen() -> bool:
                answer = self._get(url, self.gateway_http, headers=headers)
                return answer is not None and answer.status_code == 200

            return seen

        supervisor.wait_ready(
            [
                ReadyCheck(
                    f"API key (through {pop.name})", probe(f"{pop.url}/v1/models"), KEY_TIMEOUT_S
                )
                for pop in self.layout.pops
            ]
        )

    def summary(self, ready_s: float) -> str:
        model = served_model(self.model)
        ca_cert = str(self.ca_cert)
        head = f"Meridian is up (in {ready_s:.1f} s): "
        return head + render_summary(self.layout, model, self.api_key, ca_cert, self.state_dir.root)


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
    with _signals_interrupt():
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
                with _no_interrupts():
                    supervisor.stop_all()
                    starter.state_dir.clear()
    say("stopped.")
    return 0 if is_ready else 130


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """The ordered stop is bounded; a second Ctrl-C must not cut it short."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
