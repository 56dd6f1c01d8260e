"""The region picker: chooses the node for each request inside a region (one process per region,
beside its ingress Envoy)."""
