"""`picker: on` in the stack config: each region's endpoint picker laid out beside its Envoy, the
control plane told where it is (the region's `picker` field, registered by `up`), each node
agent told where to stream its cache events (`--picker-url`), the picker's own command line read
by its real settings, and its row in `meridian status` from its real /metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import start_http_server
from tf_helpers import start_control_plane, stop_control_plane

from control_plane.admin_cli import AdminClient
from node_agent.__main__ import load_settings as load_node_settings
from node_agent.__main__ import parse_args as parse_node_args
from region_picker.__main__ import load_settings as load_picker_settings
from region_picker.__main__ import parse_args as parse_picker_args
from region_picker.metrics import PickerMetrics
from stack import commands
from stack.config import parse_config
from stack.errors import StackConfigError, StackError
from stack.layout import plan_layout
from stack.picker_status import picker_rows
from stack.preflight import fresh_tokens
from stack.processes import STOP_ORDER
from stack.registration import register_regions
from stack.state import ProcessRecord, process_start_time

TWO_REGIONS = "regions: [{name: us-east, nodes: 2}, {name: eu-west, picker: off}]\n"


def test_the_picker_is_off_unless_asked_and_a_region_overrides_the_stack() -> None:
    assert not parse_config("regions: [{name: us-east}]").picker
    config = parse_config(TWO_REGIONS + "picker: on\n")
    assert [config.has_picker(region) for region in config.regions] == [True, False]
    only_one = parse_config("regions: [{name: us-east, picker: on}, {name: eu-west}]")
    assert [only_one.has_picker(region) for region in only_one.regions] == [True, False]
    with pytest.raises(StackConfigError, match="picker"):
        parse_config("regions: [{name: us-east}]\npicker: sometimes\n")


def test_each_picker_gets_its_ports_beside_its_envoy_and_needs_envoy() -> None:
    config = parse_config("regions: [{name: us-east}, {name: eu-west}]\npicker: on\n")
    layout = plan_layout(config, use_envoy=True)
    pickers = [region.picker for region in layout.regions]
    assert [(p.port, p.metrics_port, p.cache_events_port) for p in pickers if p] == [
        (10701, 10801, 10901),
        (10702, 10802, 10902),
    ]
    owners = dict(layout.tcp_ports())
    assert owners[10701] == "picker us-east" and owners[10902] == "picker eu-west cache events"
    with pytest.raises(StackError, match="region us-east has a picker, which only its Envoy"):
        plan_layout(config, use_envoy=False)
    clash = parse_config("regions: [{name: us-east}]\npicker: on\nports: {picker_base: 10001}")
    with pytest.raises(StackError, match="Envoy us-east and picker us-east would both listen"):
        plan_layout(clash, use_envoy=True)


def test_commands_wire_the_control_plane_the_nodes_and_the_picker_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse_config(TWO_REGIONS + "picker: on\n")
    layout = plan_layout(config, use_envoy=True)
    tokens = fresh_tokens()
    monkeypatch.setenv(commands.NODE_TOKEN, "node-token-" + "n" * 16)
    node_tokens = {node.node_id: "t" for node in layout.nodes}
    nodes = commands.node_agents(config, layout, tokens, node_tokens)
    urls = {c.name: load_node_settings(parse_node_args(list(c.argv[3:]))).picker_url for c in nodes}
    assert urls == {
        "node us-east-00": "ws://127.0.0.1:10901",
        "node us-east-01": "ws://127.0.0.1:10901",
        "node eu-west-00": None,
    }

    picker = commands.picker(config, layout, layout.regions[0], tokens)
    assert (picker.kind, picker.url) == ("picker", "http://127.0.0.1:10801/metrics")
    assert picker.env[commands.GATEWAY_TOKEN] == tokens[commands.GATEWAY_TOKEN]
    assert commands.ADMIN_TOKEN not in picker.env and tokens[
        commands.GATEWAY_TOKEN
    ] not in " ".join(picker.argv)
    monkeypatch.setenv(commands.GATEWAY_TOKEN, picker.env[commands.GATEWAY_TOKEN])
    settings = load_picker_settings(parse_picker_args(list(picker.argv[3:])))
    assert (settings.region, settings.port, settings.metrics_port, settings.cache_events_port) == (
        "us-east",
        10701,
        10801,
        10901,
    )
    assert settings.control_plane == layout.control_plane_url
    assert settings.models == {"smollm2-135m-instruct": "smollm2-135m-instruct"}
    # Envoy goes on without its picker: it stops after Envoy, before the control plane.
    assert (
        STOP_ORDER.index("envoy") < STOP_ORDER.index("picker") < STOP_ORDER.index("control-plane")
    )


@pytest.mark.slow  # starts a control plane
def test_up_registers_each_regions_picker_with_the_control_plane(tmp_path: Path) -> None:
    layout = plan_layout(parse_config(TWO_REGIONS + "picker: on\n"), use_envoy=True)
    control_plane = start_control_plane(tmp_path)
    try:
        client = AdminClient(control_plane.base_url, control_plane.admin_token)
        said: list[str] = []
        register_regions(client, layout, said.append)
        client.close()
        regions = control_plane.regions()
    finally:
        stop_control_plane(control_plane)
    assert {name: region["picker"] for name, region in regions.items()} == {
        "us-east": "127.0.0.1:10701",
        "eu-west": None,
    }


@pytest.fixture
def picker_metrics() -> Iterator[str]:
    metrics = PickerMetrics()
    server, thread = start_http_server(0, "127.0.0.1", metrics.registry)
    metrics.decisions.labels("us-east-00").inc(3)
    metrics.decisions.labels("us-east-01").inc(1)
    metrics.cache_hits.inc(2)
    metrics.predicted_cached_tokens.inc(300)
    metrics.prompt_block_tokens.inc(400)
    metrics.fallback("no_candidate")
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


def test_status_shows_each_pickers_decisions_or_that_it_is_down(picker_metrics: str) -> None:
    me, started = os.getpid(), process_start_time(os.getpid()) or ""
    up = ProcessRecord("picker us-east", "picker", me, started, "", picker_metrics)
    down = ProcessRecord("picker eu-west", "picker", me, "not this one", "", picker_metrics)
    node = ProcessRecord("node us-east-00", "node", me, started, "", "x")
    rows = picker_rows([up, down, node])
    assert rows[1:] == [
        ["us-east", "4", "2", "75.0%", "1", "0"],
        ["eu-west", "DOWN: Envoy balances by least request", "", "", "", ""],
    ]
    assert picker_rows([node]) == []
