"""A seeded discrete-event world that drives Meridian's real routing code (issue 10).

`simulator` imports `gateway`, `control_plane` and `wire`; nothing imports `simulator`.
"""
