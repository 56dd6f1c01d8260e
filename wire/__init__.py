"""Wire schemas shared by the services (node agent, control plane, gateway)."""
