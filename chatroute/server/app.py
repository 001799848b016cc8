"""The FastAPI app: OpenAI-compatible chat completions, route/classify APIs, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, cast

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from chatroute import __version__
from chatroute.chat.client import ChatClient
from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponseUpdate
from chatroute.config import ChatrouteConfig
from chatroute.router.base import close_iterator
from chatroute.router.decision import RouteDecision
from chatroute.server.engine import Engine, build_engine
from chatroute.server.errors import APIError, Redactor, error_from_exception
from chatroute.server.guard import RequestGuard
from chatroute.server.metrics import PROMETHEUS_CONTENT_TYPE, ServiceMetrics
from chatroute.server.tracing import RequestTrace, start_trace
from chatroute.server.wire import (
    ChatCompletionRequest,
    ClassifyRequest,
    ConversationInput,
    RouteRequest,
    StreamEncoder,
    completion_body,
    has_content,
    query_text,
    to_chat_messages,
    to_chat_options,
)

__all__ = ["Service", "create_app"]

logger = logging.getLogger("chatroute.server")

AUTO_MODEL = "auto"
ROUTE_HEADER = "x-chatroute-route"
PROVIDER_HEADER = "x-chatroute-provider"
ATTEMPTS_HEADER = "x-chatroute-attempts"


@dataclass(eq=False)
class Service:
    """What the endpoints run on: the engine, the metrics and the request limits."""

    engine: Engine
    metrics: ServiceMetrics
    redact: Redactor
    ready: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def config(self) -> ChatrouteConfig:
        """The validated configuration."""
        return self.engine.config

    def route_headers(self, route: str | None, trace: RequestTrace | None) -> dict[str, str]:
        """The `x-chatroute-*` headers for a request."""
        headers: dict[str, str] = {}
        if route is not None:
            headers[ROUTE_HEADER] = route
        if trace is not None and trace.provider is not None:
            headers[PROVIDER_HEADER] = trace.provider
            headers[ATTEMPTS_HEADER] = str(trace.attempt_count)
        return headers


# ------------------------------------------------------------------------------ errors


def _error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error.body(), status_code=error.status, headers={**error.headers, **(headers or {})}
    )


_TYPE_TAG = re.compile(r"[\[\(]|^(str|int|float|bool|dict|list|none)$")


def _param_of(loc: Sequence[int | str]) -> str:
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            param += f".{part}" if param else part
    return param


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(
            400, f"the body is not valid JSON: {detail}".rstrip(": "), code="invalid_json"
        )
    param = _param_of(loc)
    kind = first.get("type")
    if not param and kind == "missing":
        return APIError(400, "a JSON object body is required", code="invalid_body")
    if not param and kind in ("model_attributes_type", "dict_type", "model_type"):
        if isinstance(first.get("input"), bytes):
            message = "the body must be a JSON object sent as application/json"
        else:
            message = "the body must be a JSON object"
        return APIError(400, message, code="invalid_body")
    message = str(first.get("msg", "invalid value"))
    if kind == "extra_forbidden":
        message = "unrecognized request argument"
    elif kind == "too_short" and param == "messages":
        message = "must contain at least one message"
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    text = f"{param}: {message}" if param else message
    return APIError(400, text, param=param or None, code="invalid_value")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:
            message = "the request body could not be parsed"
        elif exc.status_code == 404:
            message = f"unknown path {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code
        )
        return _error_response(
            APIError(exc.status_code, message, code=code), dict(exc.headers or {})
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled %s on %s", type(exc).__name__, request.url.path)
        return _error_response(
            APIError(500, "internal error", type="server_error", code="internal_error")
        )


# ---------------------------------------------------------------------------- streaming


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its body and the routed stream behind it,
    however sending ends (even when the body never started)."""

    def __init__(self, content: AsyncIterator[bytes], routed: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._routed = routed

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await close_iterator(self.body_iterator)
                await close_iterator(self._routed)


async def _sse_body(
    service: Service,
    iterator: AsyncIterator[ChatResponseUpdate],
    pending: list[ChatResponseUpdate],
    finished: bool,
    encoder: StreamEncoder,
    trace: RequestTrace,
    started: float,
) -> AsyncIterator[bytes]:
    status = 200
    route = trace.route or ""
    try:
        for update in pending:
            chunk = encoder.encode(update)
            if chunk:
                yield chunk
        if not finished:
            while True:
                try:
                    update = await anext(iterator)
                except StopAsyncIteration:
                    break
                chunk = encoder.encode(update)
                if chunk:
                    yield chunk
        yield encoder.finish()
    except Exception as exc:  # after commit: in-band error, and no [DONE]
        error = error_from_exception(exc, service.redact)
        status = error.status
        logger.warning(
            "stream on route %s failed after output: %s", route, service.redact(str(error))
        )
        yield error.sse_event()
    finally:
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        service.metrics.observe_trace(trace)
        service.metrics.observe_request(
            "chat_completions", route, status, time.perf_counter() - started
        )


# -------------------------------------------------------------------------------- app


async def _service(request: Request) -> Service:
    # async on purpose: FastAPI would run a plain function in a worker thread.
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


ReadyService = Annotated[Service, Depends(_service)]


def create_app(
    source: ChatrouteConfig | Engine,
    *,
    api_keys: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    embedder: EmbeddingGenerator | None = None,
) -> FastAPI:
    """The service app for a config (built at start-up, owned by the app) or an engine
    (owned by you; build it on the event loop that serves the app).

    Start-up loads the model and builds the profile index before `/readyz` turns ready;
    shutdown closes what the app built. `api_keys` defaults to the comma-separated keys in
    the environment variable the config names (`CHATROUTE_API_KEYS`); with no keys,
    `/v1/*` is open. `environ` replaces `os.environ`; `embedder` replaces the configured
    embedding generator of a config.
    """
    env = os.environ if environ is None else environ
    config = source.config if isinstance(source, Engine) else source
    if not isinstance(config, ChatrouteConfig):
        raise TypeError(f"create_app needs a ChatrouteConfig or an Engine, got {type(source)!r}")
    if api_keys is None:
        raw = env.get(config.server.api_keys_env, "")
        api_keys = [key.strip() for key in raw.split(",") if key.strip()]
    keys = list(api_keys)
    metrics = ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not isinstance(source, Engine)
        if isinstance(source, Engine):
            engine = source
        else:  # loading the model blocks: keep it off the event loop
            engine = await asyncio.to_thread(build_engine, source, embedder=embedder, environ=env)
        redact = Redactor([*keys, *engine.secrets])
        service = Service(engine=engine, metrics=metrics, redact=redact)
        detach = _attach_embedder_metrics(engine, metrics)
        try:
            await engine.warm()
            service.ready = True
            metrics.ready.set(1)
            app.state.service = service
            logger.info(
                "chatroute ready: %d routes, %d providers",
                len(engine.routes),
                len(engine.providers),
            )
            yield
        finally:
            service.ready = False
            metrics.ready.set(0)
            detach()
            if owned:
                await engine.aclose()

    app = FastAPI(
        title="chatroute",
        summary="Semantic routing and failover gateway for OpenAI-compatible chat APIs",
        version=__version__,
        lifespan=lifespan,
    )
    app.state.service = None
    app.state.metrics = metrics
    _install_error_handlers(app)
    _install_routes(app)
    app.add_middleware(RequestGuard, api_keys=keys, max_body_bytes=config.server.max_body_bytes)
    return app


def _attach_embedder_metrics(engine: Engine, metrics: ServiceMetrics) -> Callable[[], None]:
    """Feed the embedder's batch sizes and queue depth to the metrics; returns the undo."""
    embedder: Any = engine.embedder
    if hasattr(embedder, "queue_depth"):
        metrics.watch_queue_depth(lambda: float(embedder.queue_depth))
    add_listener = getattr(embedder, "add_batch_listener", None)
    if callable(add_listener):
        remove = add_listener(metrics.observe_batch)
        if callable(remove):
            return cast(Callable[[], None], remove)
    return lambda: None


def _install_routes(app: FastAPI) -> None:
    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: the model is loaded and the profile index built."""
        service: Service | None = request.app.state.service
        if service is None or not service.ready:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready", "routes": list(service.engine.routes)})

    @app.get("/metrics", tags=["health"])
    async def metrics(request: Request) -> Response:
        """Prometheus metrics."""
        registry: ServiceMetrics = request.app.state.metrics
        return Response(registry.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models", tags=["openai"])
    async def models(service: ReadyService) -> dict[str, Any]:
        """The routes, as models; `auto` routes semantically."""
        engine = service.engine
        data = [
            {
                "id": AUTO_MODEL,
                "object": "model",
                "created": service.started_at,
                "owned_by": "chatroute",
            }
        ]
        for name, route in service.config.routes.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": service.started_at,
                    "owned_by": "chatroute",
                    "targets": [
                        {"provider": t, "model": engine.provider_models.get(t)}
                        for t in route.targets
                    ],
                }
            )
        return {"object": "list", "data": data}

    @app.post("/v1/route", tags=["routing"])
    async def route(body: RouteRequest, service: ReadyService) -> JSONResponse:
        """The route a text or conversation would take (no provider is called)."""
        started = time.perf_counter()
        engine = service.engine
        if body.messages is not None:
            _check_messages(service, body.messages)
            messages = to_chat_messages(body.messages)
        else:
            messages = [ChatMessage("user", body.input or "")]
        decision = await _decide(service, messages)
        result = engine.describe(decision, matches=True)
        service.metrics.observe_request(
            "route", result["route"], 200, time.perf_counter() - started
        )
        return JSONResponse(result)

    @app.post("/v1/classify", tags=["routing"])
    async def classify(body: ClassifyRequest, service: ReadyService) -> JSONResponse:
        """One decision per input, computed as one batch."""
        started = time.perf_counter()
        limit = service.config.server.max_classify_inputs
        if len(body.inputs) > limit:
            raise APIError(
                400, f"inputs: at most {limit} inputs per request", param="inputs", code="too_many"
            )
        queries = []
        for position, item in enumerate(body.inputs):
            if isinstance(item, ConversationInput):
                prefix = f"inputs[{position}].messages"
                queries.append(query_text(to_chat_messages(item.messages, prefix=prefix)))
            else:
                queries.append(item)
        try:
            decisions = await service.engine.decide_batch(queries)
        except Exception as exc:
            raise _routing_failure(service, exc)
        engine = service.engine
        data = [{"index": i, **engine.describe(d)} for i, d in enumerate(decisions)]
        service.metrics.classify_batch_size.observe(len(queries))
        service.metrics.observe_request("classify", "", 200, time.perf_counter() - started)
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, service: ReadyService) -> Response:
        """OpenAI chat completions, routed by content (`model: auto`) or to a named route."""
        started = time.perf_counter()
        _check_messages(service, body.messages)
        messages = to_chat_messages(body.messages)
        options = to_chat_options(body)
        route_name, client = await _resolve(service, body.model, messages)
        trace = start_trace(route_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(service, client, messages, options, trace, started, include_usage)
        return await _complete(service, client, messages, options, trace, started)


def _check_messages(service: Service, messages: Sequence[Any]) -> None:
    limit = service.config.server.max_messages
    if len(messages) > limit:
        raise APIError(
            400,
            f"messages: at most {limit} messages per request",
            param="messages",
            code="too_many",
        )


def _routing_failure(service: Service, exc: Exception) -> APIError:
    error = error_from_exception(exc, service.redact)
    if error.status == 503:
        return error
    logger.error("routing failed: %s", type(exc).__name__)
    return APIError(500, "routing failed", type="server_error", code="routing_failed")


async def _decide(service: Service, messages: Sequence[ChatMessage]) -> RouteDecision:
    try:
        decision = await service.engine.decide(messages)
    except Exception as exc:
        raise _routing_failure(service, exc)
    name = service.engine.route_name(decision.client)
    service.metrics.route_decisions.labels(name, "true" if decision.is_default else "false").inc()
    return decision


async def _resolve(
    service: Service, model: str | None, messages: Sequence[ChatMessage]
) -> tuple[str, ChatClient]:
    engine = service.engine
    if model is None or model == "" or model == AUTO_MODEL:
        decision = await _decide(service, messages)
        return engine.route_name(decision.client), decision.client
    client = engine.routes.get(model)
    if client is None:
        known = ", ".join([AUTO_MODEL, *engine.routes])
        raise APIError(
            404,
            f"The model '{model}' does not exist: use one of {known}",
            param="model",
            code="model_not_found",
        )
    return model, client


def _served_model(service: Service, trace: RequestTrace) -> str:
    provider = trace.provider
    if provider is None:
        return trace.route or AUTO_MODEL
    return service.engine.provider_models.get(provider, provider)


async def _complete(
    service: Service,
    client: ChatClient,
    messages: list[ChatMessage],
    options: ChatOptions,
    trace: RequestTrace,
    started: float,
) -> Response:
    route = trace.route or ""
    try:
        response = await client.get_response(messages, options)
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed: %s", route, service.redact(str(error)))
        service.metrics.observe_trace(trace)
        service.metrics.observe_request(
            "chat_completions", route, error.status, time.perf_counter() - started
        )
        return _error_response(error, service.route_headers(trace.route, trace))
    body = completion_body(response, model=_served_model(service, trace))
    service.metrics.observe_trace(trace)
    service.metrics.observe_request("chat_completions", route, 200, time.perf_counter() - started)
    return Response(
        body, media_type="application/json", headers=service.route_headers(trace.route, trace)
    )


async def _stream(
    service: Service,
    client: ChatClient,
    messages: list[ChatMessage],
    options: ChatOptions,
    trace: RequestTrace,
    started: float,
    include_usage: bool,
) -> Response:
    route = trace.route or ""
    iterator = aiter(client.get_streaming_response(messages, options))
    pending: list[ChatResponseUpdate] = []
    finished = False
    handed_over = False
    try:
        # The commit point: nothing is sent until the first update that carries output.
        while True:
            try:
                update = await anext(iterator)
            except StopAsyncIteration:
                finished = True
                break
            pending.append(update)
            if has_content(update):
                break
        encoder = StreamEncoder(model=_served_model(service, trace), include_usage=include_usage)
        response = _SSEResponse(
            _sse_body(service, iterator, pending, finished, encoder, trace, started),
            iterator,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **service.route_headers(trace.route, trace)},
        )
        handed_over = True
        return response
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed before output: %s", route, service.redact(str(error)))
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        service.metrics.observe_trace(trace)
        service.metrics.observe_request(
            "chat_completions", route, error.status, time.perf_counter() - started
        )
        return _error_response(error, service.route_headers(trace.route, trace))
    finally:
        if not handed_over:
            with anyio.CancelScope(shield=True):
                await close_iterator(iterator)
