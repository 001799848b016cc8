"""The HTTP service: an OpenAI-compatible routing gateway, route/classify APIs, health, metrics."""

from chatroute.engine import Engine, build_engine
from chatroute.server.app import Service, create_app
from chatroute.server.connection import GuardedHttpProtocol, http_protocol
from chatroute.server.errors import APIError
from chatroute.tracing import (
    AttemptRecord,
    RecordingFailoverChatClient,
    RequestTrace,
    TraceRecorder,
)

__all__ = [
    "APIError",
    "AttemptRecord",
    "Engine",
    "GuardedHttpProtocol",
    "RecordingFailoverChatClient",
    "RequestTrace",
    "Service",
    "TraceRecorder",
    "build_engine",
    "create_app",
    "http_protocol",
]
