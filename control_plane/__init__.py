"""control_plane"""
