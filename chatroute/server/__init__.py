"""The HTTP service: an OpenAI-compatible routing gateway, route/classify APIs, health, metrics."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY = {
    "APIError": "chatroute.server.errors",
    "AttemptRecord": "chatroute.tracing",
    "Engine": "chatroute.engine",
    "GuardedHttpProtocol": "chatroute.server.connection",
    "JsonFormatter": "chatroute.server.request_log",
    "ReadyServer": "chatroute.server.startup",
    "RecordingFailoverChatClient": "chatroute.tracing",
    "RequestLog": "chatroute.server.request_log",
    "RequestTrace": "chatroute.tracing",
    "Service": "chatroute.server.app",
    "TraceRecorder": "chatroute.tracing",
    "build_engine": "chatroute.engine",
    "configure_logging": "chatroute.server.request_log",
    "create_app": "chatroute.server.app",
    "http_protocol": "chatroute.server.connection",
    "startup_summary": "chatroute.server.startup",
}


# The service resolves on first use: a piece of it that other commands share (the wire
# types `classify` reads messages with) imports without FastAPI, uvicorn and the app.
def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chatroute.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
