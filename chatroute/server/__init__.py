"""The HTTP service: an OpenAI-compatible routing gateway, route/classify APIs, health, metrics."""

from chatroute.server.app import Service, create_app
from chatroute.server.engine import Engine, build_engine
from chatroute.server.errors import APIError
from chatroute.server.protocol import HttpProtocol, connection_of
from chatroute.server.tracing import (
    AttemptRecord,
    RecordingFailoverChatClient,
    RequestTrace,
    TraceRecorder,
)

__all__ = [
    "APIError",
    "AttemptRecord",
    "Engine",
    "HttpProtocol",
    "RecordingFailoverChatClient",
    "RequestTrace",
    "Service",
    "TraceRecorder",
    "build_engine",
    "connection_of",
    "create_app",
]
