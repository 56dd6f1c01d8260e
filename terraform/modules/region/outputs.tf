locals {
  agents_per_node = floor(var.gpus_per_node / var.tensor_parallel_size)
  # Machines per model: `models`, or the short form's node_count machines of `model`.
  placement = var.models != null ? var.models : { (var.model) = coalesce(var.node_count, 1) }
  # How each model is loaded and the name it is served under (the short form's: the node
  # agent's own default, a path's file stem).
  model_specs = {
    for name in keys(local.placement) : name => merge(
      { source = name, dtype = "auto", quantization = "auto", served_name = var.models == null ? null : name },
      { for key, value in try(var.model_settings[name], {}) : key => value if value != null },
    )
  }
  # Each machine's model, in model-name order (a map's keys are sorted), then each agent's.
  machine_models = flatten([
    for name in keys(local.placement) : [for m in range(local.placement[name]) : name]
  ])
  num_machines = length(local.machine_models)
  agent_specs = [
    for i in range(local.num_machines * local.agents_per_node) :
    local.model_specs[local.machine_models[floor(i / local.agents_per_node)]]
  ]

  nodes = [
    for i, spec in local.agent_specs : {
      node_id              = format("%s-%02d", var.name, i)
      region               = var.name
      model                = spec.source
      served_model_name    = spec.served_name
      dtype                = spec.dtype
      quantization         = spec.quantization
      tensor_parallel_size = var.tensor_parallel_size
      machine              = floor(i / local.agents_per_node)
      # The machine's GPUs this agent uses (its CUDA_VISIBLE_DEVICES).
      gpu_ids = join(",", [
        for g in range(var.tensor_parallel_size) :
        tostring((i % local.agents_per_node) * var.tensor_parallel_size + g)
      ])
      host = var.node_host
      port = var.base_port + i
    }
  ]

  # Settings beyond the model that differ from the node agent's defaults.
  model_settings = [
    for node in local.nodes : merge(
      coalesce(node.served_model_name, node.model) == node.model ? {} : { served_model_name = node.served_model_name },
      node.dtype == "auto" ? {} : { dtype = node.dtype },
      node.quantization == "auto" ? {} : { quantization = node.quantization },
    )
  ]

  # The region's picker, where its node agents stream their caches' events.
  picker_host = var.picker == null ? null : (strcontains(var.picker.host, ":") ? "[${var.picker.host}]" : var.picker.host)
  picker_url  = var.picker == null ? null : "ws://${local.picker_host}:${var.picker.cache_events_port}"
  # Where Envoy reaches it (ext_proc), as the control plane's region field holds it.
  picker_address = var.picker == null ? null : "${local.picker_host}:${var.picker.port}"

  # The node agent's command line (ARCHITECTURE.md, "Entry points"), without the program.
  node_args = [
    for i, node in local.nodes : concat(
      ["--model", node.model],
      flatten([for key, value in local.model_settings[i] : ["--${replace(key, "_", "-")}", value]]),
      [
        "--host", node.host,
        "--port", tostring(node.port),
        "--region", node.region,
        "--node-id", node.node_id,
        "--control-plane", var.control_plane_url,
        "--tensor-parallel-size", tostring(node.tensor_parallel_size),
      ],
      local.picker_url == null ? [] : ["--picker-url", local.picker_url],
    )
  ]

  node_token_dir = abspath(coalesce(var.node_token_dir, "${path.root}/node-tokens"))
  # An agent listening on every interface advertises another address (see the cloud example):
  # its credential leaves the URL to be bound by its first heartbeat.
  is_url_known = !contains(["0.0.0.0", "::"], var.node_host)
  credential_args = [
    for node in local.node_configs :
    local.is_url_known ? "--node=${node.node_id}=${node.url}" : "--node=${node.node_id}"
  ]

  node_configs = [
    for i, node in local.nodes : merge(node, {
      token_file  = "${local.node_token_dir}/${node.node_id}.token"
      url         = strcontains(node.host, ":") ? "http://[${node.host}]:${node.port}" : "http://${node.host}:${node.port}"
      environment = { CUDA_VISIBLE_DEVICES = node.gpu_ids }
      args        = local.node_args[i]
      command     = join(" ", concat(["python", "-m", "node_agent"], local.node_args[i]))
      config_yaml = yamlencode(merge({
        model                = node.model
        host                 = node.host
        port                 = node.port
        region               = node.region
        node_id              = node.node_id
        control_plane        = var.control_plane_url
        tensor_parallel_size = node.tensor_parallel_size
      }, local.model_settings[i], local.picker_url == null ? {} : { picker_url = local.picker_url }))
    })
  ]

  # The picker tokenizes prompts with each served model's tokenizer: served name => checkpoint
  # (a node agent serves a .gguf path under its file stem, any other source under itself).
  picker_models = {
    for node in local.nodes :
    coalesce(node.served_model_name, endswith(node.model, ".gguf") ? trimsuffix(basename(node.model), ".gguf") : node.model) => node.model...
  }
  picker_args = var.picker == null ? null : concat(
    [
      "--region", var.name,
      "--host", var.picker.host,
      "--port", tostring(var.picker.port),
      "--metrics-host", var.picker.host,
      "--metrics-port", tostring(var.picker.metrics_port),
      "--cache-events-port", tostring(var.picker.cache_events_port),
      "--control-plane", split(",", var.control_plane_url)[0],
    ],
    flatten([for name, sources in local.picker_models : ["--model", "${name}=${sources[0]}"]]),
  )
}

output "region" {
  description = "The region as registered with the control plane."
  value = {
    name              = var.name
    lat               = var.location.lat
    lon               = var.location.lon
    ingress_url       = var.ingress_url
    weight            = var.weight
    control_plane_url = var.control_plane_url
    # Known after apply: the registration's id (changes when the region is re-registered).
    registration_id = terraform_data.registration.id
  }
}

output "nodes" {
  description = "One entry per node agent: who it is, where it listens, and how to start it (`command`, or `config_yaml` for `python -m node_agent --config FILE`). Each agent also needs MERIDIAN_NODE_TOKEN in its environment (its own, minted at apply into `token_file`), and MERIDIAN_SERVING_TOKEN (the bearer the gateway sends) when `node_host` is not loopback."
  value       = local.node_configs
}

output "nodes_by_machine" {
  description = "The same entries grouped by machine: element m lists what machine m runs (gpus_per_node / tensor_parallel_size agents each)."
  value = [
    for machine in range(local.num_machines) :
    [for node in local.node_configs : node if node.machine == machine]
  ]
}

output "envoy_token_file" {
  description = "The file holding the xDS token of the region's ingress Envoys (null without envoy_token_file): `python -m control_plane envoy-bootstrap --region <name> --token-file <it>`."
  value       = local.envoy_token_file
}

output "picker" {
  description = "The region's endpoint picker (null without `picker`): how to start it beside the region's Envoy (`command`, or `args` after `python -m region_picker`; it needs MERIDIAN_GATEWAY_TOKEN, the gateways' read-only control-plane token, in its environment, and MERIDIAN_SERVING_TOKEN, the node agents' serving token that their cache streams present, when its host is not loopback), its ext_proc `address` (registered as the region's `picker` field at apply: xDS then gives the region's Envoys the ext_proc filter, live), `metrics_url` and `cache_events_url`."
  value = var.picker == null ? null : {
    region           = var.name
    address          = local.picker_address
    metrics_url      = "http://${local.picker_host}:${var.picker.metrics_port}/metrics"
    cache_events_url = local.picker_url
    args             = local.picker_args
    command          = join(" ", concat(["python", "-m", "region_picker"], local.picker_args))
  }
}
