"""The answer headers that say what became of the caller's request options: forced by the
route's override (`x-chatroute-overridden`), or dropped by the provider that answered
(`x-chatroute-ignored-params`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from chatroute.chat.types import ChatOptions, ChatResponseUpdate
from chatroute.config import ChatrouteConfig
from chatroute.precedence import overridden_fields
from chatroute.providers.pass_through import IGNORED_PARAMS

__all__ = [
    "IGNORED_HEADER",
    "OVERRIDDEN_HEADER",
    "header_list",
    "ignored_headers",
    "overridden_headers",
    "stream_ignored_headers",
]

IGNORED_HEADER = "x-chatroute-ignored-params"
OVERRIDDEN_HEADER = "x-chatroute-overridden"


def header_list(names: Iterable[str], limit: int = 512) -> str:
    """A comma-separated header value of printable names, cut to `limit` characters."""
    clean = [n for n in names if n.isascii() and n.isprintable() and "," not in n]
    text = ",".join(clean)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def overridden_headers(config: ChatrouteConfig, route: str, options: ChatOptions) -> dict[str, str]:
    """`x-chatroute-overridden` naming the fields the caller sent that the route's
    override replaced with another value (no header when there are none)."""
    settings = config.routes.get(route)
    if settings is None or settings.override.is_empty():
        return {}
    names = overridden_fields(settings.override, options)
    return {OVERRIDDEN_HEADER: header_list(names)} if names else {}


def ignored_headers(properties: Mapping[str, Any] | None) -> dict[str, str]:
    """`x-chatroute-ignored-params` naming what the answering provider dropped, as it
    reported them in an answer's `additional_properties` (no header when nothing)."""
    names = properties.get(IGNORED_PARAMS) if properties else None
    if not names or not isinstance(names, list | tuple):
        return {}
    return {IGNORED_HEADER: header_list(sorted(str(n) for n in names))}


def stream_ignored_headers(updates: Sequence[ChatResponseUpdate]) -> dict[str, str]:
    """`ignored_headers` of the first update of a stream that carries the report."""
    for update in updates:
        headers = ignored_headers(update.additional_properties)
        if headers:
            return headers
    return {}
