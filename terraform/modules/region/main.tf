# A Meridian region: its registration with the control plane, and the config of its node agents.
#
# Two `terraform_data` resources, because provisioners run only on create and destroy:
#   registration  identity (name, control plane): `region put` on create, `region delete` on
#                 destroy (waiting while the control plane drains the region's nodes first).
#                 Replaced only when the name or the control plane changes.
#   settings      location, ingress URL, weight, picker: replaced when any changes, which runs
#                 `region put` again and so updates the region in place on the control plane
#                 (the registration, and the region's history there, are kept).
# and one for the node agents' credentials:
#   node_credentials  `node credentials` on create: each agent's own heartbeat token, bound to its
#                 node id, this region and its URL, written to node_token_dir (never to the
#                 state). Replaced (new tokens) when the registration or the agents change.
# and, with envoy_token_file, one for the region's ingress Envoys:
#   envoy_credential  `xds credential` on create: the token their ADS streams must present,
#                 bound to this region, written to envoy_token_file (never to the state).

locals {
  put_args = concat(
    ["region", "put", "--lat=${var.location.lat}", "--lon=${var.location.lon}", "--weight=${var.weight}"],
    var.ingress_url == null ? [] : ["--ingress-url=${var.ingress_url}"],
    var.picker == null ? [] : ["--picker=${local.picker_address}"],
  )
  envoy_token_file = var.envoy_token_file == null ? null : abspath(var.envoy_token_file)
  # The token and URL reach the CLI through its environment, never its command line.
  cli_environment = {
    MERIDIAN_CONTROL_PLANE_URL = var.control_plane_url
    MERIDIAN_ADMIN_TOKEN       = var.admin_token
  }
}

resource "terraform_data" "registration" {
  triggers_replace = {
    name              = var.name
    control_plane_url = var.control_plane_url
  }

  # What the destroy-time provisioner needs: it may refer only to `self`. The token is sensitive
  # (redacted in plans and output) but, like every value here, stored in the state file.
  input = {
    name              = var.name
    control_plane_url = var.control_plane_url
    admin_cli         = var.admin_cli
    wait_s            = var.deregister_timeout_s
    admin_token       = var.admin_token
  }

  # `interpreter` runs the CLI without a shell; `command` is its last argument (the name).
  provisioner "local-exec" {
    interpreter = concat(var.admin_cli, local.put_args)
    command     = var.name
    environment = local.cli_environment
  }

  provisioner "local-exec" {
    when        = destroy
    interpreter = concat(self.input.admin_cli, ["region", "delete", "--wait-s=${self.input.wait_s}"])
    command     = self.input.name
    environment = {
      MERIDIAN_CONTROL_PLANE_URL = self.input.control_plane_url
      MERIDIAN_ADMIN_TOKEN       = self.input.admin_token
    }
  }
}

resource "terraform_data" "settings" {
  triggers_replace = {
    registration = terraform_data.registration.id
    lat          = var.location.lat
    lon          = var.location.lon
    ingress_url  = var.ingress_url
    weight       = var.weight
    picker       = var.picker == null ? null : local.picker_address
  }

  # Right after a fresh registration this finds the region already matching ("unchanged").
  provisioner "local-exec" {
    interpreter = concat(var.admin_cli, local.put_args)
    command     = var.name
    environment = local.cli_environment
  }
}

resource "terraform_data" "node_credentials" {
  count = length(local.node_configs) > 0 ? 1 : 0

  triggers_replace = {
    registration = terraform_data.registration.id
    nodes        = local.credential_args
    token_dir    = local.node_token_dir
  }

  provisioner "local-exec" {
    interpreter = concat(
      var.admin_cli,
      ["node", "credentials", "--token-dir=${local.node_token_dir}"],
      local.credential_args,
    )
    command     = var.name
    environment = local.cli_environment
  }
}

resource "terraform_data" "envoy_credential" {
  count = local.envoy_token_file == null ? 0 : 1

  triggers_replace = {
    registration = terraform_data.registration.id
    token_file   = local.envoy_token_file
  }

  provisioner "local-exec" {
    interpreter = concat(
      var.admin_cli,
      ["xds", "credential", "--region=${var.name}", "--token-file=${local.envoy_token_file}"],
    )
    command     = "envoy-${var.name}"
    environment = local.cli_environment
  }
}
