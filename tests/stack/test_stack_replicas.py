"""`control_plane: {replicas: 2, db: postgres}`: where each replica listens, and that every
client of the control plane (node agents, gateways, Envoy, `meridian status`) is given all of
them. Pure layout and command lines; the real bring-up is tests/stack/test_stack_replicas_up.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from control_plane.xds import bootstrap
from stack import commands
from stack.certs import GatewayTls
from stack.config import parse_config
from stack.errors import StackError
from stack.layout import plan_layout
from stack.postgres import LocalPostgres
from stack.preflight import fresh_tokens
from stack.servers import PostgresNotFoundError, postgres_bin_dir
from stack.state import StateDir
from stack.status import replica_lines

TWO_REPLICAS = (
    "regions: [{name: us-east}]\npops: [new-york, london]\n"
    "control_plane: {replicas: 2, db: postgres}\n"
)


def _argument(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_replicas_listen_one_port_apart_on_one_postgres() -> None:
    layout = plan_layout(parse_config(TWO_REPLICAS), use_envoy=True)
    replicas = layout.control_planes
    assert [(r.name, r.port, r.xds_port, r.dns_port) for r in replicas] == [
        ("control-plane 1", 8080, 18000, 8053),
        ("control-plane 2", 8081, 18001, 8054),
    ]
    assert layout.control_plane_urls == "http://127.0.0.1:8080,http://127.0.0.1:8081"
    assert layout.xds_addresses == ("127.0.0.1:18000", "127.0.0.1:18001")
    assert layout.postgres_url == "postgresql://meridian@127.0.0.1:5433/postgres"
    owners = dict(layout.tcp_ports())
    assert owners[8081] == "control plane 2" and owners[18001] == "control plane 2 xDS"
    assert owners[5433] == "postgres"


def test_the_default_is_one_replica_on_sqlite_as_before() -> None:
    layout = plan_layout(parse_config("regions: [{name: us-east}]"), use_envoy=True)
    (replica,) = layout.control_planes
    assert (replica.name, replica.port, replica.xds_port, replica.dns_port) == (
        "control-plane",
        8080,
        18000,
        8053,
    )
    assert layout.control_plane_urls == layout.control_plane_url == "http://127.0.0.1:8080"
    assert layout.postgres_url is None
    assert "postgres" not in dict(layout.tcp_ports()).values()
    tokens = fresh_tokens()
    (command,) = commands.control_planes(layout, Path("/s/cp.db"), tokens, Path("/s/ca.pem"))
    assert _argument(command.argv, "--db") == "/s/cp.db"


def test_a_second_replica_that_would_take_another_port_is_refused() -> None:
    crowded = TWO_REPLICAS + "ports: {control_plane: 8080, xds: 8081}\n"
    with pytest.raises(StackError, match="control plane 1 xDS and control plane 2 would both"):
        plan_layout(parse_config(crowded), use_envoy=False)


def test_every_replica_runs_on_the_postgres_and_every_client_gets_all_of_them() -> None:
    config = parse_config(TWO_REPLICAS)
    layout = plan_layout(config, use_envoy=True)
    tokens = fresh_tokens()
    replicas = commands.control_planes(layout, Path("/s/cp.db"), tokens, Path("/s/ca.pem"))
    assert [(c.name, c.kind, c.url) for c in replicas] == [
        ("control-plane 1", "control-plane", "http://127.0.0.1:8080"),
        ("control-plane 2", "control-plane", "http://127.0.0.1:8081"),
    ]
    for command, port in zip(replicas, ("8080", "8081"), strict=True):
        assert _argument(command.argv, "--db") == layout.postgres_url
        assert _argument(command.argv, "--port") == port
    assert [c.env["MERIDIAN_CP_REPLICA_ID"] for c in replicas] == [
        "control-plane-1",
        "control-plane-2",
    ]
    urls = "http://127.0.0.1:8080,http://127.0.0.1:8081"
    (node,) = commands.node_agents(config, layout, tokens, {"us-east-00": "t"})
    assert _argument(node.argv, "--control-plane") == urls
    tls = GatewayTls(Path("c"), Path("k"), Path("ca"))
    for pop in layout.pops:
        gateway = commands.gateway(config, layout, pop, tls, tokens)
        assert _argument(gateway.argv, "--control-plane") == urls


def test_envoy_is_bootstrapped_with_every_replicas_xds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bootstrap.TOKEN_ENV, "mxds-" + "t" * 40)  # `meridian up` mints it
    layout = plan_layout(parse_config(TWO_REPLICAS), use_envoy=True)
    argv = commands.envoy_bootstrap(layout, layout.regions[0])
    args = bootstrap.parse_args(list(argv[argv.index("envoy-bootstrap") + 1 :]))
    document = bootstrap.render(bootstrap.config_of(args))
    (cluster,) = document["static_resources"]["clusters"]
    (locality,) = cluster["load_assignment"]["endpoints"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in locality["lb_endpoints"]
    ]
    assert ports == [18000, 18001]
    assert cluster["type"] == "STATIC"


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--xds", "127.0.0.1:18000"], "an --xds address is given twice"),
        (
            ["--xds", "cp2.example:18000", "--xds-ca", "ca.pem"],
            "with --xds-ca every --xds must name the same host (one certificate, one SNI)",
        ),
    ],
)
def test_bad_replica_xds_lists_are_one_line(extra: list[str], error: str) -> None:
    argv = ["--region", "r", "--listen", "127.0.0.1:1", "--xds", "127.0.0.1:18000", *extra]
    with pytest.raises(ValueError) as caught:
        bootstrap.config_of(bootstrap.parse_args(argv))
    assert str(caught.value) == error


def test_status_shows_which_replica_leads_and_which_is_unreachable() -> None:
    leader = {"replica": {"id": "control-plane-1", "is_leader": True, "epoch": 3}}
    follower = {"replica": {"id": "control-plane-2", "is_leader": False, "epoch": None}}
    lines = replica_lines(
        {
            "control-plane 1": ("http://127.0.0.1:8080", leader),
            "control-plane 2": ("http://127.0.0.1:8081", follower),
            "control-plane 3": ("http://127.0.0.1:8082", "not reachable (ConnectError)"),
        }
    )
    assert [line.split() for line in lines] == [
        ["REPLICA", "URL", "ROLE", "ID", "EPOCH"],
        ["control-plane", "1", "http://127.0.0.1:8080", "leader", "control-plane-1", "3"],
        ["control-plane", "2", "http://127.0.0.1:8081", "follower", "control-plane-2", "-"],
        [
            "control-plane",
            "3",
            "http://127.0.0.1:8082",
            "not",
            "reachable",
            "(ConnectError)",
            "-",
            "-",
        ],
    ]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL changes user only for root")
def test_root_runs_postgres_outside_a_state_directory_under_a_closed_home(tmp_path: Path) -> None:
    """Root's default state directory is under /root (0700), which the server user cannot enter."""
    try:
        postgres_bin_dir()
    except PostgresNotFoundError:
        pytest.skip("no PostgreSQL server binaries")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    state_dir = StateDir(home / ".cache" / "meridian" / "stack")
    data_dir = state_dir.postgres_dir
    assert not data_dir.is_relative_to(home)
    with tempfile.TemporaryDirectory() as open_dir:  # under /tmp, as `meridian up`'s tests use
        Path(open_dir).chmod(0o711)
        stack_dir = Path(open_dir) / "stack"
        assert StateDir(stack_dir).postgres_dir == stack_dir / "postgres"
    server = LocalPostgres(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)
    try:
        server.start()
        url = server.create_database("probe")
        assert url.endswith("/probe")
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
