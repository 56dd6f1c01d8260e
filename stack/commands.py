"""The command line and environment of every process the stack starts (ARCHITECTURE.md's entry
points), built from the layout; pure functions, so they can be checked without starting anything.

Children run with this interpreter and import this tree (its root goes first on PYTHONPATH), so
they are the same Meridian as the `meridian up` that starts them. Inherited MERIDIAN_* variables
are dropped (they would override the services' settings); each service gets only its own tokens.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stack.certs import GatewayTls
from stack.config import StackConfig
from stack.layout import HOST, RegionLayout, StackLayout, default_num_threads

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
    kind: str  # control-plane, node, envoy, rtt-proxy, gateway
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


def control_plane(layout: StackLayout, db_path: Path, tokens: Mapping[str, str]) -> Command:
    argv = _python(
        "control_plane",
        *("--host", HOST, "--port", str(layout.control_plane_port)),
        *("--xds-port", str(layout.xds_port), "--dns-port", str(layout.dns_port)),
        *("--db", str(db_path)),
    )
    env = base_env() | {name: tokens[name] for name in (ADMIN_TOKEN, GATEWAY_TOKEN)}
    return Command("control-plane", "control-plane", argv, env, layout.control_plane_url)


def node_agents(
    config: StackConfig,
    layout: StackLayout,
    model: str,
    tokens: Mapping[str, str],
    node_tokens: Mapping[str, str],
) -> list[Command]:
    """Every node agent; `node_tokens`: each one's own control-plane credential, by node id."""
    threads = config.node.num_threads or default_num_threads(config.num_nodes)
    env = base_env() | {
        SERVING_TOKEN: tokens[SERVING_TOKEN],
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    commands = []
    for region in layout.regions:
        for node in region.nodes:
            argv = _python(
                "node_agent",
                *("--model", model, "--host", HOST, "--port", str(node.port)),
                *("--region", region.name, "--node-id", node.node_id),
                *("--control-plane", layout.control_plane_url),
                *("--kv-cache-gib", f"{config.node.kv_cache_gib:g}"),
                *("--max-num-seqs", str(config.node.max_num_seqs)),
            )
            node_env = env | {NODE_TOKEN: node_tokens[node.node_id]}
            commands.append(Command(f"node {node.node_id}", "node", argv, node_env, node.url))
    return commands


def envoy_bootstrap(layout: StackLayout, region: RegionLayout) -> tuple[str, ...]:
    """`python -m control_plane envoy-bootstrap` for the region's ingress Envoy."""
    assert region.envoy_port is not None and region.envoy_admin_port is not None
    return _python(
        "control_plane",
        "envoy-bootstrap",
        *("--region", region.name, "--listen", f"{HOST}:{region.envoy_port}"),
        *("--xds", f"{HOST}:{layout.xds_port}", "--admin", f"{HOST}:{region.envoy_admin_port}"),
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


def rtt_proxy(layout: StackLayout) -> Command:
    routes = []
    for region in layout.regions:
        if region.rtt_proxy_port is None:
            continue
        upstreams = ",".join(url.removeprefix("http://") for url in region.upstream_urls)
        routes += ["--route", f"{HOST}:{region.rtt_proxy_port}={upstreams}@{region.rtt_ms:g}"]
    return Command("rtt-proxy", "rtt-proxy", _python("stack.rtt_proxy", *routes), base_env())


def gateway(layout: StackLayout, tls: GatewayTls, tokens: Mapping[str, str]) -> Command:
    argv = _python(
        "gateway",
        *("--pop", layout.gateway_pop, "--host", HOST, "--port", str(layout.gateway_port)),
        *("--control-plane", layout.control_plane_url),
        *("--tls-cert", str(tls.cert), "--tls-key", str(tls.key)),
    )
    env = base_env() | {name: tokens[name] for name in (GATEWAY_TOKEN, SERVING_TOKEN)}
    return Command("gateway", "gateway", argv, env, layout.gateway_url)
