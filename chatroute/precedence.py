"""Option precedence on a route: its `options` fill in what the caller left unset, its
`override` forces values, and which forced values changed what the caller sent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from chatroute.chat.types import ChatOptions

if TYPE_CHECKING:
    from chatroute.config import RouteConfig, RouteOptions

__all__ = ["fill_defaults", "force_values", "overridden_fields", "route_configure"]

# RouteOptions field -> (the ChatOptions attribute it sets, the request field it stands for)
_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("temperature", "temperature"),
    "top_p": ("top_p", "top_p"),
    "max_output_tokens": ("max_output_tokens", "max_tokens"),
    "stop_sequences": ("stop_sequences", "stop"),
    "seed": ("seed", "seed"),
    "frequency_penalty": ("frequency_penalty", "frequency_penalty"),
    "presence_penalty": ("presence_penalty", "presence_penalty"),
    "instructions": ("instructions", "instructions"),
    "reasoning_effort": ("reasoning", "reasoning_effort"),
    "response_format": ("response_format", "response_format"),
}


def _set(route: RouteOptions) -> Iterator[tuple[str, str, Any]]:
    """(ChatOptions attribute, request field name, value) for each option the route sets,
    `extra_body` aside."""
    for field, (attribute, wire) in _FIELDS.items():
        value = getattr(route, field)
        if value is None:
            continue
        if field == "stop_sequences":
            value = list(value)
        elif field == "reasoning_effort":
            value = {"effort": value}
        yield attribute, wire, value


def fill_defaults(route: RouteOptions, options: ChatOptions) -> None:
    """Set on `options` each option the route configures that the caller left unset;
    `extra_body` fields go in where the caller's request has no field of that name."""
    for attribute, _, value in _set(route):
        if getattr(options, attribute) is None:
            setattr(options, attribute, value)
    if route.extra_body:
        options.additional_properties = {
            **route.extra_body,
            **(options.additional_properties or {}),
        }


def force_values(route: RouteOptions, options: ChatOptions) -> None:
    """Set on `options` every option the route configures, whatever the caller sent."""
    for attribute, _, value in _set(route):
        setattr(options, attribute, value)
    if route.extra_body:
        options.additional_properties = {
            **(options.additional_properties or {}),
            **route.extra_body,
        }
        if options.pass_through_fields:  # forced fields are the operator's, not the caller's
            options.pass_through_fields = options.pass_through_fields.difference(route.extra_body)


def overridden_fields(route: RouteOptions, options: ChatOptions) -> list[str]:
    """The request fields the caller sent (in `options`, before the route touched them)
    that `route`, an override, replaces with another value: wire names, sorted."""
    names: list[str] = []
    extra = options.additional_properties or {}
    for attribute, wire, value in _set(route):
        sent = getattr(options, attribute)
        if sent is not None and sent != value:
            if wire == "max_tokens" and "max_completion_tokens" in extra:
                wire = "max_completion_tokens"
            names.append(wire)
    for key, value in (route.extra_body or {}).items():
        if key in extra and extra[key] != value:
            names.append(key)
    return sorted(set(names))


def route_configure(route: RouteConfig) -> Callable[[ChatOptions], None] | None:
    """What a route does to the options of each request it serves (defaults first, then
    the override); None when it sets nothing."""
    defaults, override = route.options, route.override
    if defaults.is_empty() and override.is_empty():
        return None

    def configure(options: ChatOptions) -> None:
        fill_defaults(defaults, options)
        force_values(override, options)

    return configure
