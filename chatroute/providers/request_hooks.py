"""A process-wide hook that adds headers to every provider request (trace context)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RequestHeaderHook", "added_headers", "header_hook", "set_request_header_hook"]

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
