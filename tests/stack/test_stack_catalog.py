"""The default fleet's models against a real control plane: `meridian status` shows each region's
models with their healthy nodes as the control plane summarises the nodes' heartbeats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bounded_wait import wait_until
from tf_helpers import ControlPlane, start_control_plane, stop_control_plane

from control_plane.admin_cli import AdminClient
from engine.model_store import DEFAULT_MODEL
from stack.config import load_config
from stack.layout import StackLayout, plan_layout
from stack.registration import Credentials, register_regions
from stack.status import fleet_lines

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


def _beat(layout: StackLayout, credentials: Credentials, control_plane: ControlPlane) -> None:
    """One heartbeat from each node of the layout, as its node agent would send it."""
    for region in layout.regions:
        for node in region.nodes:
            beat = {
                "node_id": node.node_id,
                "region": region.name,
                "url": node.url,
                "model": node.model,
                "kv_blocks_total": 100,
                "kv_blocks_free": 90,
                "block_size": 16,
                "timestamp": 1.0,
            }
            token = credentials.node_tokens[node.node_id]
            response = httpx.post(
                f"{control_plane.base_url}/v1/nodes/heartbeat",
                json=beat,
                headers={"Authorization": f"Bearer {token}"},
                timeout=10.0,
            )
            assert response.status_code == 200, response.text


def test_status_shows_each_regions_models_and_healthy_nodes(
    control_plane: ControlPlane, admin: AdminClient
) -> None:
    layout = plan_layout(load_config(), use_envoy=True)
    said: list[str] = []
    credentials = register_regions(admin, layout, said.append)

    def summarised() -> dict[str, Any] | None:
        _beat(layout, credentials, control_plane)
        status: dict[str, Any] = control_plane.get("/v1/status").json()
        loads = [load for region in status["regions"] for load in region.get("models", [])]
        return status if sum(load["healthy_nodes"] for load in loads) == 4 else None

    status = wait_until(summarised, 30.0, "the four nodes' models in the region summaries")
    lines = fleet_lines(status, None)
    models = lines[lines.index("") + 1 : lines.index("", lines.index("") + 1)]
    assert [line.split()[:3] for line in models] == [
        ["MODEL", "REGION", "HEALTHY"],
        [DEFAULT_MODEL, "ap-southeast", "1"],
        [DEFAULT_MODEL, "eu-west", "1"],
        [DEFAULT_MODEL, "us-east", "1"],
        [FP32, "eu-west", "1"],
    ]
    nodes = lines[lines.index("", lines.index("") + 1) + 1 :]
    assert [line.split()[:3] for line in nodes[1:]] == [
        ["ap-southeast-00", "ap-southeast", DEFAULT_MODEL],
        ["eu-west-00", "eu-west", DEFAULT_MODEL],
        ["eu-west-01", "eu-west", FP32],
        ["us-east-00", "us-east", DEFAULT_MODEL],
    ]
