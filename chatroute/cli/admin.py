"""`chatroute reload --url`: ask a running service to reload its config (`POST /admin/reload`)."""

from __future__ import annotations

from typing import Any

import httpx

from chatroute.cli.remote import RemoteError, check_url

__all__ = ["RELOAD_PATH", "reload_remote"]

RELOAD_PATH = "/admin/reload"


def reload_remote(url: str, admin_key: str, *, timeout: float = 300.0) -> dict[str, Any]:
    """The service's report of a reload; RemoteError (one line) when it refused or failed."""
    base = check_url(url)
    try:
        response = httpx.post(
            f"{base}{RELOAD_PATH}",
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=timeout,
        )
    except httpx.TimeoutException:
        raise RemoteError(f"the service at {base} did not finish the reload within {timeout:g} s")
    except httpx.TransportError as exc:
        reason = str(exc) or type(exc).__name__
        raise RemoteError(f"cannot reach the chatroute service at {base}: {reason}") from None
    status = response.status_code
    message = _message(response)
    if status == 404:
        raise RemoteError(
            f"the service at {base} has no admin API (404): start it with "
            "CHATROUTE_ADMIN_KEY set (or the variable server.admin_key_env names)"
        )
    if status == 401:
        raise RemoteError(f"the service at {base} refused the admin key (401)")
    if status != 200:
        raise RemoteError(f"the service at {base} did not reload ({status}): {message}")
    body = response.json()
    if not isinstance(body, dict):
        raise RemoteError(f"{base}{RELOAD_PATH} did not answer with a reload report")
    return body


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(body)[:300]
