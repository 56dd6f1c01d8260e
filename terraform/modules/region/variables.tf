variable "name" {
  description = "Region name, as the control plane knows it (lower-case DNS-label style)."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z0-9]([a-z0-9._-]{0,54}[a-z0-9])?$", var.name)) && var.name != "summary"
    error_message = "name must be lower-case letters, digits, '.', '_' or '-', 1-56 characters, starting and ending with a letter or digit, and not \"summary\"."
  }
}

variable "location" {
  description = "Where the region's datacenter is, in degrees (used for latency-based routing)."
  type = object({
    lat = number
    lon = number
  })
  nullable = false

  validation {
    condition     = var.location.lat >= -90 && var.location.lat <= 90 && var.location.lon >= -180 && var.location.lon <= 180
    error_message = "location.lat must be within [-90, 90] and location.lon within [-180, 180]."
  }
}

variable "node_count" {
  description = "Machines in the region, all serving `model` (the one-model short form; default 1). Give `models` instead for several models."
  type        = number
  default     = null

  validation {
    condition     = var.node_count == null || (coalesce(var.node_count, 0) >= 0 && coalesce(var.node_count, 0) <= 1000 && floor(coalesce(var.node_count, 0)) == var.node_count)
    error_message = "node_count must be a whole number from 0 to 1000."
  }
  validation {
    condition     = var.node_count == null || var.models == null
    error_message = "Give node_count (with model) or models, not both."
  }
}

variable "models" {
  description = "The models the region serves: model name => machines serving it (each runs gpus_per_node / tensor_parallel_size node agents of it), in name order. A model is loaded as model_settings says (default: the name is a pulled model, dtype and quantization auto), served under its name. Null: node_count machines of `model`."
  type        = map(number)
  default     = null

  validation {
    condition     = var.models == null || alltrue([for name, count in coalesce(var.models, {}) : can(regex("^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$", name)) && count >= 0 && count <= 1000 && floor(count) == count])
    error_message = "models must map model names (letters, digits and . _ : / @ + -, up to 128) to whole numbers of machines from 0 to 1000."
  }
}

variable "model_settings" {
  description = "How to load a model of `models`, by name: source (a name from `python -m engine pull` or a path; default: the model's name), dtype (auto, fp32, bf16, fp16), quantization (auto, none, int8, q4_1) and served_name (what clients send; default: the model's name)."
  type = map(object({
    source       = optional(string)
    dtype        = optional(string, "auto")
    quantization = optional(string, "auto")
    served_name  = optional(string)
  }))
  default  = {}
  nullable = false

  validation {
    condition = alltrue([
      for name, model in var.model_settings :
      (model.source == null || can(regex("^[A-Za-z0-9._/:@+-]{1,256}$", model.source))) &&
      contains(["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"], model.dtype) &&
      contains(["auto", "none", "int8", "q4_1"], model.quantization) &&
      (model.served_name == null || can(regex("^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$", model.served_name)))
    ])
    error_message = "model_settings: source must be 1-256 characters of letters, digits and . _ / : @ + -; dtype one of auto, fp32, float32, bf16, bfloat16, fp16, float16; quantization one of auto, none, int8, q4_1; served_name a model name."
  }
}

variable "gpus_per_node" {
  description = "GPUs on each machine. Each machine runs gpus_per_node / tensor_parallel_size node agents (on a CPU-only machine, 1)."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.gpus_per_node >= 1 && var.gpus_per_node <= 64 && floor(var.gpus_per_node) == var.gpus_per_node
    error_message = "gpus_per_node must be a whole number from 1 to 64."
  }
}

variable "tensor_parallel_size" {
  description = "GPUs per model replica (one node agent each); must divide gpus_per_node."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.tensor_parallel_size >= 1 && floor(var.tensor_parallel_size) == var.tensor_parallel_size
    error_message = "tensor_parallel_size must be a whole number of at least 1."
  }
  validation {
    condition     = var.gpus_per_node % var.tensor_parallel_size == 0
    error_message = "tensor_parallel_size must divide gpus_per_node (each node agent takes tensor_parallel_size of the machine's GPUs, and none may be left idle)."
  }
}

variable "model" {
  description = "Model the node agents serve in the one-model short form (without `models`): a name from `python -m engine pull` or a path."
  type        = string
  default     = "smollm2-135m-instruct"
  nullable    = false

  validation {
    # No spaces or shell metacharacters: the rendered command line needs no quoting.
    condition     = can(regex("^[A-Za-z0-9._/:@+-]{1,256}$", var.model))
    error_message = "model must be 1-256 characters of letters, digits and . _ / : @ + -."
  }
}

variable "control_plane_url" {
  description = "The control plane's admin API, e.g. http://127.0.0.1:8080 (no path); replicas: their URLs comma-separated, tried in turn."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^https?://[^\\s/?#@,]+/?(,https?://[^\\s/?#@,]+/?)*$", var.control_plane_url))
    error_message = "control_plane_url must be http(s)://HOST[:PORT] with no path (or several, comma-separated)."
  }
}

variable "admin_token" {
  description = "The control plane's operator (admin) token. Passed to the registration commands through their environment only; kept in state so that `terraform destroy` can deregister the region (see the module README)."
  type        = string
  sensitive   = true
  nullable    = false

  validation {
    condition     = length(var.admin_token) >= 16
    error_message = "admin_token must be at least 16 characters (the control plane refuses shorter tokens)."
  }
}

variable "ingress_url" {
  description = "The region's ingress (its Envoy, or a node agent), if it has one."
  type        = string
  default     = null

  validation {
    condition     = var.ingress_url == null || can(regex("^https?://[^\\s/?#@]+/?$", var.ingress_url))
    error_message = "ingress_url must be http(s)://HOST[:PORT]: no path, query or user info (gateways join their own paths to it)."
  }
}

variable "weight" {
  description = "Routing weight of the region (0 takes it out of routing)."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.weight >= 0 && var.weight <= 1000000
    error_message = "weight must be within [0, 1000000]."
  }
}

variable "node_host" {
  description = "Address the node agents listen on."
  type        = string
  default     = "127.0.0.1"
  nullable    = false

  validation {
    condition     = can(regex("^[A-Za-z0-9.:_-]{1,253}$", var.node_host))
    error_message = "node_host must be a host name or an IP address."
  }
}

variable "base_port" {
  description = "Port of the region's first node agent; the others count up from it."
  type        = number
  default     = 9001
  nullable    = false

  validation {
    condition     = var.base_port >= 1 && floor(var.base_port) == var.base_port
    error_message = "base_port must be a whole number of at least 1."
  }
  validation {
    condition     = var.base_port + (var.models == null ? coalesce(var.node_count, 1) : sum(concat([0], values(coalesce(var.models, {}))))) * floor(var.gpus_per_node / var.tensor_parallel_size) - 1 <= 65535
    error_message = "The region's node agents need ports base_port .. base_port + agents - 1, which must stay within 65535."
  }
}

variable "deregister_timeout_s" {
  description = "How long `terraform destroy` waits for the region to be gone when the control plane drains its nodes first (it answers 202); past it, destroy fails and can be re-run."
  type        = number
  default     = 300
  nullable    = false

  validation {
    condition     = var.deregister_timeout_s >= 0
    error_message = "deregister_timeout_s must not be negative."
  }
}

variable "admin_cli" {
  description = "The command (argv list) that runs Meridian's admin CLI; `python` must be the interpreter Meridian is installed in."
  type        = list(string)
  default     = ["python", "-m", "control_plane.admin_cli"]
  nullable    = false

  validation {
    condition     = length(var.admin_cli) >= 1
    error_message = "admin_cli must name at least the program to run."
  }
}

variable "node_token_dir" {
  description = "Where each node agent's own control-plane credential (its MERIDIAN_NODE_TOKEN, minted through the admin API) is written, as <node_id>.token, mode 0600. Default: node-tokens/ in the root module's directory."
  type        = string
  default     = null
}

variable "envoy_token_file" {
  description = "Where to write the xDS token of the region's ingress Envoys (their credential envoy-<name>, minted through the admin API at apply; mode 0600), for `python -m control_plane envoy-bootstrap --region <name> --token-file FILE`. Null (the default): none is minted (the region has no Envoy, or its operator mints one)."
  type        = string
  default     = null
}

variable "picker" {
  description = "The region's KV-cache-aware endpoint picker (python -m region_picker, docs/region_picker.md), run beside the region's Envoy, which asks it over ext_proc which node each request goes to. Null (the default): none, Envoy balances by least request. Given: its address (`host`, an IP that Envoy and the node agents reach; ext_proc on `port`, /metrics on `metrics_port`, the node agents' cache event streams on `cache_events_port`); every node agent of the region streams its prefix cache's events to it (--picker-url), and the `picker` output says how to start it and what the control plane must be told."
  type = object({
    host              = optional(string, "127.0.0.1")
    port              = optional(number, 9100)
    metrics_port      = optional(number, 9101)
    cache_events_port = optional(number, 9102)
  })
  default = null

  validation {
    condition = var.picker == null || alltrue(concat(
      [can(regex("^(([0-9]{1,3}[.]){3}[0-9]{1,3}|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*)$", try(var.picker.host, "")))],
      [for port in [try(var.picker.port, 0), try(var.picker.metrics_port, 0), try(var.picker.cache_events_port, 0)] : port >= 1 && port <= 65535 && floor(port) == port],
    ))
    error_message = "picker: host must be an IP address (the control plane gives it to Envoy as IP:PORT), and port, metrics_port and cache_events_port whole numbers from 1 to 65535."
  }
  validation {
    condition     = var.picker == null || length(distinct([try(var.picker.port, 0), try(var.picker.metrics_port, 0), try(var.picker.cache_events_port, 0)])) == 3
    error_message = "picker: port, metrics_port and cache_events_port must differ (one process listens on all three)."
  }
}
