"""What every provider request carries besides its body: a process-wide header hook (trace
context) and the id of the request being served."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "RequestHeaderHook",
    "added_headers",
    "header_hook",
    "request_id",
    "set_request_header_hook",
]

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "chatroute_request_id", default=None
)
"""The id of the request the service is answering (its `x-request-id`), set for the time the
request runs: every provider attempt made for it sends the id upstream as `x-request-id`
(unless the provider's configured headers name one), so the upstream's logs can be joined
with the gateway's."""

RequestHeaderHook = Callable[[Any], Mapping[str, str] | None]
"""Called with the provider client before each request; what it returns is sent as well."""

header_hook: RequestHeaderHook | None = None


def set_request_header_hook(hook: RequestHeaderHook | None) -> None:
    """Install the hook every provider request asks for extra headers; None removes it."""
    global header_hook
    header_hook = hook


def added_headers(client: Any, headers: dict[str, str]) -> dict[str, str]:
    """`headers` with what the hook adds for `client` (the same dict when it adds nothing)."""
    hook = header_hook
    added = hook(client) if hook is not None else None
    return {**headers, **added} if added else headers
