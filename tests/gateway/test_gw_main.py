"""`python -m gateway`: configuration errors, TLS, and the real process serving."""

from __future__ import annotations

import logging
import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bounded_wait
import httpx
import pytest
from cryptography import x509
from gw_fleet import Fleet, free_port, wait_until
from suite_env import child_env

from gateway.__main__ import main
from gateway.settings import GatewaySettings
from gateway.tls import make_self_signed, server_context

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "gw-" + "x" * 30
# SIGTERM: in-flight requests finish, then the process exits 0.
CLEAN_EXIT = (0,)


CERTIFICATE_LOGGED = re.compile(r"self-signed certificate in (\S+)")


@pytest.fixture(autouse=True)
def keep_logging() -> Iterator[None]:
    """`main` configures the root logger; put it back so later tests' output is not lost."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(list(args))
    return status, capsys.readouterr().err


def test_bad_configuration_fails_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["--control-plane", "http://127.0.0.1:1"]
    status, err = run_main(capsys, "--pop", "new-york", *base)
    assert status == 2 and "MERIDIAN_GATEWAY_TOKEN" in err and err.count("\n") == 1
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", TOKEN)
    status, err = run_main(capsys, "--pop", "atlantis", *base)
    assert status == 2 and "atlantis" in err and TOKEN not in err
    status, err = run_main(capsys, "--pop", "new-york", "--tls-cert", "c.pem", *base)
    assert status == 2 and "--tls-key" in err
    status, err = run_main(capsys, "--pop", "new-york", "--control-plane", "ftp://x")
    assert status == 2 and "control_plane" in err


@pytest.mark.parametrize("url", ["http://10.0.0.7:8080", "http://cp.example.com", "http://[::2]"])
def test_a_plain_http_control_plane_off_loopback_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", TOKEN)
    # Certificate files that do not exist: had the URL been accepted, start-up would stop there.
    tls = ["--tls-cert", "none.pem", "--tls-key", "none.key"]
    status, err = run_main(capsys, "--pop", "new-york", "--control-plane", url, *tls)
    assert status == 2 and err.count("\n") == 1
    assert "https" in err and "loopback" in err and TOKEN not in err


@pytest.mark.parametrize(
    "url",
    ["https://cp.example.com", "http://127.0.0.1:8080", "http://127.9.9.9", "http://localhost:1"]
    + ["http://[::1]:8080/"],
)
def test_https_or_loopback_control_planes_are_accepted(url: str) -> None:
    settings = GatewaySettings(pop="new-york", control_plane=url, gateway_token=TOKEN)
    assert settings.control_plane == url


def test_the_connect_floor_may_not_exceed_its_ceiling() -> None:
    base = {"pop": "new-york", "control_plane": "http://127.0.0.1:1", "gateway_token": TOKEN}
    with pytest.raises(ValueError, match="min_connect_timeout_s must not exceed"):
        GatewaySettings(**base, min_connect_timeout_s=3.0, connect_timeout_s=2.0)
    assert GatewaySettings(**base, min_connect_timeout_s=2.0, connect_timeout_s=2.0)


def test_the_serving_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    base: dict[str, Any] = {
        "pop": "new-york",
        "control_plane": "http://127.0.0.1:1",
        "gateway_token": TOKEN,
    }
    assert GatewaySettings(**base).serving_authorization is None
    monkeypatch.setenv("MERIDIAN_SERVING_TOKEN", "srv-token-123")
    assert GatewaySettings(**base).serving_authorization == "Bearer srv-token-123"


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env["MERIDIAN_GATEWAY_TOKEN"] = TOKEN
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# Stands for an install without the `redis` extra: importing redis fails.
WITHOUT_REDIS = "import sys; sys.modules['redis'] = None\n"


@pytest.mark.slow
def test_the_gateway_imports_redis_only_for_shared_limits() -> None:
    code = WITHOUT_REDIS + (
        "import gateway.__main__, gateway.app\n"
        "from gateway.app import create_app\n"
        "from gateway.settings import GatewaySettings\n"
        "s = GatewaySettings(pop='new-york', control_plane='http://127.0.0.1:1', "
        "gateway_token='" + TOKEN + "')\n"
        "create_app(s)\n"
        "print('ok')\n"
    )
    result = run_python(code)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


@pytest.mark.slow
def test_shared_limits_without_redis_installed_fail_at_start_with_one_line() -> None:
    code = WITHOUT_REDIS + "from gateway.__main__ import main; sys.exit(main(sys.argv[1:]))"
    args = ["--pop", "new-york", "--control-plane", "http://127.0.0.1:1", "--plain"]
    result = run_python(code, *args, "--port", "0", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "pip install 'meridian[redis]'" in result.stderr


def test_missing_certificate_files_fail_at_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", TOKEN)
    status, err = run_main(
        capsys,
        "--pop",
        "new-york",
        "--control-plane",
        "http://127.0.0.1:1",
        "--tls-cert",
        str(tmp_path / "none.pem"),
        "--tls-key",
        str(tmp_path / "none.key"),
    )
    assert status == 1 and "TLS" in err


def test_self_signed_certificate_names_loopback_and_needs_tls_1_2(tmp_path: Path) -> None:
    cert_path, key_path = make_self_signed("127.0.0.1", tmp_path)
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1"}
    assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    context = server_context(cert_path, key_path)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


@pytest.mark.slow
def test_the_gateway_process_serves_https_and_logs_request_ids(
    two_regions: Fleet, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "gateway.log"
    env = child_env()
    env["MERIDIAN_GATEWAY_TOKEN"] = two_regions.tokens.gateway
    args = [
        sys.executable,
        "-m",
        "gateway",
        "--pop",
        "new-york",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--control-plane",
        two_regions.cp_url,
        "--self-signed",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
    try:
        cert_path = _wait_for_certificate(log_path, process)
        context = ssl.create_default_context(cafile=str(cert_path))
        url = f"https://127.0.0.1:{port}"
        health = _wait_for_health(url, context)
        assert health["status"] == "ok" and set(health["regions"]) == {"us-east", "eu-west"}
        response = httpx.get(url + "/v1/models", verify=context, headers={"X-Request-Id": "rid-42"})
        assert response.status_code == 401
        old = ssl.create_default_context(cafile=str(cert_path))
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", verify=old)
    finally:
        process.terminate()
        assert process.wait(timeout=15) in CLEAN_EXIT
    log_text = log_path.read_text()
    assert re.search(r"\[rid-42\]: GET /v1/models 401 region=none", log_text), log_text


def _wait_for_certificate(log_path: Path, process: subprocess.Popen[bytes]) -> Path:
    def logged() -> re.Match[str] | None:
        assert process.poll() is None, log_path.read_text()
        return CERTIFICATE_LOGGED.search(log_path.read_text())

    return Path(bounded_wait.wait_until(logged, 20.0, "the certificate logged").group(1))


def _wait_for_health(url: str, context: ssl.SSLContext) -> dict[str, object]:
    def is_healthy() -> bool:
        try:
            return httpx.get(url + "/health", verify=context).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(is_healthy, 20.0, "the gateway healthy")
    body: dict[str, object] = httpx.get(url + "/health", verify=context).json()
    return body
