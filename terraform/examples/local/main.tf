# The three local regions, registered with a control plane that is already running:
#
#   export TF_VAR_control_plane_url=http://127.0.0.1:8080
#   export TF_VAR_admin_token=...   # e.g. from `set -a; . meridian-control-plane.db.tokens; set +a`
#   terraform init && terraform apply
#
# Locations match wire/geo.py's REGIONS table. Each region gets one CPU node agent with its own
# port (all on 127.0.0.1), so that the rendered commands can run side by side on one machine; a
# region's optional `models` (model name => agents) places several models there instead, as
# stack/default.yaml does, e.g. eu-west's:
#   models = { "smollm2-135m-instruct" = 1, "smollm2-135m-instruct-fp32" = 1 }

terraform {
  required_version = ">= 1.9"
}

variable "control_plane_url" {
  description = "The control plane's admin API, e.g. http://127.0.0.1:8080."
  type        = string
}

variable "admin_token" {
  description = "The control plane's operator token (MERIDIAN_ADMIN_TOKEN)."
  type        = string
  sensitive   = true
}

variable "admin_cli" {
  description = "How to run Meridian's admin CLI (the default needs Meridian's virtualenv active)."
  type        = list(string)
  default     = ["python", "-m", "control_plane.admin_cli"]
}

variable "regions" {
  description = "The regions to provision (the default: the three local ones, located as in wire/geo.py). Each gets one CPU node agent of smollm2-135m-instruct on 127.0.0.1, from base_port, or with `models` that many agents of each model (by name, loaded as model_settings says); with `picker`, an endpoint picker on 127.0.0.1 at those ports, which its agents stream to."
  type = map(object({
    lat       = number
    lon       = number
    base_port = number
    weight    = optional(number, 1)
    models    = optional(map(number))
    # An endpoint picker beside the region's Envoy, on 127.0.0.1 (e.g. as `meridian up` lays
    # region i's out: port 10701 + i, metrics_port 10801 + i, cache_events_port 10901 + i).
    picker = optional(object({
      port              = number
      metrics_port      = number
      cache_events_port = number
    }))
  }))
  default = {
    "us-east"      = { lat = 39.04, lon = -77.49, base_port = 9001 } # Ashburn, Virginia
    "eu-west"      = { lat = 53.35, lon = -6.26, base_port = 9101 }  # Dublin
    "ap-southeast" = { lat = 1.35, lon = 103.82, base_port = 9201 }  # Singapore
  }
}

variable "model_settings" {
  description = "How each model a region's `models` names is loaded (the region module's model_settings; default: stack/default.yaml's fp32 model)."
  type = map(object({
    source       = optional(string)
    dtype        = optional(string)
    quantization = optional(string)
    served_name  = optional(string)
  }))
  default = {
    "smollm2-135m-instruct-fp32" = { source = "smollm2-135m-instruct", dtype = "fp32", quantization = "none" }
  }
}

module "region" {
  source   = "../../modules/region"
  for_each = var.regions

  name                 = each.key
  location             = { lat = each.value.lat, lon = each.value.lon }
  node_count           = each.value.models == null ? 1 : null
  models               = each.value.models
  model_settings       = var.model_settings
  gpus_per_node        = 1
  tensor_parallel_size = 1
  model                = "smollm2-135m-instruct"
  base_port            = each.value.base_port
  weight               = each.value.weight
  control_plane_url    = var.control_plane_url
  admin_token          = var.admin_token
  admin_cli            = var.admin_cli
  picker               = each.value.picker
}

output "regions" {
  description = "The registered regions, by name."
  value       = { for name, region in module.region : name => region.region }
}

output "nodes" {
  description = "Every node agent's config, across the regions (see the module's `nodes` output)."
  value       = flatten([for name in sort(keys(module.region)) : module.region[name].nodes])
}

output "node_commands" {
  description = "Ready-to-run node agent command lines, each with its own MERIDIAN_NODE_TOKEN (read from the token file minted at apply)."
  value = flatten([
    for name in sort(keys(module.region)) : [
      for node in module.region[name].nodes : "MERIDIAN_NODE_TOKEN=\"$(cat ${node.token_file})\" ${node.command}"
    ]
  ])
}

output "picker_commands" {
  description = "Each region picker's command line (it needs MERIDIAN_GATEWAY_TOKEN), by region."
  value       = { for name, region in module.region : name => region.picker.command if region.picker != null }
}
