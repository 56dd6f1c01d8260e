"""The admin-API client the admin CLI (and `meridian up`) calls through: one URL or the replicas'
in turn, the operator token in a header, and every failure as a one-line `AdminCliError`."""

from __future__ import annotations

from typing import Any, Final

import httpx

from wire.control_plane_urls import ControlPlaneUrls, is_retryable_status

TOKEN_ENV: Final = "MERIDIAN_ADMIN_TOKEN"
TIMEOUT_S: Final = 10.0


class AdminCliError(Exception):
    """A failure to report as one line; `status` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def error_message(response: httpx.Response) -> str:
    """The control plane's own error message (OpenAI error shape), else the raw status."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.reason_phrase or "error"
    return f"{response.status_code} {message}"


class AdminClient:
    """The few admin-API calls this CLI makes, each failing with a one-line `AdminCliError`."""

    def __init__(self, base_url: str, token: str) -> None:
        """`base_url`: one URL, or the replicas' URLs comma-separated (each tried in turn)."""
        self._urls = ControlPlaneUrls.parse(base_url)
        self._http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT_S)

    @property
    def base_url(self) -> str:
        return self._urls.current

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        response = self._first_answer(method, path, body)
        if response.status_code in (401, 403):
            raise AdminCliError(
                f"the control plane at {self.base_url} refused the admin token "
                f"({error_message(response)}); check {TOKEN_ENV} (Terraform: admin_token)"
            )
        return response

    def _first_answer(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        """The answer of the first replica that gives one (a 5xx counts only from the last)."""
        failure = ""
        for url in self._urls.in_turn():
            try:
                response = self._http.request(method, url + path, json=body)
            except httpx.HTTPError as exc:
                failure = f"{url}: {exc}"
                continue
            if is_retryable_status(response.status_code) and url != self._urls.urls[-1]:
                failure = f"{url}: HTTP {response.status_code}"
                continue
            self._urls.settle(url)
            return response
        tried = f" (every one of {len(self._urls)} replicas failed)" if len(self._urls) > 1 else ""
        raise AdminCliError(f"cannot reach the control plane at {failure}{tried}")


def expect(response: httpx.Response, what: str, *ok: int) -> httpx.Response:
    if response.status_code not in ok:
        raise AdminCliError(f"{what}: {error_message(response)}")
    return response
