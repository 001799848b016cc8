"""`chatroute route --url`: route decisions asked of a running service (`POST /v1/route`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

__all__ = ["RemoteError", "check_url", "route_remote"]

ROUTE_PATH = "/v1/route"


class RemoteError(Exception):
    """The service could not be asked, or refused: one line that says why."""


def check_url(url: str) -> str:
    """The service's base URL without a trailing slash; RemoteError unless it is
    http(s)://host[:port][/prefix]."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise RemoteError(f"--url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"--url must look like http://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise RemoteError(f"--url takes no query or fragment, got {url!r}")
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def _error_message(response: httpx.Response) -> str:
    """The message of an answer in OpenAI's error shape, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return json.dumps(body)[:200]


async def _ask(client: httpx.AsyncClient, base: str, text: str) -> dict[str, Any]:
    try:
        response = await client.post(f"{base}{ROUTE_PATH}", json={"input": text})
    except httpx.TimeoutException:
        timeout = client.timeout.read
        raise RemoteError(f"the chatroute service at {base} did not answer within {timeout:g} s")
    except httpx.TransportError as exc:
        reason = str(exc) or type(exc).__name__
        raise RemoteError(f"cannot reach the chatroute service at {base}: {reason}") from None
    if response.status_code == 401:
        raise RemoteError(
            f"the service at {base} refused the API key (401): pass --api-key or set "
            "CHATROUTE_API_KEY"
        )
    if response.status_code != 200:
        raise RemoteError(
            f"the service at {base} answered {response.status_code}: {_error_message(response)}"
        )
    try:
        decision = response.json()
    except ValueError:
        decision = None
    if not isinstance(decision, dict) or "route" not in decision:
        raise RemoteError(f"{base}{ROUTE_PATH} did not answer with a route decision")
    return decision


async def route_remote(
    url: str,
    texts: Sequence[str],
    *,
    api_key: str | None = None,
    request_timeout: float = 30.0,
    concurrency: int = 16,
) -> list[dict[str, Any]]:
    """The service's decision (`/v1/route`'s answer) for each text, in order, asked with at
    most `concurrency` requests in flight, each allowed `request_timeout` seconds.
    RemoteError on the first failure."""
    base = check_url(url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        headers=headers, timeout=httpx.Timeout(request_timeout), limits=limits
    ) as client:

        async def one(text: str) -> dict[str, Any]:
            async with gate:
                return await _ask(client, base, text)

        tasks = [asyncio.ensure_future(one(text)) for text in texts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
