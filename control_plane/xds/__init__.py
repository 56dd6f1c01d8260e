"""xDS for Envoy: snapshots computed from the fleet, and the ADS server that pushes them.

`groups` names what an Envoy is (from its bootstrap's node metadata), `plan` turns fleet state into
a small frozen plan per group (endpoint and locality weights from free KV capacity), `resources`
turns a plan into Envoy protos, `validation` checks them as Envoy would, `snapshot` versions them by
content hash, `cache` holds the current snapshot per group, `stream` is the per-stream ACK/NACK
state machine, `acks` what a wait for Envoys' ACKs asks, and `server` runs it all on grpc.aio.
`bootstrap` writes an Envoy's starting config; `credentials` and `stream_gate` say which Envoy
may open a stream, and `status` reports the streams (its HTTP router is `control_plane.api.xds`).
"""
