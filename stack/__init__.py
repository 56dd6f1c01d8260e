"""The local stack: `meridian up|status|down` runs a whole Meridian fleet on this machine."""
