"""`python -m control_plane.admin_cli`: a small admin-API client for scripts and Terraform.

    python -m control_plane.admin_cli region put NAME --lat 39.04 --lon -77.49 \\
        [--ingress-url URL] [--weight 1.0] [--picker IP:PORT]
    python -m control_plane.admin_cli region delete NAME [--wait-s 120]
    python -m control_plane.admin_cli node credentials REGION --token-dir DIR \\
        --node NODE_ID[=URL] [--node ...]
    python -m control_plane.admin_cli xds credential NAME (--region REGION | --edge) \\
        --token-file FILE
    python -m control_plane.admin_cli model list|add|alias|fallbacks|remove ...
    python -m control_plane.admin_cli key create|update|spend ...

The control plane's URL comes from `MERIDIAN_CONTROL_PLANE_URL` (or `--control-plane`), the
operator token from `MERIDIAN_ADMIN_TOKEN` only, so that the token never appears in a command line,
a process listing or Terraform state of the command.

`region put` makes the region's location, ingress URL, weight and endpoint picker exactly what it
is given (an ingress URL or picker left out is cleared, a weight left out is 1.0): it creates the
region, updates it in place, or does nothing if it already matches. Its state (active, draining,
disabled) belongs to operators and is never touched; a region being deleted is refused. `region
delete` succeeds if the region is already gone; a region with nodes is deleted only after they
drain (the control plane answers 202), and `--wait-s` waits that long for it to be gone. `node
credentials` mints each node's own heartbeat token (its MERIDIAN_NODE_TOKEN, bound to the node id,
the region and the URL if given, else the URL of its first beat) and writes it to
`DIR/NODE_ID.token` (mode 0600), never to the output; minting again replaces a node's token. `xds
credential` mints an Envoy's xDS token (for the ingress of REGION, or for the edge) and writes it
to FILE (mode 0600), for `envoy-bootstrap --token-file FILE`; minting again replaces it.
`model ...` edits the model catalog (`control_plane.admin_models` has its actions); `key ...`
creates keys and sets the models they may use, their limits per model and their token budgets,
and shows a key's spend (`control_plane.admin_keys`); a new key's secret goes to a file (mode
0600), never to the output.

Exit status: 0 done, 1 the control plane refused or could not be reached, 2 bad usage. Errors are
one line on stderr (bad arguments too: `-h` shows the usage); the token is never printed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from control_plane import admin_keys, admin_models
from control_plane.admin_client import TOKEN_ENV, AdminClient, AdminCliError, expect
from wire.control_plane_urls import ControlPlaneUrls
from wire.heartbeat import NAME_PATTERN

PROG = "admin_cli"
URL_ENV = "MERIDIAN_CONTROL_PLANE_URL"
POLL_INTERVAL_S = 0.5
_HTTP_URL = re.compile(r"^https?://[^\s/?#@]+/?$")


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """What `region put` makes the region look like (its `state` is left alone)."""

    name: str
    lat: float
    lon: float
    ingress_url: str | None
    weight: float
    picker: str | None = None  # its endpoint picker, IP:PORT

    def fields(self) -> dict[str, Any]:
        """Every field but the name: what a PATCH sends (a POST adds the name)."""
        return {key: value for key, value in asdict(self).items() if key != "name"}

    def matches(self, view: dict[str, Any]) -> bool:
        return all(view.get(key) == value for key, value in self.fields().items())


def region_name(value: str) -> str:
    """argparse type: a region name as the control plane accepts it (also safe in a URL path)."""
    if not re.match(NAME_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a region name ({NAME_PATTERN})")
    return value


class _Parser(argparse.ArgumentParser):
    """Refuses bad arguments in one line, as every other error (its subcommands' parsers too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m control_plane.admin_cli",
        description=f"Admin API client. URL from {URL_ENV}, operator token from {TOKEN_ENV}.",
    )
    parser.add_argument(
        "--control-plane", help=f"control plane URL, or replicas' URL,URL,... (default: ${URL_ENV})"
    )
    resources = parser.add_subparsers(dest="resource", required=True)
    region = resources.add_parser("region", help="register, update or remove a region")
    actions = region.add_subparsers(dest="action", required=True)
    put = actions.add_parser("put", help="create or update a region to match these values")
    put.add_argument("name", type=region_name)
    put.add_argument("--lat", type=float, required=True, help="latitude, degrees")
    put.add_argument("--lon", type=float, required=True, help="longitude, degrees")
    put.add_argument("--ingress-url", help="the region's ingress (cleared when left out)")
    put.add_argument("--weight", type=float, default=1.0, help="routing weight (default 1.0)")
    put.add_argument(
        "--picker", metavar="IP:PORT", help="its endpoint picker (cleared when left out)"
    )
    delete = actions.add_parser("delete", help="deregister a region (no error if absent)")
    delete.add_argument("name", type=region_name)
    delete.add_argument(
        "--wait-s",
        type=float,
        default=0.0,
        help="if its nodes must drain first, wait up to this long for it to be gone (default 0)",
    )
    node = resources.add_parser("node", help="node agents' credentials")
    node_actions = node.add_subparsers(dest="action", required=True)
    credentials = node_actions.add_parser(
        "credentials", help="mint nodes' heartbeat tokens (each replaces an earlier one)"
    )
    credentials.add_argument("region", type=region_name)
    credentials.add_argument(
        "--node",
        dest="nodes",
        type=node_spec,
        action="append",
        required=True,
        metavar="NODE_ID[=URL]",
        help="a node of the region, and the URL it serves at (else its first beat binds one)",
    )
    credentials.add_argument(
        "--token-dir", type=Path, required=True, help="where NODE_ID.token files go (mode 0600)"
    )
    admin_models.add_parser(resources)
    admin_keys.add_parser(resources)
    xds = resources.add_parser("xds", help="Envoys' xDS credentials")
    xds_actions = xds.add_subparsers(dest="action", required=True)
    xds_credential = xds_actions.add_parser(
        "credential", help="mint an Envoy's xDS token (replaces an earlier one of that name)"
    )
    xds_credential.add_argument("name", type=region_name, help="the credential's name")
    role = xds_credential.add_mutually_exclusive_group(required=True)
    role.add_argument("--region", type=region_name, help="for the ingress Envoys of REGION")
    role.add_argument("--edge", action="store_true", help="for edge Envoys (every region)")
    xds_credential.add_argument(
        "--token-file", type=Path, required=True, help="where the token goes (mode 0600)"
    )
    return parser.parse_args(argv)


def node_spec(value: str) -> tuple[str, str | None]:
    """argparse type: `NODE_ID` or `NODE_ID=URL`."""
    node_id, sep, url = value.partition("=")
    if not re.match(NAME_PATTERN, node_id):
        raise argparse.ArgumentTypeError(f"{node_id!r} is not a node id ({NAME_PATTERN})")
    if sep and not _HTTP_URL.match(url):
        raise argparse.ArgumentTypeError(f"{url!r} is not an http(s)://HOST[:PORT] URL")
    return node_id, (url if sep else None)


def put_region(client: AdminClient, spec: RegionSpec) -> str:
    """Create or update the region; returns what happened: created, updated or unchanged."""
    path = f"/v1/regions/{spec.name}"
    what = f"region put {spec.name}"
    current = expect(client.call("GET", path), what, 200, 404)
    if current.status_code == 200:
        view = current.json()
        if view.get("is_deleting"):
            raise AdminCliError(
                f"{what}: the region is being deleted (its nodes are draining); "
                "wait until it is gone, or cancel the delete by setting its state to active"
            )
        if spec.matches(view):
            return "unchanged"
    else:
        created = client.call("POST", "/v1/regions", {"name": spec.name, **spec.fields()})
        if created.status_code == 201:
            return "created"
        expect(created, what, 409)  # registered meanwhile by someone else: update it
    expect(client.call("PATCH", path, spec.fields()), what, 200)
    return "updated"


def delete_region(client: AdminClient, name: str, wait_s: float) -> str:
    """Delete the region; returns deleted, already absent, or deleting (its nodes drain first,
    and it was not gone within `wait_s`, which is then an error unless `wait_s` is 0)."""
    path = f"/v1/regions/{name}"
    what = f"region delete {name}"
    response = expect(client.call("DELETE", path), what, 202, 204, 404)
    if response.status_code != 202:
        return "deleted" if response.status_code == 204 else "already absent"
    if wait_s <= 0:
        return "deleting (its nodes drain first)"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        if expect(client.call("GET", path), what, 200, 404).status_code == 404:
            return "deleted (after its nodes drained)"
    raise AdminCliError(
        f"{what}: still deleting after {wait_s:g} s while its nodes drain; "
        "run it again to keep waiting"
    )


def mint_node_credential(client: AdminClient, node_id: str, region: str, url: str | None) -> str:
    """A new heartbeat token for `node_id`, bound to `region` (and `url`); returns the token."""
    body: dict[str, Any] = {"region": region} | ({"url": url} if url is not None else {})
    response = client.call("POST", f"/v1/nodes/{node_id}/credential", body)
    token: str = expect(response, f"node credential {node_id}", 201).json()["token"]
    return token


def mint_xds_credential(client: AdminClient, name: str, region: str | None) -> str:
    """A new xDS token named `name`, for the ingress of `region` (None: the edge); returns it."""
    body: dict[str, Any] = {"role": "ingress", "region": region} if region else {"role": "edge"}
    response = client.call("POST", f"/v1/xds/credentials/{name}", body)
    token: str = expect(response, f"xds credential {name}", 201).json()["token"]
    return token


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only (created so: never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def _connection(args: argparse.Namespace) -> tuple[str, str]:
    url = args.control_plane or os.environ.get(URL_ENV, "")
    if not url:
        raise AdminCliError(f"set {URL_ENV} (or --control-plane) to the control plane's URL", 2)
    try:
        ControlPlaneUrls.parse(url)
    except ValueError as exc:
        raise AdminCliError(
            f"control plane URL must be http(s)://HOST[:PORT] (replicas: URL,URL,...), not "
            f"{url!r}: {exc}",
            2,
        ) from exc
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise AdminCliError(f"set {TOKEN_ENV} to the control plane's admin token", 2)
    return url, token


def run(args: argparse.Namespace) -> str:
    url, token = _connection(args)
    client = AdminClient(url, token)
    try:
        if args.resource == "model":
            return admin_models.run_model(client, args)
        if args.resource == "key":
            lines, secret = admin_keys.run_key(client, args)
            if secret is not None:
                write_private(args.secret_file, secret + "\n")
            return lines
        if args.resource == "xds":
            token = mint_xds_credential(client, args.name, args.region)
            write_private(args.token_file, token + "\n")
            return f"xds credential {args.name}: written to {args.token_file}"
        if args.resource == "node":
            done = []
            for node_id, node_url in args.nodes:
                token = mint_node_credential(client, node_id, args.region, node_url)
                path = args.token_dir / f"{node_id}.token"
                write_private(path, token + "\n")
                done.append(f"node {node_id}: credential written to {path}")
            return "\n".join(done)
        if args.action == "put":
            spec = RegionSpec(
                args.name, args.lat, args.lon, args.ingress_url, args.weight, args.picker
            )
            return f"region {spec.name}: {put_region(client, spec)}"
        return f"region {args.name}: {delete_region(client, args.name, args.wait_s)}"
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(run(args))
    except AdminCliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
