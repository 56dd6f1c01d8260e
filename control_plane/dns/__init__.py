"""The simulated global DNS: an authoritative server for the API hostname that steers each client
to the nearest healthy region, following live capacity (see `decision` for the rule)."""
