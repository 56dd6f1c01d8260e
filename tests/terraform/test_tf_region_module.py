"""`terraform/modules/region` without a control plane: it validates, refuses bad inputs at plan
time, and lays node agents out over machines and GPUs (plans only; nothing is applied)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tf_helpers import Terraform, TerraformFactory, copy_terraform_tree, diagnostics

from node_agent.__main__ import load_settings as load_node_settings
from node_agent.__main__ import parse_args as parse_node_args
from region_picker.__main__ import load_settings as load_picker_settings
from region_picker.__main__ import parse_args as parse_picker_args

pytestmark = pytest.mark.slow  # starts processes

TOKEN = "adm-" + "t" * 24

# A root module that passes its variables through to the region module; defaults are valid.
ROOT_TF = """
variable "name" { default = "us-east" }
variable "location" {
  type    = object({ lat = number, lon = number })
  default = { lat = 39.04, lon = -77.49 }
}
variable "node_count" {
  type    = number
  default = 2
}
variable "models" {
  type    = map(number)
  default = null
}
variable "model_settings" {
  type = map(object({
    source       = optional(string)
    dtype        = optional(string)
    quantization = optional(string)
    served_name  = optional(string)
  }))
  default = {}
}
variable "gpus_per_node" { default = 8 }
variable "tensor_parallel_size" { default = 2 }
variable "model" { default = "smollm2-135m-instruct" }
variable "control_plane_url" { default = "http://127.0.0.1:8080" }
variable "admin_token" {
  default   = "@TOKEN@"
  sensitive = true
}
variable "ingress_url" { default = null }
variable "weight" { default = 1 }
variable "base_port" { default = 9001 }
variable "envoy_token_file" { default = null }
variable "picker" {
  type = object({
    host              = optional(string)
    port              = optional(number)
    metrics_port      = optional(number)
    cache_events_port = optional(number)
  })
  default = null
}

module "region" {
  source               = "../terraform/modules/region"
  name                 = var.name
  location             = var.location
  node_count           = var.node_count == -1 ? null : var.node_count # -1: not given
  models               = var.models
  model_settings       = var.model_settings
  gpus_per_node        = var.gpus_per_node
  tensor_parallel_size = var.tensor_parallel_size
  model                = var.model
  control_plane_url    = var.control_plane_url
  admin_token          = var.admin_token
  ingress_url          = var.ingress_url
  weight               = var.weight
  base_port            = var.base_port
  envoy_token_file     = var.envoy_token_file
  picker               = var.picker
}

output "nodes" { value = module.region.nodes }
output "nodes_by_machine" { value = module.region.nodes_by_machine }
output "envoy_token_file" { value = module.region.envoy_token_file }
output "picker" { value = module.region.picker }
output "user_data" {
  value = [
    for machine in module.region.nodes_by_machine :
    templatefile("../terraform/examples/cloud-gpu/user_data.sh.tftpl", {
      agents                 = machine
      meridian_package       = "meridian"
      node_token_ssm_name    = "/meridian/node-token"
      serving_token_ssm_name = "/meridian/serving-token"
      aws_region             = "us-east-1"
    })
  ]
}
""".replace("@TOKEN@", TOKEN)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, terraform_env: Path) -> Iterator[Terraform]:
    """An initialized root module calling the region module (shared: tests only plan)."""
    base = tmp_path_factory.mktemp("region-module")
    copy_terraform_tree(base / "terraform")
    workdir = base / "root"
    workdir.mkdir()
    (workdir / "main.tf").write_text(ROOT_TF, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        tf = Terraform(workdir, base / "tf-data", mp)
        tf.init()
        yield tf


def test_module_validates_on_its_own(tf_tree: Path, terraform: TerraformFactory) -> None:
    tf = terraform(tf_tree / "modules" / "region")
    tf.init()
    result = tf.validate()
    assert result.retcode == 0 and result.value["valid"], diagnostics(result)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"tensor_parallel_size": "3"}, "tensor_parallel_size must divide gpus_per_node"),
        ({"tensor_parallel_size": "16"}, "tensor_parallel_size must divide gpus_per_node"),
        ({"tensor_parallel_size": "0"}, "tensor_parallel_size must be a whole number"),
        ({"gpus_per_node": "0"}, "gpus_per_node must be a whole number from 1"),
        ({"node_count": "1.5"}, "node_count must be a whole number"),
        ({"name": "US East"}, "name must be lower-case letters"),
        ({"name": "summary"}, "name must be lower-case letters"),
        ({"location": "{lat = 91, lon = 0}"}, "location.lat must be within [-90, 90]"),
        ({"control_plane_url": "127.0.0.1:8080"}, "control_plane_url must be http(s)://"),
        ({"admin_token": "short"}, "admin_token must be at least 16 characters"),
        ({"ingress_url": "ftp://x"}, "ingress_url must be http(s)://HOST[:PORT]"),
        ({"ingress_url": "http://x/internal?steal="}, "ingress_url must be http(s)://HOST[:PORT]"),
        ({"weight": "-1"}, "weight must be within [0, 1000000]"),
        ({"model": "a model; rm -rf /"}, "model must be 1-256 characters"),
        ({"base_port": "65533"}, "must stay within 65535"),
        ({"models": '{"m" = 1}'}, "Give node_count (with model) or models, not both"),
        ({"node_count": "-1", "models": '{"a b" = 1}'}, "models must map model names"),
        ({"node_count": "-1", "models": '{"m" = -1}'}, "models must map model names"),
        ({"model_settings": '{"m" = {quantization = "q8"}}'}, "quantization one of auto"),
        ({"model_settings": '{"m" = {dtype = "fp8"}}'}, "dtype one of auto, fp32"),
        ({"picker": '{host = "picker.internal"}'}, "picker: host must be an IP address"),
        ({"picker": "{port = 70000}"}, "picker: host must be an IP address"),
        ({"picker": "{port = 9101}"}, "picker: port, metrics_port and cache_events_port must"),
        (
            {"node_count": "-1", "models": '{"m" = 100}', "base_port": "65400"},
            "must stay within 65535",
        ),
    ],
)
def test_bad_inputs_are_refused_at_plan(
    root: Terraform, variables: dict[str, str], message: str
) -> None:
    result = root.plan(vars=variables)
    assert result.retcode == 1
    errors = diagnostics(result)
    assert any(message in error for error in errors), errors
    assert all("Invalid value for variable" in error for error in errors), errors


def planned_outputs(tf: Terraform, plan_file: Path, **variables: str) -> dict[str, Any]:
    result = tf.plan(out=str(plan_file), vars=variables or None)
    assert result.retcode == 0, diagnostics(result)
    outputs = tf.show_plan(plan_file)["planned_values"]["outputs"]
    return {name: output["value"] for name, output in outputs.items()}


def test_node_agents_take_tensor_parallel_groups_of_each_machines_gpus(
    root: Terraform, tmp_path: Path
) -> None:
    outputs = planned_outputs(root, tmp_path / "plan.tfplan")  # 2 machines x 8 GPUs, TP 2
    nodes = outputs["nodes"]
    assert [(n["node_id"], n["machine"], n["gpu_ids"], n["port"]) for n in nodes] == [
        ("us-east-00", 0, "0,1", 9001),
        ("us-east-01", 0, "2,3", 9002),
        ("us-east-02", 0, "4,5", 9003),
        ("us-east-03", 0, "6,7", 9004),
        ("us-east-04", 1, "0,1", 9005),
        ("us-east-05", 1, "2,3", 9006),
        ("us-east-06", 1, "4,5", 9007),
        ("us-east-07", 1, "6,7", 9008),
    ]
    last = nodes[-1]
    assert last["environment"] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert last["command"] == (
        "python -m node_agent --model smollm2-135m-instruct --host 127.0.0.1 --port 9008 "
        "--region us-east --node-id us-east-07 --control-plane http://127.0.0.1:8080 "
        "--tensor-parallel-size 2"
    )
    assert last["command"] == " ".join(["python", "-m", "node_agent", *last["args"]])
    assert yaml.safe_load(last["config_yaml"])["tensor_parallel_size"] == 2
    assert [[n["node_id"] for n in m] for m in outputs["nodes_by_machine"]] == [
        [n["node_id"] for n in nodes[:4]],
        [n["node_id"] for n in nodes[4:]],
    ]
    assert TOKEN not in json.dumps(outputs)


def test_an_envoy_credential_is_minted_only_when_its_file_is_named(
    root: Terraform, tmp_path: Path
) -> None:
    none = root.plan(vars={"node_count": "0"})
    assert none.retcode == 0, diagnostics(none)
    assert not any("envoy_credential" in change.address for change in none.changes)
    path = tmp_path / "envoy.token"
    named = root.plan(vars={"node_count": "0", "envoy_token_file": str(path)})
    assert named.retcode == 0, diagnostics(named)
    (change,) = [c for c in named.changes if "envoy_credential" in c.address]
    assert (change.address, change.action) == (
        "module.region.terraform_data.envoy_credential[0]",
        "create",
    )
    outputs = planned_outputs(root, tmp_path / "plan.tfplan", envoy_token_file=str(path))
    assert outputs["envoy_token_file"] == str(path)


def test_one_agent_per_machine_when_tp_uses_every_gpu(root: Terraform, tmp_path: Path) -> None:
    outputs = planned_outputs(
        root, tmp_path / "plan.tfplan", node_count="3", tensor_parallel_size="8"
    )
    assert [(n["node_id"], n["machine"], n["gpu_ids"]) for n in outputs["nodes"]] == [
        ("us-east-00", 0, "0,1,2,3,4,5,6,7"),
        ("us-east-01", 1, "0,1,2,3,4,5,6,7"),
        ("us-east-02", 2, "0,1,2,3,4,5,6,7"),
    ]


def test_cloud_user_data_starts_each_machines_agents(root: Terraform, tmp_path: Path) -> None:
    """The cloud example's user-data template, rendered by Terraform from the module's output."""
    user_data = planned_outputs(root, tmp_path / "plan.tfplan")["user_data"]
    assert len(user_data) == 2
    second = user_data[1]
    for i, gpus in zip(range(4, 8), ("0,1", "2,3", "4,5", "6,7"), strict=True):
        assert f"systemctl enable --now meridian-us-east-0{i}.service" in second
        assert f"Environment=CUDA_VISIBLE_DEVICES={gpus}" in second
    assert "--node-id us-east-07 --control-plane http://127.0.0.1:8080" in second
    assert "--advertise-url http://$private_ip:9008" in second
    assert "us-east-00" not in second
    assert "MERIDIAN_NODE_TOKEN=%s" in second  # read from SSM at boot, not baked in
    assert "MERIDIAN_SERVING_TOKEN=%s" in second  # the agents listen on 0.0.0.0
    assert "--name '/meridian/serving-token'" in second
    syntax = subprocess.run(["bash", "-n"], input=second, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr


def test_each_model_gets_its_machines_and_its_agents_load_it_as_set(
    root: Terraform, tmp_path: Path
) -> None:
    """`models` per region: machines per model in name order, each agent told the model's
    source, dtype, quantization and served name (only what differs from its defaults)."""
    fp32 = "smollm2-135m-instruct-fp32"
    outputs = planned_outputs(
        root,
        tmp_path / "plan.tfplan",
        node_count="-1",
        tensor_parallel_size="4",  # 2 agents per machine
        models=f'{{"{fp32}" = 1, "smollm2-135m-instruct" = 2}}',
        model_settings=(
            f'{{"{fp32}" = {{source = "smollm2-135m-instruct", dtype = "fp32", '
            'quantization = "none"}}'
        ),
    )
    nodes = outputs["nodes"]
    assert [(n["node_id"], n["machine"], n["served_model_name"]) for n in nodes] == [
        ("us-east-00", 0, "smollm2-135m-instruct"),
        ("us-east-01", 0, "smollm2-135m-instruct"),
        ("us-east-02", 1, "smollm2-135m-instruct"),
        ("us-east-03", 1, "smollm2-135m-instruct"),
        ("us-east-04", 2, fp32),
        ("us-east-05", 2, fp32),
    ]
    assert [len(machine) for machine in outputs["nodes_by_machine"]] == [2, 2, 2]
    first, last = nodes[0], nodes[-1]
    assert first["command"].startswith(
        "python -m node_agent --model smollm2-135m-instruct --host 127.0.0.1 --port 9001 "
    )
    assert last["command"].startswith(
        "python -m node_agent --model smollm2-135m-instruct --dtype fp32 --quantization none "
        f"--served-model-name {fp32} --host 127.0.0.1 --port 9006 "
    )
    assert yaml.safe_load(last["config_yaml"]) | {"control_plane": "-"} == {
        "model": "smollm2-135m-instruct",
        "served_model_name": fp32,
        "dtype": "fp32",
        "quantization": "none",
        "host": "127.0.0.1",
        "port": 9006,
        "region": "us-east",
        "node_id": "us-east-05",
        "control_plane": "-",
        "tensor_parallel_size": 4,
    }


def test_a_picker_is_laid_out_beside_the_region_and_every_agent_streams_to_it(
    root: Terraform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`picker`: its command line (read by the picker's own settings), each agent's
    --picker-url (read by the agent's), and its address."""
    fp32 = "smollm2-135m-instruct-fp32"
    outputs = planned_outputs(
        root,
        tmp_path / "plan.tfplan",
        node_count="-1",
        gpus_per_node="1",
        tensor_parallel_size="1",
        models=f'{{"{fp32}" = 1, "smollm2-135m-instruct" = 2}}',
        model_settings=f'{{"{fp32}" = {{source = "smollm2-135m-instruct", dtype = "fp32"}}}}',
        picker='{host = "10.0.0.5", cache_events_port = 9200}',
        control_plane_url="http://10.0.0.1:8080,http://10.0.0.2:8080",
    )
    picker = outputs["picker"]
    assert picker["command"] == " ".join(["python", "-m", "region_picker", *picker["args"]])
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", "gw-" + "g" * 20)
    monkeypatch.setenv("MERIDIAN_SERVING_TOKEN", "srv-" + "s" * 20)  # on 10.0.0.5, required
    settings = load_picker_settings(parse_picker_args(picker["args"]))
    assert (settings.region, settings.host, settings.port) == ("us-east", "10.0.0.5", 9100)
    assert (settings.metrics_host, settings.metrics_port) == ("10.0.0.5", 9101)
    assert (settings.cache_events_port, settings.control_plane) == (9200, "http://10.0.0.1:8080")
    assert settings.models == {  # each served name with its tokenizer's checkpoint
        "smollm2-135m-instruct": "smollm2-135m-instruct",
        fp32: "smollm2-135m-instruct",
    }
    assert picker["metrics_url"] == "http://10.0.0.5:9101/metrics"
    assert picker["address"] == "10.0.0.5:9100"  # `region put --picker` registers it

    monkeypatch.setenv("MERIDIAN_NODE_TOKEN", "node-token-" + "n" * 16)
    for node in outputs["nodes"]:
        agent = load_node_settings(parse_node_args(node["args"]))
        assert agent.picker_url == "ws://10.0.0.5:9200"
        assert yaml.safe_load(node["config_yaml"])["picker_url"] == "ws://10.0.0.5:9200"

    without = planned_outputs(root, tmp_path / "without.tfplan")
    assert without["picker"] is None
    assert not any("--picker-url" in node["args"] for node in without["nodes"])
