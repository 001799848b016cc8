"""What the endpoints run on (`Service`), and the checks and routing steps they share."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from chatroute.chat.client import ChatClient
from chatroute.chat.types import ChatMessage
from chatroute.config import ChatrouteConfig
from chatroute.engine import Engine
from chatroute.router.decision import RouteDecision
from chatroute.server.errors import APIError, Redactor, error_from_exception
from chatroute.server.metrics import ServiceMetrics
from chatroute.server.request_log import note_decision, note_trace
from chatroute.server.wire import WireMessage
from chatroute.session.sticky import current_session
from chatroute.tracing import RequestTrace, TraceSink, end_trace

__all__ = [
    "AUTO_MODEL",
    "CHAT_PATH",
    "CLIENT_CLOSED",
    "Service",
    "check_length",
    "check_messages",
    "decide",
    "named_route",
    "ready_service",
    "routing_failure",
]

logger = logging.getLogger("chatroute.server")

AUTO_MODEL = "auto"
CHAT_PATH = "/v1/chat/completions"
ROUTE_HEADER = "x-chatroute-route"
PROVIDER_HEADER = "x-chatroute-provider"
ATTEMPTS_HEADER = "x-chatroute-attempts"
UPSTREAM_ID_HEADER = "x-chatroute-upstream-request-id"
TIMEOUT_HEADER = "x-chatroute-timeout"
IGNORED_HEADER = "x-chatroute-ignored-params"
CLIENT_CLOSED = 499  # the status logged for a request whose caller left (nginx's convention)


@dataclass(eq=False)
class Service:
    """What the endpoints run on: the engine, the metrics and the request limits."""

    engine: Engine
    metrics: ServiceMetrics
    redact: Redactor
    ready: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    trace_sink: TraceSink | None = None
    on_decision: Callable[[RouteDecision, str, int], None] | None = None
    """Called with each routing decision, its route and when routing began (ns since the
    epoch); set when tracing is on."""

    @property
    def config(self) -> ChatrouteConfig:
        """The validated configuration."""
        return self.engine.config

    def finish(self, trace: RequestTrace, status: int, started: float) -> None:
        """Record a finished chat request: its status, metrics, and the trace sink."""
        trace.status = status
        route = trace.route or ""
        if trace.cancelled is not None:
            logger.info(
                "caller %s on route %s %s output after %d attempt(s)",
                "left" if trace.cancelled == "disconnect" else "ran out of its deadline",
                route,
                "after" if trace.committed else "before",
                trace.attempt_count,
            )
        note_trace(trace)
        self.metrics.observe_trace(trace)
        self.metrics.observe_output(trace, started)
        session = current_session()
        if session is not None and session.outcome is not None and session.provider is not None:
            self.metrics.labelled(self.metrics.sticky_sessions, route, session.outcome).inc()
        self.metrics.observe_cancellation(trace)
        self.metrics.observe_request(
            "chat_completions", route, status, time.perf_counter() - started
        )
        if self.trace_sink is not None:
            try:
                self.trace_sink(trace)
            except Exception:
                logger.exception("the trace sink failed")
        end_trace()

    def route_headers(self, route: str | None, trace: RequestTrace | None) -> dict[str, str]:
        """The `x-chatroute-*` headers for a request."""
        headers: dict[str, str] = {}
        if route is not None:
            headers[ROUTE_HEADER] = route
        if trace is not None:
            provider = trace.provider
            if provider is not None:
                headers[PROVIDER_HEADER] = provider
                headers[ATTEMPTS_HEADER] = str(trace.attempt_count)
            if trace.upstream_request_id is not None:
                headers[UPSTREAM_ID_HEADER] = trace.upstream_request_id
        return headers


def ready_service(request: Request) -> Service:
    """The service behind the `/v1` API; 503 (`not_ready`) until it is ready."""
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None or not service.ready:
        raise APIError(
            503,
            "the router is not ready",
            type="server_error",
            code="not_ready",
            headers={"retry-after": "1"},
        )
    return service


def check_messages(service: Service, messages: Sequence[WireMessage]) -> None:
    limits = service.config.server
    if len(messages) > limits.max_messages:
        raise APIError(
            400,
            f"messages: at most {limits.max_messages} messages per request",
            param="messages",
            code="too_many",
        )
    limit = limits.max_message_chars
    for position, message in enumerate(messages):
        content = message.content
        if content is None:
            continue
        if isinstance(content, str):
            size = len(content)
        else:
            size = sum(len(part.text or "") for part in content)
        if size > limit:
            check_length(service, size, f"messages[{position}].content")


def check_length(service: Service, size: int, param: str) -> None:
    limit = service.config.server.max_message_chars
    if size > limit:
        raise APIError(
            400,
            f"{param}: at most {limit} characters per message, got {size}",
            param=param,
            code="message_too_long",
        )


def routing_failure(service: Service, exc: Exception) -> APIError:
    error = error_from_exception(exc, service.redact)
    if error.status == 503:
        return error
    logger.error("routing failed: %s", type(exc).__name__)
    return APIError(500, "routing failed", type="server_error", code="routing_failed")


async def decide(
    service: Service, messages: Sequence[ChatMessage], endpoint: str = "chat"
) -> RouteDecision:
    hook = service.on_decision
    began = time.time_ns() if hook is not None else 0
    try:
        decision = await service.engine.decide(messages)
    except Exception as exc:
        raise routing_failure(service, exc)
    name = service.engine.route_name(decision.client)
    if hook is not None:
        hook(decision, name, began)
    service.metrics.observe_decision(endpoint, name, decision.is_default)
    note_decision(name, decision.score, decision.is_default)
    return decision


def named_route(service: Service, model: str | None) -> tuple[str, ChatClient] | None:
    """The route a request names as its `model`; None for `auto` (or no model), which the
    semantic router decides; 404 for a name that is no route."""
    if model is None or model == "" or model == AUTO_MODEL:
        return None
    engine = service.engine
    client = engine.routes.get(model)
    if client is None:
        known = ", ".join([AUTO_MODEL, *engine.routes])
        shown = model if len(model) <= 80 else model[:77] + "..."
        raise APIError(
            404,
            f"The model '{shown}' does not exist: use one of {known}",
            param="model",
            code="model_not_found",
        )
    return model, client
