"""Provider clients: ChatClients that call remote LLM APIs over HTTP, and their registry."""

from chatroute.errors import (
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
    classify_failure,
    kind_for_status,
    parse_retry_after,
)
from chatroute.providers.anthropic_messages import AnthropicChatClient
from chatroute.providers.http_base import HTTPChatClient, StreamTranslator
from chatroute.providers.openai_compat import OpenAIChatClient
from chatroute.providers.pass_through import PassThrough
from chatroute.providers.registry import provider_class, provider_types, register_provider

__all__ = [
    "FAILURE_POLICIES",
    "AnthropicChatClient",
    "ContextLengthExceededError",
    "FailureKind",
    "FailurePolicy",
    "FirstTokenTimeoutError",
    "HTTPChatClient",
    "MalformedResponseError",
    "OpenAIChatClient",
    "PassThrough",
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
    "StreamTranslator",
    "TruncatedStreamError",
    "UpstreamStreamError",
    "classify_failure",
    "kind_for_status",
    "parse_retry_after",
    "provider_class",
    "provider_types",
    "register_provider",
]
