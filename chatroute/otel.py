"""OpenTelemetry spans of chat requests (GenAI semantic conventions), fed from request traces."""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatroute import __version__
from chatroute.providers import request_hooks
from chatroute.providers.http_base import HTTPChatClient
from chatroute.router.decision import RouteDecision
from chatroute.tracing import AttemptRecord, RequestTrace

__all__ = ["OTelLayer", "OTelMiddleware", "tracer_provider_from_environment"]

logger = logging.getLogger("chatroute.otel")

INSTRUMENTATION = "chatroute"
CHAT_PATH = "/v1/chat/completions"


@dataclass(eq=False)
class _Attempt:
    provider: str
    span: Span
    started_ns: int


@dataclass(eq=False)
class _RequestSpans:
    """The spans of one chat request while it runs (held in a context variable)."""

    layer: OTelLayer
    span: Span
    context: otel_context.Context
    attempts: list[_Attempt] = field(default_factory=list)
    trace: RequestTrace | None = None
    request_model: str | None = None


_current: contextvars.ContextVar[_RequestSpans | None] = contextvars.ContextVar(
    "chatroute_otel_request", default=None
)


def _upstream_headers(client: HTTPChatClient) -> Mapping[str, str] | None:
    """The provider request hook: open the attempt's span, return its `traceparent`."""
    spans = _current.get()
    if spans is None:
        return None
    return spans.layer.start_attempt(spans, client)


def tracer_provider_from_environment(environ: Mapping[str, str]) -> TracerProvider | None:
    """An SDK TracerProvider with the exporters `OTEL_TRACES_EXPORTER` names (entry points of
    the `opentelemetry_traces_exporter` group: `otlp`, `console`, ...), its resource from
    `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` and its sampler from
    `OTEL_TRACES_SAMPLER`; None when no exporter could be loaded."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    exporters: list[SpanExporter] = []
    available = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            name = _otlp_exporter(environ, available)
        point = available.get(name)
        if point is None:
            logger.error(
                "OTEL_TRACES_EXPORTER names %r, which is not installed (installed: %s); "
                "for otlp install chatroute[otlp]",
                name,
                ", ".join(sorted(available)) or "none",
            )
            continue
        exporters.append(point.load()())
    if not exporters:
        return None
    resource = Resource.create({"service.name": "chatroute", "service.version": __version__})
    if environ.get("OTEL_SERVICE_NAME"):
        resource = resource.merge(Resource.create({"service.name": environ["OTEL_SERVICE_NAME"]}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(environ: Mapping[str, str], available: Mapping[str, Any]) -> str:
    """The entry point `otlp` stands for: the protocol's (`OTEL_EXPORTER_OTLP_PROTOCOL`:
    `grpc` or `http/protobuf`), else whichever OTLP exporter is installed."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip()
    if protocol == "grpc":
        return "otlp_proto_grpc"
    if protocol.startswith("http"):
        return "otlp_proto_http"
    for name in ("otlp", "otlp_proto_http", "otlp_proto_grpc"):
        if name in available:
            return name
    return "otlp"


class OTelLayer:
    """Turns a chat request into spans: `chat <model>` (server) with `chatroute.route` for the
    routing decision and one `chat <model>` client span per provider attempt.

    The request span continues the caller's `traceparent` (a malformed one starts a new
    trace); each attempt's span context goes to the upstream as its `traceparent`. Attributes
    come from the request's `RequestTrace` (the service's trace sink) and the routing decision.
    """

    def __init__(
        self,
        provider: otel_trace.TracerProvider,
        *,
        owned: bool,
        provider_types: Mapping[str, str] | None = None,
    ) -> None:
        self.provider = provider
        self.owned = owned
        self.tracer = provider.get_tracer(INSTRUMENTATION, __version__)
        self.provider_types: dict[str, str] = dict(provider_types or {})
        self.provider_models: dict[str, str] = {}
        request_hooks.set_request_header_hook(_upstream_headers)

    def describe_engine(self, types: Mapping[str, str], models: Mapping[str, str]) -> None:
        """The configured type (`openai`, `anthropic`, ...) and model of each provider."""
        self.provider_types = dict(types)
        self.provider_models = dict(models)

    # ------------------------------------------------------------------ request span

    def start_request(self, scope: Scope) -> _RequestSpans:
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key in (b"traceparent", b"tracestate", b"baggage")
        }
        parent = propagate.extract(carrier)
        span = self.tracer.start_span("chat", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("http.request.method", scope.get("method", ""))
        span.set_attribute("url.path", scope.get("path", ""))
        server = scope.get("server")
        if server:
            span.set_attribute("server.address", str(server[0]))
            if server[1] is not None:
                span.set_attribute("server.port", int(server[1]))
        return _RequestSpans(self, span, otel_trace.set_span_in_context(span, parent))

    def end_request(self, spans: _RequestSpans, scope: Scope, status: int | None) -> None:
        span = spans.span
        body = scope.get("chatroute.json")
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model:
            span.set_attribute("gen_ai.request.model", model[:200])
            span.update_name(f"chat {model[:200]}")
        trace = spans.trace
        if trace is not None:
            status = trace.status if trace.status is not None else status
            self._finish_attempts(spans, trace)
            if trace.route is not None:
                span.set_attribute("chatroute.route", trace.route)
            span.set_attribute("chatroute.attempts", trace.attempt_count)
            span.set_attribute("chatroute.failovers", trace.failovers)
            span.set_attribute("chatroute.stream", trace.stream)
            if trace.cancelled is not None:
                span.set_attribute("chatroute.cancelled", trace.cancelled)
            provider = trace.provider
            if provider is not None:
                span.set_attribute("chatroute.provider", provider)
                response_model = trace.response_model or self.provider_models.get(provider)
                if response_model:
                    span.set_attribute("gen_ai.response.model", response_model)
            if trace.upstream_request_id is not None:
                span.set_attribute("chatroute.upstream.request_id", trace.upstream_request_id)
            _usage(span, trace)
        for open_attempt in spans.attempts:  # attempts no record matched (cut short)
            open_attempt.span.end()
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or status == 499:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(status))
            elif status >= 400:
                span.set_attribute("error.type", str(status))
        span.end()

    # ------------------------------------------------------------------ child spans

    def on_decision(self, decision: RouteDecision, route: str, began_ns: int) -> None:
        """The routing decision as a `chatroute.route` span (the service's decision hook)."""
        spans = _current.get()
        if spans is None:
            return
        span = self.tracer.start_span("chatroute.route", context=spans.context, start_time=began_ns)
        span.set_attribute("chatroute.route", route)
        if decision.score is not None:
            span.set_attribute("chatroute.route.score", float(decision.score))
        span.set_attribute("chatroute.route.is_default", decision.is_default)
        scoring = getattr(decision, "scoring", None)
        if scoring:
            span.set_attribute("chatroute.routing.scoring", str(scoring))
        span.end()

    def start_attempt(self, spans: _RequestSpans, client: HTTPChatClient) -> dict[str, str]:
        provider = client.name
        model = client.model or self.provider_models.get(provider) or provider
        span = self.tracer.start_span(f"chat {model}", context=spans.context, kind=SpanKind.CLIENT)
        system = self.provider_types.get(provider, "openai")
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("gen_ai.provider.name", system)
        span.set_attribute("gen_ai.system", system)
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("chatroute.provider", provider)
        url = urlsplit(client.base_url)
        if url.hostname:
            span.set_attribute("server.address", url.hostname)
            port = url.port or (443 if url.scheme == "https" else 80)
            span.set_attribute("server.port", port)
        spans.attempts.append(_Attempt(provider, span, time.time_ns()))
        headers: dict[str, str] = {}
        propagate.inject(headers, context=otel_trace.set_span_in_context(span, spans.context))
        return headers

    def _finish_attempts(self, spans: _RequestSpans, trace: RequestTrace) -> None:
        for number, record in enumerate(trace.attempts):
            match = _take(spans.attempts, record.provider)
            if match is None:  # a provider without an HTTP request (a custom client)
                end = time.time_ns()
                started = end - int(record.attempt.duration * 1e9)
                model = self.provider_models.get(record.provider, record.provider)
                span = self.tracer.start_span(
                    f"chat {model}", context=spans.context, kind=SpanKind.CLIENT, start_time=started
                )
                span.set_attribute("gen_ai.operation.name", "chat")
                span.set_attribute("gen_ai.request.model", model)
                span.set_attribute("chatroute.provider", record.provider)
            else:
                span, started = match.span, match.started_ns
            self._attempt_attributes(span, record, number, trace)
            span.end(end_time=started + int(record.attempt.duration * 1e9))

    def _attempt_attributes(
        self, span: Span, record: AttemptRecord, number: int, trace: RequestTrace
    ) -> None:
        outcome = record.outcome
        span.set_attribute("chatroute.route", record.route)
        span.set_attribute("chatroute.attempt", number + 1)
        span.set_attribute("chatroute.attempt.outcome", outcome)
        if record.probe or record.forced_probe:
            span.set_attribute("chatroute.attempt.probe", True)
        ttfu = record.attempt.time_to_first_update
        if ttfu is not None:
            span.set_attribute("chatroute.attempt.time_to_first_update", ttfu)
        kind = record.failure_kind
        if kind is not None and outcome != "cancelled":
            span.set_attribute("error.type", kind)
            span.set_status(Status(StatusCode.ERROR))
        if outcome == "success":
            model = trace.response_model or self.provider_models.get(record.provider)
            if model:
                span.set_attribute("gen_ai.response.model", model)
            _usage(span, trace)

    # ------------------------------------------------------------------ lifetime

    def chain_sink(self, sink: Any) -> Any:
        """A trace sink that hands the trace to the request's spans, then to `sink`."""

        def record(trace: RequestTrace) -> None:
            spans = _current.get()
            if spans is not None:
                spans.trace = trace
            if sink is not None:
                sink(trace)

        return record

    def shutdown(self) -> None:
        """Flush and stop the tracer provider when this layer made it."""
        if self.owned:
            shutdown = getattr(self.provider, "shutdown", None)
            if callable(shutdown):
                shutdown()


def _take(attempts: list[_Attempt], provider: str) -> _Attempt | None:
    for position, attempt in enumerate(attempts):
        if attempt.provider == provider:
            return attempts.pop(position)
    return None


def _usage(span: Span, trace: RequestTrace) -> None:
    usage = trace.usage
    if usage is None:
        return
    for name, value in _usage_items(usage):
        span.set_attribute(name, value)


def _usage_items(usage: Any) -> Iterator[tuple[str, int]]:
    pairs = (
        ("gen_ai.usage.input_tokens", usage.input_token_count),
        ("gen_ai.usage.output_tokens", usage.output_token_count),
        ("gen_ai.usage.cache_read.input_tokens", usage.cached_input_token_count),
        ("gen_ai.usage.reasoning.output_tokens", usage.reasoning_token_count),
    )
    for name, value in pairs:
        if value is not None:
            yield name, int(value)


class OTelMiddleware:
    """ASGI middleware: a span around each chat request, current while the request runs."""

    def __init__(self, app: ASGIApp, layer: OTelLayer) -> None:
        self.app = app
        self.layer = layer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        layer = self.layer
        spans = layer.start_request(scope)
        status: list[int] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        token = _current.set(spans)
        attached = otel_context.attach(spans.context)
        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            spans.span.record_exception(exc)
            raise
        finally:
            otel_context.detach(attached)
            _current.reset(token)
            try:
                layer.end_request(spans, scope, status[0] if status else None)
            except Exception:
                logger.exception("recording the request's spans failed")
