"""`meridian status`: the recorded processes (up or not), the fleet as the control plane and
the gateway see it (regions, the models each serves, nodes, load), and each key's spend in its
current period per model."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any, Final

import httpx

from stack.commands import ADMIN_TOKEN
from stack.front_cli import anycast_lines
from stack.picker_status import picker_rows
from stack.state import StackState, StateDir
from stack.summary import count, dns_endpoints
from stack.supervisor import Say

TIMEOUT_S: Final = 5.0


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def process_lines(state: StackState) -> list[str]:
    rows = [["PROCESS", "PID", "STATE", "URL", "LOG"]]
    supervisor = state.supervisor
    if not state.detached:
        alive = "up" if supervisor.is_running() else "exited"
        rows.append(["meridian up", str(supervisor.pid), alive, "", ""])
    for record in state.processes:
        alive = "up" if record.is_running() else "DOWN"
        rows.append([record.name, str(record.pid), alive, record.url or "", record.log])
    return _table(rows)


def _get_json(url: str, **kwargs: Any) -> dict[str, Any] | str:
    """The JSON body, or a one-line reason it could not be had."""
    try:
        with httpx.Client(timeout=TIMEOUT_S, trust_env=False, **kwargs) as client:
            response = client.get(url)
    except httpx.HTTPError as exc:
        return f"not reachable ({exc.__class__.__name__})"
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        return f"answered {response.status_code} without JSON"
    return body


def fleet_lines(
    status: dict[str, Any], gateway: dict[str, Any] | None, models: dict[str, Any] | str
) -> list[str]:
    """Regions and nodes from the control plane's `GET /v1/status` (and the gateway's view),
    and the models from its `GET /v1/models` (or why they could not be had)."""
    seen = (gateway or {}).get("regions", {})
    rows = [["REGION", "STATE", "HEALTHY", "KV FREE", "WAITING", "QUEUE S", "RTT MS", "BREAKER"]]
    for region in status["regions"]:
        view = seen.get(region["name"], {})
        rows.append(
            [
                region["name"],
                region["state"],
                str(region["healthy_nodes"]),
                f"{region['kv_blocks_free']}/{region['kv_blocks_total']}",
                str(region["queue"]["num_waiting"]),
                f"{region['queue']['expected_queue_delay_s']:.2f}",
                str(view.get("rtt_ms", "-")),
                str(view.get("breaker", "-")),
            ]
        )
    lines = [*_table(rows), "", *model_lines(models)]
    rows = [["NODE", "REGION", "MODEL", "HEALTH", "RUNNING", "WAITING", "KV FREE", "TOK/S"]]
    for node in status["nodes"]:
        beat = node.get("last_heartbeat") or {}
        health = "healthy" if node["is_healthy"] else "UNHEALTHY"
        if node["is_draining"]:
            health += ",draining"
        model = node.get("model", "-") + ("" if node.get("listed", True) else " (unlisted)")
        rows.append(
            [
                node["node_id"],
                node["region"],
                model,
                health,
                str(beat.get("num_running", "-")),
                str(beat.get("num_waiting", "-")),
                f"{beat.get('kv_blocks_free', '-')}/{beat.get('kv_blocks_total', '-')}",
                f"{beat.get('decode_tokens_per_s', 0.0):.1f}",
            ]
        )
    return [*lines, "", *_table(rows)]


def model_lines(listing: dict[str, Any] | str) -> list[str]:
    """The catalog's models (`GET /v1/models`), each with the regions serving it and their
    healthy nodes (none: no capacity anywhere), its fallbacks and aliases; then the models nodes
    serve that the catalog does not list (routed only while the catalog is empty)."""
    if isinstance(listing, str) or "data" not in listing:
        return [f"  models: {listing if isinstance(listing, str) else 'unexpected answer'}"]
    rows = [["MODEL", "HEALTHY", "REGIONS (HEALTHY NODES)", "FALLBACKS", "ALIASES"]]
    for model in listing["data"]:
        rows.append(
            [
                model["id"],
                str(model["healthy_nodes"]),
                _serving(model["regions"]),
                ", ".join(model["fallbacks"]) or "-",
                ", ".join(model["aliases"]) or "-",
            ]
        )
    for model in listing.get("unlisted", []):
        routed = "routed: the catalog is empty" if model["is_routed"] else "no route"
        healthy = sum(region["healthy_nodes"] for region in model["regions"])
        name = f"{model['name']} (unlisted; {routed})"
        rows.append([name, str(healthy), _serving(model["regions"]), "-", "-"])
    return _table(rows) if len(rows) > 1 else ["  (no model: the catalog is empty, no node)"]


def _serving(regions: list[dict[str, Any]]) -> str:
    return ", ".join(f"{region['name']} {region['healthy_nodes']}" for region in regions) or "none"


def spend_lines(keys: list[dict[str, Any]], spends: dict[str, dict[str, Any] | str]) -> list[str]:
    """Each active key's spend in its current period (`GET /v1/keys/{id}/spend`, or why it
    could not be had), per model, against its budget."""
    rows = [["KEY", "NAME", "MODEL", "SPENT", "BUDGET", "PERIOD", "RESETS"]]
    for key in keys:
        spend = spends.get(key["id"], "not asked")
        if isinstance(spend, str):
            rows.append([key["id"], key["name"], spend, "-", "-", "-", "-"])
            continue
        budget = spend["max_budget_tokens"]
        resets = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(spend["period_end"]))
        left = "" if budget is None or spend["remaining_tokens"] else " (SPENT)"
        rows.append(
            [
                key["id"],
                key["name"],
                "(all)",
                str(spend["spent_tokens"]),
                "-" if budget is None else f"{budget}{left}",
                spend["budget_period"],
                resets,
            ]
        )
        for model, tokens in sorted(spend["models"].items()):
            rows.append(["", "", model, str(tokens), "", "", ""])
    if len(rows) == 1:
        return ["  (no API key)"]
    return _table(rows)


def key_spends(url: str, headers: dict[str, str]) -> list[str]:
    """The spend section: every active key's, from the control plane at `url`."""
    listed = _get_json(f"{url}/v1/keys", headers=headers)
    if isinstance(listed, str) or "keys" not in listed:
        return [f"  keys: {listed if isinstance(listed, str) else 'unexpected answer'}"]
    keys = [key for key in listed["keys"] if key.get("revoked_at") is None]
    spends = {
        key["id"]: _get_json(f"{url}/v1/keys/{key['id']}/spend", headers=headers) for key in keys
    }
    return spend_lines(keys, spends)


def replica_lines(answers: dict[str, tuple[str, dict[str, Any] | str]]) -> list[str]:
    """Each control-plane replica (name → its URL and its `GET /v1/status` or why not), and which
    one leads."""
    rows = [["REPLICA", "URL", "ROLE", "ID", "EPOCH"]]
    for name, (url, answer) in answers.items():
        replica = answer.get("replica") if isinstance(answer, dict) else None
        if not isinstance(replica, dict):
            reason = answer if isinstance(answer, str) else "unexpected answer"
            rows.append([name, url, reason, "-", "-"])
            continue
        role = "leader" if replica["is_leader"] else "follower"
        epoch = replica.get("epoch")
        rows.append([name, url, role, replica["id"], "-" if epoch is None else str(epoch)])
    return _table(rows)


def live_limits(state: StackState) -> str:
    """The limits mode `up` set, and which PoPs' redis-servers have gone (those PoPs limit in
    their gateway process, from the levels last seen, until it is back)."""
    down = [
        r.name.removeprefix("redis ")
        for r in state.processes
        if r.kind == "redis" and not r.is_running()
    ]
    if down:
        return (
            f"{state.limits}; redis-server DOWN at {', '.join(down)}: limiting in the gateway "
            "process there, from the levels last seen"
        )
    return state.limits


def pop_tiers(health: dict[str, Any]) -> str:
    """A PoP's tiers from its /health; an edge whose breaker is not closed says so, since the
    PoP then sends its light `auto` requests to the regions."""
    edge = health.get("edge")
    if not edge:
        return "region"
    breaker = edge.get("breaker", "?")
    return "edge+region" if breaker == "closed" else f"edge (breaker {breaker})+region"


def front_lines(state: StackState) -> list[str]:
    """Each PoP's health and tiers, and the Anycast front's routes."""
    if not state.pops:
        return []
    context = ssl.create_default_context(cafile=state.ca_cert) if state.ca_cert else None
    rows = [["POP", "URL", "HEALTH", "TIERS", "METRICS"]]
    for name, url in state.pops.items():
        health = _get_json(f"{url}/health", verify=context) if context is not None else "no CA"
        metrics = state.pop_metrics.get(name, "-")
        if isinstance(health, str):
            rows.append([name, url, health, "-", metrics])
        else:
            rows.append([name, url, str(health.get("status", "?")), pop_tiers(health), metrics])
    lines = ["", *_table(rows)]
    if state.anycast_url:
        front = _get_json(f"{state.anycast_url}/v1/anycast")
        lines.append("")
        if isinstance(front, str):
            lines.append(f"Anycast front {state.anycast_url}: {front}")
        else:
            lines += anycast_lines(front)
    return lines


def status(state_root: Path, say: Say) -> int:
    state_dir = StateDir(state_root)
    state = state_dir.read()
    if state is None:
        say(f"no stack is running (nothing recorded in {state_root}); start one with `meridian up`")
        return 1
    mode = "detached" if state.detached else "foreground"
    phase = "ready" if state.ready else "starting"
    say(f"Meridian stack ({mode}, {phase}); state in {state_root}")
    say(f"  gateway {state.gateway_url}/v1   CA {state.ca_cert}")
    if state.limits:
        say(f"  limits: {live_limits(state)}")
    if state.dns_name:
        say(f"  DNS: {state.dns_name} on {dns_endpoints(state.dns_ports or [state.dns_port])}")
    say("")
    for line in process_lines(state):
        say(line)
    token = state_dir.read_tokens().get(ADMIN_TOKEN, "")
    replicas = state.control_planes or {"control-plane": state.control_plane_url}
    answers = {
        name: (url, _get_json(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}))
        for name, url in replicas.items()
    }
    if len(answers) > 1:
        say("")
        for line in replica_lines(answers):
            say(line)
    # The fleet as the first replica that answers sees it (every replica serves the same).
    fleet_url, fleet = next(
        (answer for answer in answers.values() if isinstance(answer[1], dict)),
        (state.control_plane_url, next(iter(answers.values()))[1]),
    )
    models = _get_json(f"{fleet_url}/v1/models", headers={"Authorization": f"Bearer {token}"})
    gateway: dict[str, Any] | str | None = None
    if state.ca_cert and Path(state.ca_cert).exists():
        context = ssl.create_default_context(cafile=state.ca_cert)
        gateway = _get_json(f"{state.gateway_url}/health", verify=context)
    say("")
    if isinstance(fleet, str) or "regions" not in fleet:
        reason = fleet if isinstance(fleet, str) else f"unexpected answer {fleet}"
        say(f"control plane {fleet_url}: {reason}")
    else:
        say(
            f"Fleet: {count(len(fleet['regions']), 'region')}, {fleet['num_healthy_nodes']}/"
            f"{fleet['num_nodes']} nodes healthy, {fleet['num_draining_nodes']} draining"
        )
        for line in fleet_lines(fleet, gateway if isinstance(gateway, dict) else None, models):
            say(line)
        say("")
        say("Spend (each key's current period):")
        for line in key_spends(fleet_url, {"Authorization": f"Bearer {token}"}):
            say(line)
    if isinstance(gateway, str):
        say(f"gateway {state.gateway_url}: {gateway}")
    elif isinstance(gateway, dict):
        say(f"gateway {state.gateway_url}: {gateway.get('status', '?')}")
    for line in front_lines(state):
        say(line)
    pickers = picker_rows(state.processes)
    if pickers:
        say("")
        for line in _table(pickers):
            say(line)
    is_all_up = all(record.is_running() for record in state.processes)
    return 0 if is_all_up else 1
