"""`python -m control_plane envoy-bootstrap`: a complete Envoy bootstrap for one ingress or edge.

Like `consul connect envoy -bootstrap`: the output is all `envoy -c FILE` needs. The node metadata
tells the ADS server which snapshot this Envoy gets (role, region, and the address its listener
binds); everything else (listener, routes, cluster, endpoints) arrives over ADS from `--xds`.
With `--xds-ca FILE` Envoy speaks TLS to the xDS port and accepts only a certificate that chains
to that CA and names the `--xds` host (a control plane started with `--tls-cert/--tls-key`).
`--xds` given more than once (the control plane's replicas) puts every address in the xDS
cluster: when the ADS stream's replica goes, Envoy reconnects to another (with TLS they must
share one host name, the certificate's).

The ADS server admits only Envoys that present an xDS credential for their role and region
(`control_plane.xds.credentials`): the token, from `--token-file FILE` or `MERIDIAN_XDS_TOKEN`,
goes into the bootstrap as the ADS stream's `authorization` metadata. The bootstrap thus holds a
secret: keep its file readable by Envoy's user only.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from control_plane.xds.groups import EnvoyGroup, Role
from control_plane.xds.resources import TYPE_PREFIX
from control_plane.xds.validation import is_ip

DEFAULT_ADMIN = "127.0.0.1:9901"
MAX_DOWNSTREAM_CONNECTIONS = 100_000
XDS_CLUSTER = "xds_cluster"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
UPSTREAM_TLS = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
TOKEN_ENV = "MERIDIAN_XDS_TOKEN"
# A bearer token as it may stand in a header (ours are `mxds-` and URL-safe base64).
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{16,512}$")


@dataclass(frozen=True, slots=True)
class BootstrapConfig:
    group: EnvoyGroup
    xds: tuple[tuple[str, int], ...]  # (host, port) of each replica's ADS
    admin_host: str
    admin_port: int
    node_id: str
    token: str  # the Envoy's xDS credential, sent as `authorization: Bearer` on the ADS stream
    xds_ca: str | None = None  # a CA file: TLS to the xDS port, verified against it


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _xds_tls(host: str, ca_file: str) -> dict[str, Any]:
    """TLS to the control plane: its certificate must chain to `ca_file` and name `host`."""
    san_type = "IP_ADDRESS" if is_ip(host) else "DNS"
    context: dict[str, Any] = {
        "@type": TYPE_PREFIX + UPSTREAM_TLS,
        "common_tls_context": {
            "alpn_protocols": ["h2"],  # gRPC
            "validation_context": {
                "trusted_ca": {"filename": ca_file},
                "match_typed_subject_alt_names": [
                    {"san_type": san_type, "matcher": {"exact": host}}
                ],
            },
        },
    }
    if san_type == "DNS":
        context["sni"] = host
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _xds_cluster(config: BootstrapConfig) -> dict[str, Any]:
    endpoints = [{"endpoint": {"address": _socket(host, port)}} for host, port in config.xds]
    first_host = config.xds[0][0]
    tls = {} if config.xds_ca is None else {"transport_socket": _xds_tls(first_host, config.xds_ca)}
    is_static = all(is_ip(host) for host, _ in config.xds)
    return {
        "name": XDS_CLUSTER,
        "type": "STATIC" if is_static else "STRICT_DNS",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": TYPE_PREFIX + HTTP_OPTIONS,
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        },
        **tls,
    }


def render(config: BootstrapConfig) -> dict[str, Any]:
    """The bootstrap as a plain dict (YAML or JSON ready)."""
    group = config.group
    return {
        "node": {
            "id": config.node_id,
            "cluster": f"meridian-{group.label.replace('/', '-')}",
            "metadata": group.metadata(),
        },
        "admin": {"address": _socket(config.admin_host, config.admin_port)},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [
                    {
                        "envoy_grpc": {"cluster_name": XDS_CLUSTER},
                        "initial_metadata": [
                            {"key": "authorization", "value": f"Bearer {config.token}"}
                        ],
                    }
                ],
            },
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {"clusters": [_xds_cluster(config)]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": TYPE_PREFIX + "envoy.extensions.resource_monitors."
                        "downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS,
                    },
                }
            ]
        },
    }


def dump(config: BootstrapConfig, output_format: str = "yaml") -> str:
    document = render(config)
    if output_format == "json":
        return json.dumps(document, indent=2) + "\n"
    return yaml.safe_dump(document, sort_keys=False)


def host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` → (host, port); argparse type."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m control_plane envoy-bootstrap",
        description="Print a ready Envoy bootstrap that takes its configuration over ADS "
        "from this control plane's xDS port.",
    )
    add = parser.add_argument
    add("--role", choices=[r.value for r in Role], default=Role.INGRESS.value)
    add("--region", help="the region an ingress Envoy fronts (not for the edge)")
    add("--listen", type=host_port, required=True, metavar="IP:PORT", help="for traffic")
    add(
        "--xds",
        type=host_port,
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="the control plane's ADS (again for each replica: Envoy fails over between them)",
    )
    add(
        "--xds-ca",
        metavar="FILE",
        help="speak TLS to --xds, trusting this CA (PEM) for a certificate naming its host",
    )
    add(
        "--token-file",
        metavar="FILE",
        help=f"the Envoy's xDS token (POST /v1/xds/credentials/NAME; default: ${TOKEN_ENV})",
    )
    add("--node-id", help="unique per Envoy (default: role, region, host name, listen port)")
    add(
        "--admin",
        type=host_port,
        default=host_port(DEFAULT_ADMIN),
        metavar="IP:PORT",
        help=f"Envoy's admin listener, loopback only (default {DEFAULT_ADMIN})",
    )
    add("--format", choices=["yaml", "json"], default="yaml")
    return parser.parse_args(argv)


def _ca_file(path: str | None) -> str | None:
    """Absolute (Envoy may run from another directory), and it must exist now."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ValueError(f"--xds-ca {path}: no such file")
    return str(resolved)


def _token(path: str | None) -> str:
    """From the file (its first line), else the environment; it must look like a token."""
    if path is not None:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file {path}: {exc}") from exc
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"an xDS token is needed: --token-file FILE or {TOKEN_ENV} "
            "(an operator mints one: POST /v1/xds/credentials/NAME)"
        )
    if not _TOKEN.match(token):
        raise ValueError("the xDS token is not a token (16-512 letters, digits and ._~+/=-)")
    return token


def config_of(args: argparse.Namespace) -> BootstrapConfig:
    """Check the arguments; ValueError says what is wrong in one line."""
    role = Role(args.role)
    if role is Role.INGRESS and not args.region:
        raise ValueError("an ingress Envoy needs --region")
    if role is Role.EDGE and args.region:
        raise ValueError("an edge Envoy serves every region: leave out --region")
    admin_host, admin_port = args.admin
    if admin_host == "localhost":
        admin_host = "127.0.0.1"
    if not (is_ip(admin_host) and ipaddress.ip_address(admin_host).is_loopback):
        raise ValueError(
            f"--admin must be a loopback address (Envoy's admin has no auth), got {admin_host!r}"
        )
    xds = tuple(args.xds)
    if len(set(xds)) != len(xds):
        raise ValueError("an --xds address is given twice")
    if args.xds_ca is not None and len({host for host, _ in xds}) > 1:
        raise ValueError(
            "with --xds-ca every --xds must name the same host (one certificate, one SNI)"
        )
    listen_host, listen_port = args.listen
    group = EnvoyGroup(role, args.region, listen_host, listen_port)
    default_id = f"{group.label.replace('/', '-')}-{socket.gethostname()}-{listen_port}"
    return BootstrapConfig(
        group=group,
        xds=xds,
        admin_host=admin_host,
        admin_port=admin_port,
        node_id=args.node_id or default_id,
        token=_token(args.token_file),
        xds_ca=_ca_file(args.xds_ca),
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        config = config_of(args)
    except ValueError as exc:  # EnvoyNodeError included
        print(f"envoy-bootstrap: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump(config, args.format))
    return 0
