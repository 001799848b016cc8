"""The HTTP service: an OpenAI-compatible routing gateway, route/classify APIs, health, metrics."""

from chatroute.engine import Engine, build_engine
from chatroute.server.app import Service, create_app
from chatroute.server.connection import GuardedHttpProtocol, http_protocol
from chatroute.server.errors import APIError
from chatroute.server.request_log import JsonFormatter, RequestLog, configure_logging
from chatroute.server.startup import ReadyServer, startup_summary
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
    "JsonFormatter",
    "ReadyServer",
    "RecordingFailoverChatClient",
    "RequestLog",
    "RequestTrace",
    "Service",
    "TraceRecorder",
    "build_engine",
    "configure_logging",
    "create_app",
    "http_protocol",
    "startup_summary",
]
