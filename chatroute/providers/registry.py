"""The provider registry: a config's `type:` names the class that builds the provider client."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from chatroute.chat.client import ChatClient

if TYPE_CHECKING:
    from chatroute.config import ProviderConfig

__all__ = [
    "ProviderFactory",
    "build_from_config",
    "provider_class",
    "provider_types",
    "register_provider",
]


class ProviderFactory(Protocol):
    """What a registered provider class offers: `from_config` builds a client from a config
    entry; `default_base_url` is the endpoint used when the entry names none (None: the
    entry must name one)."""

    default_base_url: ClassVar[str | None]

    @classmethod
    def from_config(cls, settings: ProviderConfig, **common: Any) -> ChatClient: ...


# type -> the class, or "module:Class" until it is first asked for.
_PROVIDERS: dict[str, type[ProviderFactory] | str] = {
    "openai": "chatroute.providers.openai_compat:OpenAIChatClient",
    "anthropic": "chatroute.providers.anthropic_messages:AnthropicChatClient",
}


def register_provider(type_name: str, cls: type[ProviderFactory] | str) -> None:
    """Make `type: <type_name>` in a config build providers with `cls` (a class, or its
    "module:Class" path, imported when first used). Replaces an earlier registration."""
    if not isinstance(type_name, str) or not type_name.strip():
        raise ValueError("a provider type is a non-empty string")
    if isinstance(cls, str) and ":" not in cls:
        raise ValueError(f"{cls!r} is not a 'module:Class' path")
    _PROVIDERS[type_name] = cls


def provider_types() -> tuple[str, ...]:
    """The registered provider types, in registration order."""
    return tuple(_PROVIDERS)


def provider_class(type_name: str) -> type[ProviderFactory]:
    """The class registered for `type_name`; KeyError naming the known types if none is."""
    try:
        entry = _PROVIDERS[type_name]
    except KeyError:
        raise KeyError(
            f"unknown provider type {type_name!r}; known: {', '.join(_PROVIDERS)}"
        ) from None
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = getattr(importlib.import_module(module), attribute)
        assert isinstance(entry, type)
        _PROVIDERS[type_name] = entry
    return entry


def build_from_config(
    name: str,
    settings: ProviderConfig,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
) -> ChatClient:
    """The provider client for one config entry: the settings every HTTP provider takes,
    handed to the registered class's `from_config` with the entry itself."""
    timeouts = settings.timeouts
    common: dict[str, Any] = {
        "model": model,
        "base_url": base_url,
        "api_key": api_key,
        "name": name,
        "connect_timeout": timeouts.connect,
        "read_timeout": timeouts.read,
        "write_timeout": timeouts.write,
        "pool_timeout": timeouts.pool,
        "request_timeout": timeouts.attempt,
        "first_token_timeout": timeouts.first_token,
        "stall_timeout": timeouts.stall,
        "max_connections": settings.max_connections,
        "default_headers": dict(settings.headers) or None,
        "extra_body": dict(settings.extra_body) or None,
        "context_window": settings.context_window,
        "default_query": dict(settings.query) or None,
        "pass_through": (
            frozenset(settings.pass_through)
            if isinstance(settings.pass_through, list)
            else settings.pass_through
        ),
    }
    return provider_class(settings.type).from_config(settings, **common)
