"""The default fleet's models against a real control plane: `up`'s registration writes the catalog
(the models, the second one's fallback to the default, the `chat-default` alias), and `meridian
status` shows each model with the regions serving it and their healthy nodes, as the control plane
summarises the nodes' heartbeats, and a node of a model the catalog does not list as unlisted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bounded_wait import wait_until
from tf_helpers import ControlPlane, start_control_plane, stop_control_plane

from control_plane.admin_cli import AdminClient, mint_node_credential
from engine.model_store import DEFAULT_MODEL
from stack.config import load_config
from stack.layout import plan_layout
from stack.registration import register_models, register_regions
from stack.status import fleet_lines, model_lines

pytestmark = pytest.mark.slow  # starts a control plane

FP32 = f"{DEFAULT_MODEL}-fp32"


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    control_plane = start_control_plane(tmp_path)
    yield control_plane
    stop_control_plane(control_plane)


@pytest.fixture
def admin(control_plane: ControlPlane) -> Iterator[AdminClient]:
    client = AdminClient(control_plane.base_url, control_plane.admin_token)
    yield client
    client.close()


def _beat(control_plane: ControlPlane, token: str, node_id: str, url: str, model: str) -> None:
    """One heartbeat, as the node agent `node_id` would send it."""
    region = node_id.rsplit("-", 1)[0]
    beat: dict[str, object] = {"node_id": node_id, "region": region, "url": url, "model": model}
    beat |= {"kv_blocks_total": 100, "kv_blocks_free": 90, "block_size": 16, "timestamp": 1.0}
    response = httpx.post(
        f"{control_plane.base_url}/v1/nodes/heartbeat",
        json=beat,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10.0,
    )
    assert response.status_code == 200, response.text


def test_up_registers_the_catalog_and_status_shows_each_models_regions(
    control_plane: ControlPlane, admin: AdminClient
) -> None:
    config = load_config()
    layout = plan_layout(config, use_envoy=True)
    said: list[str] = []
    credentials = register_regions(admin, layout, said.append)
    register_models(admin, config.catalog(), said.append)
    assert said[-1] == (
        f"  models registered: {DEFAULT_MODEL}, {FP32}, alias chat-default → {DEFAULT_MODEL}"
    )
    # A node beside them serving a model the catalog does not list.
    stray = mint_node_credential(admin, "us-east-09", "us-east", "http://127.0.0.1:9009")

    def listed() -> dict[str, Any] | None:
        for node in layout.nodes:
            _beat(
                control_plane,
                credentials.node_tokens[node.node_id],
                node.node_id,
                node.url,
                node.model,
            )
        _beat(control_plane, stray, "us-east-09", "http://127.0.0.1:9009", "stray-model")
        listing: dict[str, Any] = control_plane.get("/v1/models").json()
        healthy = {model["id"]: model["healthy_nodes"] for model in listing["data"]}
        return listing if healthy == {DEFAULT_MODEL: 3, FP32: 1} else None

    listing = wait_until(listed, 30.0, "the four nodes' models in the catalog's listing")
    assert [" ".join(line.split()) for line in model_lines(listing)] == [
        "MODEL HEALTHY REGIONS (HEALTHY NODES) FALLBACKS ALIASES",
        f"{DEFAULT_MODEL} 3 ap-southeast 1, eu-west 1, us-east 1 - chat-default",
        f"{FP32} 1 eu-west 1 {DEFAULT_MODEL} -",
        "stray-model (unlisted; no route) 1 us-east 1 - -",
    ]
    status: dict[str, Any] = control_plane.get("/v1/status").json()
    lines = fleet_lines(status, None, listing)
    nodes = lines[lines.index("", lines.index("") + 1) + 1 :]
    assert [line.split()[:3] for line in nodes[1:]] == [
        ["ap-southeast-00", "ap-southeast", DEFAULT_MODEL],
        ["eu-west-00", "eu-west", DEFAULT_MODEL],
        ["eu-west-01", "eu-west", FP32],
        ["us-east-00", "us-east", DEFAULT_MODEL],
        ["us-east-09", "us-east", "stray-model"],
    ]
    assert "stray-model (unlisted)" in nodes[-1]
    assert model_lines("not reachable (ConnectError)") == ["  models: not reachable (ConnectError)"]
