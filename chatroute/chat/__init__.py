"""Chat abstractions: messages, options, responses and the ChatClient contract."""

from chatroute.chat.client import ChatClient, ConfigureOptionsChatClient, DelegatingChatClient
from chatroute.chat.embedding import EmbeddingFingerprint, EmbeddingGenerator
from chatroute.chat.types import (
    ChatFinishReason,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    HostedFileContent,
    TextContent,
    TextReasoningContent,
    UriContent,
    UsageDetails,
    carries_content,
)

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
    "DataContent",
    "DelegatingChatClient",
    "EmbeddingFingerprint",
    "EmbeddingGenerator",
    "FunctionCallContent",
    "FunctionResultContent",
    "HostedFileContent",
    "TextContent",
    "TextReasoningContent",
    "UriContent",
    "UsageDetails",
    "carries_content",
]
