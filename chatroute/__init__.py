"""chatroute: a self-hosted, GPU-batched semantic router and failover gateway for LLM traffic."""

from chatroute.chat import (
    ChatClient,
    ChatFinishReason,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ConfigureOptionsChatClient,
    Content,
    DelegatingChatClient,
    EmbeddingFingerprint,
    EmbeddingGenerator,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    TextReasoningContent,
    UsageDetails,
)
from chatroute.router import RoutingChatClient, RoutingContext

__version__ = "0.1.0"

__all__ = [
    "ChatClient",
    "ChatFinishReason",
    "ChatMessage",
    "ChatOptions",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatRole",
    "ConfigureOptionsChatClient",
    "Content",
    "DelegatingChatClient",
    "EmbeddingFingerprint",
    "EmbeddingGenerator",
    "FunctionCallContent",
    "FunctionResultContent",
    "RoutingChatClient",
    "RoutingContext",
    "TextContent",
    "TextReasoningContent",
    "UsageDetails",
    "__version__",
]
