"""chatroute: a self-hosted, GPU-batched semantic router and failover gateway for LLM traffic.

The engine (chat types, routers, failover policies, embedder, index) imports with only
numpy, torch, faiss and sentence-transformers installed. Provider clients need the openai
SDK and are loaded on first use; the service lives in `chatroute.server`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    DataContent,
    DelegatingChatClient,
    EmbeddingFingerprint,
    EmbeddingGenerator,
    FunctionCallContent,
    FunctionResultContent,
    HostedFileContent,
    TextContent,
    TextReasoningContent,
    UriContent,
    UsageDetails,
)
from chatroute.embedder import (
    EmbedderClosedError,
    EmbedderLoadError,
    EmbedderOverloadedError,
)
from chatroute.errors import (
    ContextLengthExceededError,
    FailureKind,
    FirstTokenTimeoutError,
    ProviderError,
    ProviderTimeoutError,
    StreamStallTimeoutError,
    TruncatedStreamError,
    classify_failure,
)
from chatroute.failover import (
    FailoverChatClient,
    FailoverChatClientAttempt,
    OrderedFailoverChatClient,
)
from chatroute.failover.breaker import (
    BreakerSettings,
    BreakerSnapshot,
    BreakerState,
    CircuitBreaker,
    CircuitBreakerRegistry,
)
from chatroute.failover.health import HealthAwareFailoverChatClient, Selection
from chatroute.failover.timeouts import DeadlineExceededError, TimeoutChatClient
from chatroute.index import (
    FingerprintMismatchError,
    IndexFormatError,
    InvalidEmbeddingError,
    ProfileIndex,
    ProfileIndexError,
)
from chatroute.router import (
    SCORING_MODES,
    AdapterScoring,
    CalibrationMetrics,
    CalibrationReport,
    CalibrationResult,
    ContextPolicy,
    ConversationDecision,
    ConversationPolicy,
    KnnScoring,
    LastUserPolicy,
    ProfileOverlapWarning,
    PrototypeScoring,
    RouteDecision,
    RouteMatch,
    Router,
    RoutingChatClient,
    RoutingContext,
    ScoreAggregation,
    ScoringMode,
    SemanticRoutingChatClient,
    TopKScoring,
    apply_thresholds,
    calibrate,
    context_policy,
    evaluate_decisions,
    fit_route_thresholds,
    make_scoring,
)
from chatroute.session import (
    HistoryHygieneChatClient,
    InMemorySessionStore,
    SessionRecord,
    SessionScope,
    SessionStore,
    StickyProviderChatClient,
    bind_session,
    clean_history,
    conversation_key,
    current_session,
)

if TYPE_CHECKING:
    from chatroute.embedder import SentenceTransformerEmbedder
    from chatroute.engine import Engine, build_engine
    from chatroute.providers import AnthropicChatClient, OpenAIChatClient
    from chatroute.session.redis_store import RedisSessionStore

__version__ = "0.1.0"

# The provider clients, the engine and the embedder resolve lazily so that importing
# chatroute never imports their HTTP stack or torch.
_LAZY = {name: "chatroute.providers" for name in ("AnthropicChatClient", "OpenAIChatClient")} | {
    "Engine": "chatroute.engine",
    "build_engine": "chatroute.engine",
    "RedisSessionStore": "chatroute.session.redis_store",  # needs the `redis` extra
    "SentenceTransformerEmbedder": "chatroute.embedder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chatroute' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SCORING_MODES",
    "AdapterScoring",
    "AnthropicChatClient",
    "BreakerSettings",
    "BreakerSnapshot",
    "BreakerState",
    "CalibrationMetrics",
    "CalibrationReport",
    "CalibrationResult",
    "ChatClient",
    "ChatFinishReason",
    "ChatMessage",
    "ChatOptions",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatRole",
    "CircuitBreaker",
    "CircuitBreakerRegistry",
    "ConfigureOptionsChatClient",
    "Content",
    "ContextLengthExceededError",
    "ContextPolicy",
    "ConversationDecision",
    "ConversationPolicy",
    "DataContent",
    "DeadlineExceededError",
    "DelegatingChatClient",
    "EmbedderClosedError",
    "EmbedderLoadError",
    "EmbedderOverloadedError",
    "EmbeddingFingerprint",
    "EmbeddingGenerator",
    "Engine",
    "FailoverChatClient",
    "FailoverChatClientAttempt",
    "FailureKind",
    "FingerprintMismatchError",
    "FirstTokenTimeoutError",
    "FunctionCallContent",
    "FunctionResultContent",
    "HealthAwareFailoverChatClient",
    "HistoryHygieneChatClient",
    "HostedFileContent",
    "InMemorySessionStore",
    "IndexFormatError",
    "InvalidEmbeddingError",
    "KnnScoring",
    "LastUserPolicy",
    "OpenAIChatClient",
    "OrderedFailoverChatClient",
    "ProfileIndex",
    "ProfileIndexError",
    "ProfileOverlapWarning",
    "PrototypeScoring",
    "ProviderError",
    "ProviderTimeoutError",
    "RedisSessionStore",
    "RouteDecision",
    "RouteMatch",
    "Router",
    "RoutingChatClient",
    "RoutingContext",
    "ScoreAggregation",
    "ScoringMode",
    "Selection",
    "SemanticRoutingChatClient",
    "SentenceTransformerEmbedder",
    "SessionRecord",
    "SessionScope",
    "SessionStore",
    "StickyProviderChatClient",
    "StreamStallTimeoutError",
    "TextContent",
    "TextReasoningContent",
    "TimeoutChatClient",
    "TopKScoring",
    "TruncatedStreamError",
    "UriContent",
    "UsageDetails",
    "__version__",
    "apply_thresholds",
    "bind_session",
    "build_engine",
    "calibrate",
    "classify_failure",
    "clean_history",
    "context_policy",
    "conversation_key",
    "current_session",
    "evaluate_decisions",
    "fit_route_thresholds",
    "make_scoring",
]
