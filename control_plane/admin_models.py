"""`admin_cli model ...`: the model catalog from scripts (`control_plane.api.models`).

model list
model add NAME [--owned-by OWNER] [--fallback MODEL ...]
model alias NAME TARGET          creates the alias, or moves it (a rollout's flip)
model fallbacks NAME [MODEL ...] the model's fallbacks, in order (none: cleared)
model remove NAME                no error if absent
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from control_plane.admin_client import AdminClient, AdminCliError, expect
from wire.model_catalog import MODEL_NAME_PATTERN

PATH = "/v1/models"


def model_name(value: str) -> str:
    """argparse type: a model or alias name as the catalog accepts it."""
    if not re.match(MODEL_NAME_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a model name ({MODEL_NAME_PATTERN})")
    return value


def add_parser(resources: Any) -> None:
    """The `model` resource and its actions, under the CLI's resources."""
    model = resources.add_parser("model", help="the model catalog: models, aliases, fallbacks")
    actions = model.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="models (with the regions serving each), aliases, unlisted")
    add = actions.add_parser("add", help="add a model")
    add.add_argument("name", type=model_name)
    add.add_argument("--owned-by", help="shown to clients as owned_by (default meridian)")
    add.add_argument(
        "--fallback",
        dest="fallbacks",
        type=model_name,
        action="append",
        help="a model or alias to serve instead when it has no capacity (repeat, in order)",
    )
    alias = actions.add_parser("alias", help="point an alias at a model or alias (create or move)")
    alias.add_argument("name", type=model_name)
    alias.add_argument("target", type=model_name)
    fallbacks = actions.add_parser("fallbacks", help="set a model's fallbacks (none: clear them)")
    fallbacks.add_argument("name", type=model_name)
    fallbacks.add_argument("fallbacks", type=model_name, nargs="*", metavar="MODEL")
    remove = actions.add_parser("remove", help="remove a model or alias (no error if absent)")
    remove.add_argument("name", type=model_name)


def run_model(client: AdminClient, args: argparse.Namespace) -> str:
    """One `model` action; what it did, as the lines to print."""
    name: str = getattr(args, "name", "")
    what = f"model {args.action} {name}".rstrip()
    if args.action == "list":
        return "\n".join(list_lines(expect(client.call("GET", PATH), what, 200).json()))
    if args.action == "add":
        body: dict[str, Any] = {"name": name, "fallbacks": args.fallbacks or []}
        body |= {"owned_by": args.owned_by} if args.owned_by else {}
        expect(client.call("POST", PATH, body), what, 201)
        return f"model {name}: added"
    if args.action == "alias":
        return f"alias {name}: {point_alias(client, name, args.target, what)}"
    if args.action == "fallbacks":
        body = {"fallbacks": args.fallbacks}
        expect(client.call("PATCH", f"{PATH}/{name}", body), what, 200)
        return f"model {name}: fallbacks {', '.join(args.fallbacks) or 'cleared'}"
    response = expect(client.call("DELETE", f"{PATH}/{name}"), what, 204, 404)
    return f"{name}: {'removed' if response.status_code == 204 else 'already absent'}"


def point_alias(client: AdminClient, name: str, target: str, what: str) -> str:
    """Create the alias, or move it to `target`; returns what happened."""
    current = expect(client.call("GET", f"{PATH}/{name}"), what, 200, 404)
    if current.status_code == 404:
        expect(client.call("POST", PATH, {"name": name, "target": target}), what, 201)
        return f"created -> {target}"
    view = current.json()
    if "target" not in view:
        raise AdminCliError(f"{what}: {name!r} is a model, not an alias")
    if view["target"] == target:
        return f"unchanged -> {target}"
    expect(client.call("PATCH", f"{PATH}/{name}", {"target": target}), what, 200)
    return f"moved {view['target']} -> {target}"


def list_lines(listing: dict[str, Any]) -> list[str]:
    """`GET /v1/models` as lines: each model, then each alias, then each unlisted model."""
    lines = [
        f"model {m['id']}  owned_by {m['owned_by']}  fallbacks {_names(m['fallbacks'])}  "
        f"aliases {_names(m['aliases'])}  regions {_regions(m['regions'])}"
        for m in listing["data"]
    ]
    lines += [f"alias {a['name']} -> {a['target']} ({a['model']})" for a in listing["aliases"]]
    lines += [
        f"unlisted {u['name']}  regions {_regions(u['regions'])}  "
        + ("routed (the catalog is empty)" if u["is_routed"] else "not routed until listed")
        for u in listing["unlisted"]
    ]
    return lines or ["the catalog is empty and no node serves a model"]


def _names(names: list[str]) -> str:
    return ",".join(names) or "-"


def _regions(regions: list[dict[str, Any]]) -> str:
    serving = ",".join(f"{r['name']}:{r['healthy_nodes']}" for r in regions)
    return serving or "none (no capacity)"
