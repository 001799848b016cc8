"""Provider clients: ChatClients that call remote LLM APIs, and their typed errors."""

from typing import TYPE_CHECKING, Any

from chatroute.providers.errors import (
    FAILURE_POLICIES,
    ContextLengthExceededError,
    FailureKind,
    FailurePolicy,
    FirstTokenTimeoutError,
    MalformedResponseError,
    ProviderAuthError,
    ProviderBadRequestError,
    ProviderConnectionError,
    ProviderError,
    ProviderServerError,
    ProviderStatusError,
    ProviderTimeoutError,
    RateLimitedError,
    StreamInterruptedError,
    StreamStallTimeoutError,
    TruncatedStreamError,
    UpstreamStreamError,
    classify,
    kind_for_status,
    parse_retry_after,
)
from chatroute.providers.openai_compat import OpenAIChatClient

if TYPE_CHECKING:
    from chatroute.providers.anthropic_messages import AnthropicChatClient


def __getattr__(name: str) -> Any:
    # AnthropicChatClient needs the optional anthropic SDK: imported when asked for.
    if name == "AnthropicChatClient":
        from chatroute.providers.anthropic_messages import AnthropicChatClient

        return AnthropicChatClient
    raise AttributeError(f"module 'chatroute.providers' has no attribute {name!r}")


__all__ = [
    "FAILURE_POLICIES",
    "AnthropicChatClient",
    "ContextLengthExceededError",
    "FailureKind",
    "FailurePolicy",
    "FirstTokenTimeoutError",
    "MalformedResponseError",
    "OpenAIChatClient",
    "ProviderAuthError",
    "ProviderBadRequestError",
    "ProviderConnectionError",
    "ProviderError",
    "ProviderServerError",
    "ProviderStatusError",
    "ProviderTimeoutError",
    "RateLimitedError",
    "StreamInterruptedError",
    "StreamStallTimeoutError",
    "TruncatedStreamError",
    "UpstreamStreamError",
    "classify",
    "kind_for_status",
    "parse_retry_after",
]
