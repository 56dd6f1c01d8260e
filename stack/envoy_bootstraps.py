"""Each region Envoy's bootstrap, from `envoy-bootstrap` (run once per region, in parallel),
written under the state directory's envoy/ with the region's xDS token in it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Final

from control_plane.admin_cli import write_private
from control_plane.xds.bootstrap import TOKEN_ENV
from stack import commands
from stack.errors import StackError
from stack.layout import StackLayout

BOOTSTRAP_TIMEOUT_S: Final = 60.0


def write_envoy_bootstraps(
    layout: StackLayout, xds_tokens: dict[str, str], envoy_dir: Path
) -> dict[str, Path]:
    """The path of each region's bootstrap, by region name."""
    running = {}
    for region in layout.regions:
        argv = commands.envoy_bootstrap(layout, region)
        running[region.name] = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=commands.base_env() | {TOKEN_ENV: xds_tokens[region.name]},
        )
    paths = {}
    for name, popen in running.items():
        try:
            out, err = popen.communicate(timeout=BOOTSTRAP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            popen.kill()
            popen.communicate()
            raise StackError(f"envoy-bootstrap for {name} took over {exc.timeout} s") from exc
        if popen.returncode != 0:
            message = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise StackError(f"envoy-bootstrap for {name} failed: {message[0]}")
        path = envoy_dir / f"{name}.yaml"
        write_private(path, out.decode())  # it holds the region's xDS token
        paths[name] = path
    return paths
