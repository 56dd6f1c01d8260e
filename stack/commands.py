"""The command line and environment of every process the stack starts (ARCHITECTURE.md's entry
points), built from the layout; pure functions, so they can be checked without starting anything.

Children run with this interpreter and import this tree (its root goes first on PYTHONPATH), so
they are the same Meridian as the `meridian up` that starts them. Inherited MERIDIAN_* variables
are dropped (they would override the services' settings); each service gets only its own tokens.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stack.certs import GatewayTls
from stack.config import PathsConfig, StackConfig
from stack.layout import HOST, PopLayout, RegionLayout, StackLayout
from stack.model_config import served_model

SOURCE_ROOT = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "MERIDIAN_ADMIN_TOKEN"
NODE_TOKEN = "MERIDIAN_NODE_TOKEN"
GATEWAY_TOKEN = "MERIDIAN_GATEWAY_TOKEN"
# One per fleet: node agents require it on their OpenAI API, gateways send it upstream.
SERVING_TOKEN = "MERIDIAN_SERVING_TOKEN"
KEPT_MERIDIAN_VARS = frozenset({"MERIDIAN_HOME"})  # where the model store is


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # shown in progress and `status`; also the log file's name
    # postgres, control-plane, node, envoy, picker, rtt-proxy, gateway, anycast-front, redis
    kind: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str | None = None


def base_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    env = {
        name: value
        for name, value in environ.items()
        if not name.startswith("MERIDIAN_") or name in KEPT_MERIDIAN_VARS
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SOURCE_ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _python(module: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", module, *args)


def default_num_threads(num_nodes: int) -> int:
    """Torch threads per node agent: this machine's cores shared among them."""
    return max(1, (os.cpu_count() or 1) // max(1, num_nodes))


def dns_config(layout: StackLayout, ca_cert: Path) -> dict[str, object]:
    """The control plane's DNS settings: the API name answered with the nearest healthy PoP
    (each checked on its `/health`, over TLS verified with the stack CA)."""
    zone = layout.dns_name.split(".", 1)[1] if "." in layout.dns_name else layout.dns_name
    pops = [
        {"name": pop.name, "address": pop.address, "health_url": f"{pop.url}/health"}
        for pop in layout.pops
    ]
    return {"hostname": layout.dns_name, "zone": zone, "pops": pops, "pop_ca": str(ca_cert)}


def control_planes(
    layout: StackLayout, db_path: Path, tokens: Mapping[str, str], ca_cert: Path
) -> list[Command]:
    """Every replica: the one on SQLite at `db_path`, or each on the stack's PostgreSQL."""
    db = layout.postgres_url or str(db_path)
    env = base_env() | {name: tokens[name] for name in (ADMIN_TOKEN, GATEWAY_TOKEN)}
    env["MERIDIAN_CP_DNS"] = json.dumps(dns_config(layout, ca_cert))
    commands = []
    for replica in layout.control_planes:
        argv = _python(
            "control_plane",
            *("--host", HOST, "--port", str(replica.port)),
            *("--xds-port", str(replica.xds_port), "--dns-port", str(replica.dns_port)),
            *("--db", db),
        )
        replica_env = env | {"MERIDIAN_CP_REPLICA_ID": replica.name.replace(" ", "-")}
        commands.append(Command(replica.name, "control-plane", argv, replica_env, replica.url))
    return commands


def postgres(server_argv: list[str], layout: StackLayout) -> Command:
    """The control plane's PostgreSQL (`stack/postgres.py` builds the server's command line)."""
    return Command("postgres", "postgres", tuple(server_argv), base_env(), layout.postgres_url)


def node_agents(
    config: StackConfig,
    layout: StackLayout,
    tokens: Mapping[str, str],
    node_tokens: Mapping[str, str],
) -> list[Command]:
    """Every node agent, each loading its own model as configured; `node_tokens`: each one's own
    control-plane credential, by node id."""
    env = _node_env(config, tokens)
    models = {model.served: model for model in config.fleet_models}
    commands = []
    for region in layout.regions:
        for node in region.nodes:
            model = models[node.model]
            argv = _python(
                "node_agent",
                *("--model", model.weights, "--served-model-name", model.served),
                *("--dtype", model.dtype, "--quantization", model.quantization),
                *("--kv-cache-dtype", model.kv_cache_dtype),
                *("--host", HOST, "--port", str(node.port)),
                *("--region", region.name, "--node-id", node.node_id),
                *("--control-plane", layout.control_plane_urls),
                *("--kv-cache-gib", f"{config.node.kv_cache_gib:g}"),
                *("--max-num-seqs", str(config.node.max_num_seqs)),
                *(("--picker-url", region.picker.cache_events_url) if region.picker else ()),
            )
            node_env = env | {NODE_TOKEN: node_tokens[node.node_id]}
            commands.append(Command(f"node {node.node_id}", "node", argv, node_env, node.url))
    return commands


def _node_env(config: StackConfig, tokens: Mapping[str, str]) -> dict[str, str]:
    threads = config.node.num_threads or default_num_threads(config.num_nodes)
    return base_env() | {
        SERVING_TOKEN: tokens[SERVING_TOKEN],
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }


def edge_nodes(
    config: StackConfig, layout: StackLayout, tokens: Mapping[str, str]
) -> list[Command]:
    """The edge node agents beside PoPs: no control plane (no region routes to them), only
    their PoP's gateway, for light `auto` requests."""
    commands = []
    for pop in layout.pops:
        if pop.edge_port is None or config.edge is None:
            continue
        argv = _python(
            "node_agent",
            *("--model", config.edge.model, "--host", HOST, "--port", str(pop.edge_port)),
            *("--region", f"edge-{pop.name}", "--node-id", f"edge-{pop.name}"),
            *("--kv-cache-gib", f"{config.node.kv_cache_gib:g}"),
            *("--max-num-seqs", str(config.edge.max_concurrency)),
        )
        env = _node_env(config, tokens)
        commands.append(Command(f"edge {pop.name}", "node", argv, env, pop.edge_url))
    return commands


def envoy_bootstrap(layout: StackLayout, region: RegionLayout) -> tuple[str, ...]:
    """`python -m control_plane envoy-bootstrap` for the region's ingress Envoy (every replica's
    xDS: Envoy fails over between them)."""
    assert region.envoy_port is not None and region.envoy_admin_port is not None
    return _python(
        "control_plane",
        "envoy-bootstrap",
        *("--region", region.name, "--listen", f"{HOST}:{region.envoy_port}"),
        *(arg for address in layout.xds_addresses for arg in ("--xds", address)),
        *("--admin", f"{HOST}:{region.envoy_admin_port}"),
        *("--node-id", f"meridian-stack-ingress-{region.name}"),
    )


def envoy(envoy_path: str, region: RegionLayout, bootstrap: Path) -> Command:
    assert region.envoy_port is not None
    argv = (
        envoy_path,
        *("-c", str(bootstrap), "--concurrency", "1", "-l", "warning"),
        *("--base-id", str(region.envoy_port), "--disable-hot-restart"),
    )
    url = f"http://{HOST}:{region.envoy_port}"
    return Command(f"envoy {region.name}", "envoy", argv, base_env(), url)


def picker(
    config: StackConfig, layout: StackLayout, region: RegionLayout, tokens: Mapping[str, str]
) -> Command:
    """The region's endpoint picker, tokenizing prompts for each model its nodes serve; it
    follows the region's nodes at the first control-plane replica."""
    assert region.picker is not None
    models = {model.served: model.weights for model in config.fleet_models}
    argv = _python(
        "region_picker",
        *("--region", region.name, "--host", HOST, "--port", str(region.picker.port)),
        *("--metrics-host", HOST, "--metrics-port", str(region.picker.metrics_port)),
        *("--cache-events-port", str(region.picker.cache_events_port)),
        *("--control-plane", layout.control_plane_url),
        *(arg for name in region.models for arg in ("--model", f"{name}={models[name]}")),
    )
    env = base_env() | {name: tokens[name] for name in (GATEWAY_TOKEN, SERVING_TOKEN)}
    return Command(f"picker {region.name}", "picker", argv, env, region.picker.metrics_url)


def rtt_proxy(layout: StackLayout, paths: PathsConfig) -> Command:
    """One process for every PoP's path to every region (the backbone: steady) and every client
    city's path straight to its nearest region (public: jitter and loss)."""
    routes = []
    for region in layout.regions:
        upstreams = ",".join(url.removeprefix("http://") for url in region.upstream_urls)
        for path in region.paths:
            if path.rtt_proxy_port is not None:
                routes += ["--route", f"{HOST}:{path.rtt_proxy_port}={upstreams}@{path.rtt_ms:g}"]
    for client in layout.clients:
        if client.direct is not None:
            upstreams = ",".join(url.removeprefix("http://") for url in client.direct.upstreams)
            route = f"{HOST}:{client.direct.port}={upstreams}@{client.direct.rtt_ms:g}"
            routes += ["--public-route", route]
    argv = _python("stack.rtt_proxy", *routes, *path_arguments(paths))
    return Command("rtt-proxy", "rtt-proxy", argv, base_env())


def path_arguments(paths: PathsConfig) -> tuple[str, ...]:
    """How the RTT proxy and the Anycast front treat public paths (stack/path_delays.py)."""
    return (
        *("--jitter-share", f"{paths.public_jitter_share:g}"),
        *("--loss-per-100-ms", f"{paths.public_loss_per_100_ms:g}", "--seed", str(paths.seed)),
    )


def gateway(
    config: StackConfig,
    layout: StackLayout,
    pop: PopLayout,
    tls: GatewayTls,
    tokens: Mapping[str, str],
) -> Command:
    """The PoP's gateway, on its own address, told its own paths to the regions; `auto` means
    the default model, answered by the PoP's edge node when it has one and the request is light."""
    ingress = (
        arg for region, url in pop.region_ingress for arg in ("--region-ingress", f"{region}={url}")
    )
    argv = _python(
        "gateway",
        *("--pop", pop.name, "--host", pop.address, "--port", str(pop.port)),
        *("--metrics-host", pop.address, "--metrics-port", str(pop.metrics_port)),
        *("--control-plane", layout.control_plane_urls),
        *("--tls-cert", str(tls.cert), "--tls-key", str(tls.key)),
        *ingress,
        *(("--redis", pop.redis_url) if pop.redis_url is not None else ()),
        *("--auto-model", config.default_model.served),
        *_edge_args(config, pop),
    )
    env = base_env() | {name: tokens[name] for name in (GATEWAY_TOKEN, SERVING_TOKEN)}
    return Command(f"gateway {pop.name}", "gateway", argv, env, pop.url)


def _edge_args(config: StackConfig, pop: PopLayout) -> tuple[str, ...]:
    if config.edge is None or pop.edge_url is None:
        return ()
    edge = config.edge
    return (
        *("--edge-url", pop.edge_url, "--edge-model", served_model(edge.model)),
        *("--edge-max-tokens", str(edge.max_tokens)),
        *("--edge-max-prompt-tokens", str(edge.max_prompt_tokens)),
        *("--edge-max-concurrency", str(edge.max_concurrency)),
    )


def redis_server(path: str, pop: PopLayout, directory: Path) -> Command:
    """A PoP's buckets: in memory only (what matters, a key's debt, the control plane keeps and
    the PoP writes back into an empty one)."""
    assert pop.redis_port is not None
    argv = (
        path,
        *("--port", str(pop.redis_port), "--bind", HOST),
        *("--save", "", "--appendonly", "no", "--dir", str(directory)),
    )
    return Command(f"redis {pop.name}", "redis", argv, base_env(), pop.redis_url)


def anycast_front(layout: StackLayout, ca_cert: Path, paths: PathsConfig) -> Command:
    """The Anycast front: a port per client city, forwarding to the nearest announced PoP over
    the city's public path."""
    assert layout.anycast_admin_port is not None
    argv = _python(
        "stack.front",
        *("--admin", f"{HOST}:{layout.anycast_admin_port}", "--health-ca", str(ca_cert)),
        *(arg for pop in layout.pops for arg in ("--pop", f"{pop.name}={pop.address}:{pop.port}")),
        *(arg for c in layout.clients for arg in ("--client", f"{c.city}={HOST}:{c.port}")),
        *path_arguments(paths),
    )
    return Command("anycast-front", "anycast-front", argv, base_env(), layout.anycast_admin_url)
