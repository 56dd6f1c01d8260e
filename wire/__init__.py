"""Wire schemas shared by the services (node agent, control plane, gateway), and how they
report a schema violation on a command line."""
