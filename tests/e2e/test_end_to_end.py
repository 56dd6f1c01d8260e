"""End to end, as a user and an operator would: `meridian up` from a YAML (two regions, one node
agent each, Envoy and the RTT proxy on), a third region provisioned with Terraform and served by a
node agent started from the module's output, chat over verified HTTPS with the official `openai`
client (whole and streamed), a region's node agent killed while requests keep succeeding, the
Terraform region destroyed, and `meridian down` leaving nothing running."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from bounded_wait import wait_until
from port_blocks import random_block_base
from suite_env import child_env
from tf_helpers import REPO_ROOT, Terraform, copy_terraform_tree, diagnostics

from stack.config import parse_config
from stack.errors import StackError
from stack.layout import StackLayout, check_ports_free, plan_layout
from stack.state import StateDir
from wire.geo import REGIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

MODEL = "smollm2-135m-instruct"
TF_REGION = "ap-southeast"
MAX_UP_S = 300.0
# The Terraform node's load waits behind whatever holds the CPU kernels' build lock: `make setup`
# builds them, but a run after a kernel source changed builds them in the suite, and before setup
# did, the node sat 180 s at "loading the CPU kernels" in 3 of 6 full runs (alone: seconds).
MAX_NODE_S = 400.0

ROOT_TF = """
variable "control_plane_url" { type = string }
variable "admin_token" {
  type      = string
  sensitive = true
}
variable "node_port" { type = number }

module "region" {
  source               = "../terraform/modules/region"
  name                 = "@REGION@"
  location             = { lat = @LAT@, lon = @LON@ }
  node_count           = 1
  gpus_per_node        = 1
  tensor_parallel_size = 1
  model                = "@MODEL@"
  base_port            = var.node_port
  ingress_url          = "http://127.0.0.1:${var.node_port}"
  control_plane_url    = var.control_plane_url
  admin_token          = var.admin_token
  deregister_timeout_s = 60
}

output "nodes" { value = module.region.nodes }
"""


def stack_config(tmp_path: Path) -> tuple[Path, StackLayout, int]:
    """A two-region YAML on ports nothing holds now, and a free port for the Terraform node."""
    for _ in range(50):
        base = random_block_base(span=70)
        text = (
            "regions:\n  - name: us-east\n    nodes: 1\n  - name: eu-west\n    nodes: 1\n"
            "node: {kv_cache_gib: 0.25, max_num_seqs: 8}\n"
            "pops: [new-york]\nclients: []\nlimits: local\n"
            f"ports: {{control_plane: {base}, xds: {base + 1}, dns: {base + 2}, "
            f"gateway: {base + 3}, node_base: {base + 10}, envoy_base: {base + 20}, "
            f"envoy_admin_base: {base + 30}, rtt_proxy_base: {base + 40}, "
            # Not the default 9464: another stack test may run beside this one (xdist).
            f"gateway_metrics: {base + 50}}}\n"
        )
        layout = plan_layout(parse_config(text), use_envoy=True)
        tf_port = base + 60
        try:
            check_ports_free(layout)
        except StackError:
            continue
        if not is_free(tf_port):
            continue
        path = tmp_path / "stack.yaml"
        path.write_text(text)
        return path, layout, tf_port
    raise AssertionError("no free port range found")


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def meridian_env() -> dict[str, str]:
    return child_env(keep=("MERIDIAN_HOME",))


def meridian(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stack", *args],
        cwd=REPO_ROOT,
        env=meridian_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@dataclass
class Stack:
    """A foreground `meridian up` and what it printed."""

    proc: subprocess.Popen[bytes]
    output_path: Path
    state_root: Path
    layout: StackLayout
    tf_port: int  # free, for the node agent of the region Terraform provisions

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def printed(self, label: str) -> str:
        found = re.search(rf"^  {label}   (\S+)", self.output(), re.MULTILINE)
        assert found, f"`meridian up` printed no {label}:\n{self.output()}"
        return found.group(1)

    def pid_of(self, name: str) -> int:
        state = StateDir(self.state_root).read()
        assert state is not None
        (record,) = [r for r in state.processes if r.name == name]
        assert record.is_running()
        return record.pid

    def admin_token(self) -> str:
        return StateDir(self.state_root).read_tokens()["MERIDIAN_ADMIN_TOKEN"]

    def admin_get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_token()}"}
        response = httpx.get(self.layout.control_plane_url + path, headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    config, layout, tf_port = stack_config(tmp_path)
    state_root = tmp_path / "state"
    output_path = tmp_path / "up.out"
    with output_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack", "up", "--config", str(config)]
            + ["--state-dir", str(state_root)],
            cwd=REPO_ROOT,
            env=meridian_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = Stack(proc, output_path, state_root, layout, tf_port)
    try:
        yield running
    finally:
        if proc.poll() is None:
            meridian("down", "--state-dir", str(state_root))
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def openai_client(stack: Stack) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=stack.printed("CA cert"))
    return openai.OpenAI(
        base_url=stack.printed("Gateway"),
        api_key=stack.printed("API key"),
        http_client=httpx.Client(verify=verify, timeout=60),
        max_retries=0,  # failover is the gateway's job, not the client's
    )


def chat(client: openai.OpenAI, content: str) -> tuple[str, str]:
    """One whole chat completion: (its text, the region that answered)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=12
    )
    completion = raw.parse()
    text = completion.choices[0].message.content or ""
    assert text.strip() and completion.usage is not None and completion.usage.completion_tokens
    return text, raw.headers["x-meridian-region"]


def stream(client: openai.OpenAI, content: str) -> list[str]:
    """A streamed chat completion, greedy: a sampled answer may be one word and a stop."""
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        temperature=0,
        stream=True,
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length") and len([p for p in pieces if p]) >= 2
    return pieces


def gateway_regions(stack: Stack) -> dict[str, Any]:
    verify = ssl.create_default_context(cafile=stack.printed("CA cert"))
    response = httpx.get(stack.printed("Gateway").removesuffix("/v1") + "/health", verify=verify)
    regions: dict[str, Any] = response.json()["regions"]
    return regions


def start_terraform_node(tmp_path: Path, node: dict[str, Any]) -> subprocess.Popen[bytes]:
    """The node agent exactly as the region module's output says, plus this machine's small KV
    cache; its own token, minted at apply into the file the output names."""
    token = Path(node["token_file"]).read_text().strip()
    env = meridian_env() | {"MERIDIAN_NODE_TOKEN": token, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "tf-node.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "node_agent", *node["args"]]
            + ["--kv-cache-gib", "0.25", "--max-num-seqs", "4"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_stack_terraform_openai_failover_and_down(
    tmp_path: Path,
    stack: Stack,
    offline_terraform_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1. `meridian up` gets ready and prints the URL, a key, the CA and examples.
    started = time.monotonic()
    wait_until(
        lambda: "Running in the foreground" in stack.output() or stack.proc.poll() is not None,
        MAX_UP_S,
        "meridian up",
        interval_s=0.25,
    )
    ready_s = time.monotonic() - started
    assert stack.proc.poll() is None, stack.output()
    assert "curl --cacert" in stack.output() and "openai.OpenAI(" in stack.output()
    print(f"meridian up ready in {ready_s:.1f} s")
    client = openai_client(stack)

    # 2. Chat over verified HTTPS with the official client, whole and streamed.
    _, region = chat(client, "What is the capital of France?")
    assert region in ("us-east", "eu-west")
    stream(client, "Name three colours.")
    assert [m.id for m in client.models.list()] == [MODEL, "auto"]  # and the alias

    # 3. Terraform provisions a third region; a node agent from its output serves it.
    tf_port = stack.tf_port
    copy_terraform_tree(tmp_path / "terraform")
    root = tmp_path / "root"
    root.mkdir()
    place = REGIONS[TF_REGION]
    (root / "main.tf").write_text(
        ROOT_TF.replace("@REGION@", TF_REGION)
        .replace("@LAT@", str(place.lat))
        .replace("@LON@", str(place.lon))
        .replace("@MODEL@", MODEL)
    )
    monkeypatch.setenv("TF_VAR_control_plane_url", stack.layout.control_plane_url)
    monkeypatch.setenv("TF_VAR_admin_token", stack.admin_token())
    monkeypatch.setenv("TF_VAR_node_port", str(tf_port))
    tf = Terraform(root, tmp_path / "tf-data", monkeypatch)
    tf.init()
    applied = tf.apply()
    assert applied.retcode == 0, "\n".join(diagnostics(applied)) or applied.error
    registered = stack.admin_get(f"/v1/regions/{TF_REGION}")
    assert registered["ingress_url"] == f"http://127.0.0.1:{tf_port}"
    (node,) = tf.outputs()["nodes"]
    tf_node = start_terraform_node(tmp_path, node)
    try:

        def node_seen() -> bool:
            log = (tmp_path / "tf-node.log").read_text(errors="replace")
            assert tf_node.poll() is None, f"the Terraform node exited:\n{log[-3000:]}"
            return bool(gateway_regions(stack).get(TF_REGION, {}).get("healthy_nodes") == 1)

        try:
            wait_until(node_seen, MAX_NODE_S, f"the gateway to see {TF_REGION}'s node", 0.25)
        except AssertionError as exc:  # what the node was doing, and what the gateway saw
            log = (tmp_path / "tf-node.log").read_text(errors="replace")
            raise AssertionError(f"{exc}\n{gateway_regions(stack)}\n{log[-3000:]}") from None

        # 4. Kill a region's node agent: requests keep succeeding, from the other regions.
        killed = stack.pid_of("node us-east-00")
        os.kill(killed, signal.SIGKILL)
        served = [chat(client, f"Say hello number {i}.")[1] for i in range(6)]
        stream(client, "Count to five.")
        wait_until(
            lambda: gateway_regions(stack)["us-east"]["healthy_nodes"] == 0,
            15,
            "the gateway to see us-east without healthy nodes",
            interval_s=0.25,
        )
        served += [chat(client, f"Say goodbye number {i}.")[1] for i in range(3)]
        assert "us-east" not in served[-3:], served
        status = meridian("status", "--state-dir", str(stack.state_root))
        assert status.returncode == 1  # a recorded process is down
        assert re.search(r"node us-east-00\s+\d+\s+DOWN", status.stdout), status.stdout
        assert re.search(r"eu-west-00\s+eu-west\s+\S+\s+healthy", status.stdout), status.stdout

        # 5. Terraform destroys the region: deregistered after its node drains.
        destroyed = tf.destroy()
        assert destroyed.retcode == 0, "\n".join(diagnostics(destroyed)) or destroyed.error
        regions = stack.admin_get("/v1/regions")["regions"]
        assert TF_REGION not in [r["name"] for r in regions]
        wait_until(
            lambda: TF_REGION not in gateway_regions(stack),
            10,
            "the gateway to drop it",
            interval_s=0.25,
        )
        chat(client, "One more, please.")
    finally:
        stop(tf_node)
        client.close()

    # 6. `meridian down` stops the foreground `up`, which stops everything it started.
    state = StateDir(stack.state_root).read()
    assert state is not None
    down = meridian("down", "--state-dir", str(stack.state_root))
    assert down.returncode == 0, down.stdout + down.stderr
    assert stack.proc.wait(timeout=60) == 0
    assert [r.name for r in state.processes if r.is_running()] == []
    assert StateDir(stack.state_root).read() is None
    check_ports_free(stack.layout)  # nothing listens on the stack's ports any more
