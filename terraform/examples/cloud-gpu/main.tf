# ILLUSTRATIVE ONLY: one Meridian region on AWS GPU instances, composed with the same module as
# the local example. Never applied by the tests (they only parse it; see README.md).
#
# The module registers the region with the control plane (from the machine running Terraform)
# and renders every node agent's command line; each instance's user data installs Meridian and
# starts its share of those agents as systemd units, one per tensor-parallel group of GPUs.

terraform {
  required_version = ">= 1.9"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

provider "aws" {
  region = var.aws_region
}

# The latest AWS Deep Learning AMI (NVIDIA driver and CUDA), unless ami_id is given.
data "aws_ami" "gpu" {
  most_recent = true
  owners      = ["amazon"]

  filter {
    name   = "name"
    values = ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"]
  }
}

module "region" {
  source = "../../modules/region"

  name                 = var.region_name
  location             = var.location
  node_count           = var.node_count
  gpus_per_node        = var.gpus_per_node
  tensor_parallel_size = var.tensor_parallel_size
  model                = var.model
  node_host            = "0.0.0.0" # each agent advertises the instance's private IP instead
  base_port            = 9001
  control_plane_url    = var.control_plane_url
  admin_token          = var.admin_token
  ingress_url          = var.ingress_url
}

resource "aws_instance" "gpu_node" {
  count = var.node_count

  ami                    = coalesce(var.ami_id, data.aws_ami.gpu.id)
  instance_type          = var.instance_type
  subnet_id              = var.subnet_id
  vpc_security_group_ids = var.security_group_ids
  iam_instance_profile   = var.instance_profile # must allow ssm:GetParameter on both tokens

  root_block_device {
    volume_size = 200
    volume_type = "gp3"
  }

  metadata_options {
    http_tokens = "required" # IMDSv2 only
  }

  user_data = templatefile("${path.module}/user_data.sh.tftpl", {
    agents                 = module.region.nodes_by_machine[count.index]
    meridian_package       = var.meridian_package
    node_token_ssm_name    = var.node_token_ssm_parameter
    serving_token_ssm_name = var.serving_token_ssm_parameter
    aws_region             = var.aws_region
  })
  user_data_replace_on_change = true

  tags = {
    Name              = "meridian-${var.region_name}-${count.index}"
    "meridian:region" = var.region_name
  }

  # Agents report to a region that already exists on the control plane.
  depends_on = [module.region]
}

output "region" {
  value = module.region.region
}

output "instances" {
  description = "Each GPU instance and the node agents it runs."
  value = [
    for i, instance in aws_instance.gpu_node : {
      id         = instance.id
      private_ip = instance.private_ip
      node_ids   = [for node in module.region.nodes_by_machine[i] : node.node_id]
    }
  ]
}
