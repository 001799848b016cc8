"""The FastAPI app: OpenAI-compatible chat completions, route/classify APIs, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from chatroute import __version__
from chatroute._timer import timeout_at
from chatroute.chat.client import ChatClient
from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponseUpdate
from chatroute.config import ChatrouteConfig
from chatroute.router.base import close_iterator
from chatroute.router.decision import RouteDecision
from chatroute.server.embeddings import embedding_model_card, install_embeddings
from chatroute.server.engine import Engine, build_engine
from chatroute.server.errors import APIError, Redactor, error_from_exception
from chatroute.server.guard import Admission, Admitted, NotJSON, RequestGuard
from chatroute.server.metrics import PROMETHEUS_CONTENT_TYPE, ServiceMetrics
from chatroute.server.protocol import connection_of
from chatroute.server.tracing import RequestTrace, TraceSink, end_trace, start_trace
from chatroute.server.wire import (
    ChatCall,
    ChatCompletionRequest,
    ClassifyRequest,
    ConversationInput,
    RouteRequest,
    StreamEncoder,
    WireMessage,
    chat_call,
    completion_body,
    has_content,
    plain_chat_call,
    query_text,
    to_chat_messages,
)

__all__ = ["ChatrouteApp", "Service", "create_app"]

if TYPE_CHECKING:
    from chatroute.server.shared import SharedBreakerState

logger = logging.getLogger("chatroute.server")

AUTO_MODEL = "auto"
CHAT_PATH = "/v1/chat/completions"
ROUTE_HEADER = "x-chatroute-route"
PROVIDER_HEADER = "x-chatroute-provider"
ATTEMPTS_HEADER = "x-chatroute-attempts"
TIMEOUT_HEADER = "x-chatroute-timeout"
IGNORED_HEADER = "x-chatroute-ignored-params"
_TIMEOUT_HEADER_KEY = TIMEOUT_HEADER.encode("latin-1")
CLIENT_CLOSED = 499  # the status logged for a request whose caller left (nginx's convention)

T = TypeVar("T")


@dataclass(eq=False)
class Service:
    """What the endpoints run on: the engine, the metrics and the request limits."""

    engine: Engine
    metrics: ServiceMetrics
    redact: Redactor
    ready: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    trace_sink: TraceSink | None = None

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
        self.metrics.observe_trace(trace)
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


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 for pydantic's validation errors of a request body (FastAPI's `loc` starts
    with "body"; a model validated directly has no such prefix)."""
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
        # The endpoints check readiness themselves, once the body is validated; a body that
        # parsed as JSON but does not validate still gets the not-ready answer first.
        if not isinstance(exc.__cause__, json.JSONDecodeError) and request.scope.get(
            "path", ""
        ).startswith("/v1/"):
            try:
                _ready_service(request)
            except APIError as not_ready:
                return _error_response(not_ready)
        return _error_response(_validation_error(exc.errors()))

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


class _CallerGone(Exception):
    """The HTTP client disconnected while its request was being answered."""


class _DeadlineHit(Exception):
    """The request's overall deadline expired on the caller's side."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request deadline of {seconds:g} s was exceeded")
        self.seconds = seconds


@dataclass(frozen=True)
class _Deadline:
    """When the request must be over (event-loop time) and the budget it came from."""

    at: float
    seconds: float


def _bounded(awaitable: Awaitable[T], deadline: _Deadline | None) -> Awaitable[T]:
    """`awaitable` under the request deadline: its expiry cancels the call and raises
    _DeadlineHit. Without a deadline, `awaitable` itself (no coroutine level around it).

    The expiry works by cancelling the task, so the failover router treats it as the
    caller cancelling: the running attempt is terminal, no new attempt starts, and the
    provider's health is not charged.
    """
    if deadline is None:
        return awaitable
    return _under_deadline(awaitable, deadline)


async def _under_deadline(awaitable: Awaitable[T], deadline: _Deadline) -> T:
    timer = timeout_at(deadline.at)
    try:
        async with timer:
            return await awaitable
    except TimeoutError as exc:
        if timer.expired():
            raise _DeadlineHit(deadline.seconds) from exc
        raise


class _DisconnectWatch:
    """Cancels the current task when the caller disconnects, or when its connection can no
    longer be read (`failure` then holds why).

    On chatroute's `HttpProtocol` the connection itself calls back when it is lost; under
    other servers one task awaits `receive()` for the disconnect message.

    Like `asyncio.timeout`, the watch's cancel() is matched by an uncancel() (in `caused`
    or `settle`), so a cancellation from elsewhere still propagates as what it is.
    A callback given to `on_disconnect` runs when the caller disconnects (at once, when
    it already has).
    """

    def __init__(self, scope: Scope, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self.gone = False
        self.failure: Exception | None = None
        self._on_disconnect: Callable[[], None] | None = None
        self._disconnected = False
        self._watcher: asyncio.Task[None] | None = None
        self._connection = connection_of(scope)
        if self._connection is None:
            self._watcher = task.get_loop().create_task(self._watch(receive))
        elif not self._connection.watch_disconnect(self._left):
            self._connection = None
            self._left()  # already gone: the work stops at its first wait

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:
            self.failure = exc
            self.gone = True
            self._task.cancel()
        else:
            self._left()

    def _left(self) -> None:
        self._disconnected = True
        if self._on_disconnect is not None:
            self._on_disconnect()
        self.gone = True
        self._task.cancel()

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the caller disconnects; now, if it already did."""
        self._on_disconnect = callback
        if self._disconnected:
            callback()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._connection is not None:
            self._connection.unwatch_disconnect(self._left)
            self._connection = None

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc`, raised in the watched task, is the caller going away (and not also a
        cancellation from elsewhere); consumes the watch's cancellation when it was."""
        if not self.gone:
            return False
        return not (
            self._task.uncancel() > self._cancelling and isinstance(exc, asyncio.CancelledError)
        )

    def settle(self) -> bool:
        """After the work ended normally: whether the caller went away meanwhile (the work
        swallowed the cancellation, which is consumed here)."""
        if self.gone:
            self._task.uncancel()
        return self.gone


async def _watched(
    scope: Scope, receive: Receive, work: Awaitable[T], watch: _DisconnectWatch | None = None
) -> T:
    """Run `work` in the calling task while watching the connection; a disconnect (or a
    connection that cannot be read) cancels it and raises _CallerGone, once the cancelled
    work has finished unwinding (its upstream request closed).

    Without `watch`, one is made for the work and stopped after it; a `watch` given is used
    and left running (a stream hands it over to its response).
    """
    own = watch is None
    if watch is None:
        watch = _DisconnectWatch(scope, receive)
    try:
        try:
            result = await work
        except (Exception, asyncio.CancelledError) as exc:
            if watch.caused(exc):
                raise _CallerGone from None
            raise
        if watch.settle():
            raise _CallerGone
        return result
    finally:
        if own:
            watch.stop()


def _raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """ASGI header pairs (lower-case names), as Starlette's Response encodes them."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


class _SSEResponse(Response):
    """An event stream sent from the request's own task (no task group per stream).

    The watch that guarded the wait for the first update (`watch`, one task for the whole
    request) goes on cancelling the sending when the caller disconnects before the last
    message was sent, and marks the trace. The body and the routed stream behind it are
    always closed, however sending ends (even when the body never started).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        routed: Any,
        trace: RequestTrace,
        unsent: Callable[[], None],
        headers: Mapping[str, str],
        watch: _DisconnectWatch,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.body_iterator = content
        self._routed = routed
        self._trace = trace
        self._unsent = unsent  # records the request when the body never got to run
        self._sent = False
        self._watch = watch
        # What Response.init_headers would set (no content-length: the body is streamed).
        self.raw_headers = [
            *_raw_headers(headers),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace = self._trace

        def caller_left() -> None:
            # The server also says "disconnect" once the response is complete: not a
            # caller leaving.
            if not self._sent and trace.cancelled is None:
                trace.cancelled = "disconnect"

        watch = self._watch
        watch.on_disconnect(caller_left)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._sent = True  # before the server can report the completed response
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError as exc:
            if not watch.caused(exc):
                raise
            if watch.failure is not None:
                raise watch.failure from None
        except OSError:
            if trace.cancelled is None:
                trace.cancelled = "disconnect"
            raise
        else:
            watch.settle()  # the watch's cancellation may have been swallowed on the way
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):
                await close_iterator(self.body_iterator)
                await close_iterator(self._routed)
            if trace.status is None:
                self._unsent()


class _RecordedResponse(Response):
    """A JSON answer that records its request once sent: the recording (metrics, trace
    sink, log) runs after the last byte, off the caller's latency, and runs exactly once
    however sending ends."""

    media_type = "application/json"

    def __init__(self, body: bytes, headers: Mapping[str, str], record: Callable[[], None]) -> None:
        # What Response.__init__ would set, without its generic header merging.
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", str(len(body)).encode("latin-1")),
            (b"content-type", b"application/json"),
            *_raw_headers(headers),
        ]
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            self._record()


async def _sse_body(
    service: Service,
    iterator: AsyncIterator[ChatResponseUpdate],
    pending: list[ChatResponseUpdate],
    finished: bool,
    encoder: StreamEncoder,
    trace: RequestTrace,
    started: float,
    deadline: _Deadline | None,
) -> AsyncIterator[bytes]:
    status = 200
    route = trace.route or ""
    try:
        for update in pending:
            chunk = encoder.encode(update)
            if chunk:
                trace.committed = True
                yield chunk
        if not finished:
            while True:
                try:
                    update = await _bounded(anext(iterator), deadline)
                except StopAsyncIteration:
                    break
                chunk = encoder.encode(update)
                if chunk:
                    trace.committed = True
                    yield chunk
        yield encoder.finish()
    except _DeadlineHit as exc:  # after commit: in-band error, and no [DONE]
        trace.cancelled = "deadline"
        status = 504
        yield _deadline_error(exc.seconds).sse_event()
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
        if trace.cancelled == "disconnect":
            status = CLIENT_CLOSED
        service.finish(trace, status, started)


def _deadline_error(seconds: float) -> APIError:
    return APIError(
        504,
        f"the request deadline of {seconds:g} s was exceeded",
        type="timeout_error",
        code="deadline_exceeded",
    )


# -------------------------------------------------------------------------------- app


def _ready_service(request: Request) -> Service:
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


def create_app(
    source: ChatrouteConfig | Engine,
    *,
    api_keys: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    embedder: EmbeddingGenerator | None = None,
    trace_sink: TraceSink | None = None,
) -> FastAPI:
    """The service app for a config (built at start-up, owned by the app) or an engine
    (owned by you; build it on the event loop that serves the app).

    Start-up loads the model and builds the profile index before `/readyz` turns ready;
    shutdown closes what the app built. `api_keys` defaults to the comma-separated keys in
    the environment variable the config names (`CHATROUTE_API_KEYS`); with no keys,
    `/v1/*` is open. `environ` replaces `os.environ`; `embedder` replaces the configured
    embedding generator of a config. `trace_sink`, when given, is called with the
    `RequestTrace` of every finished chat request (its route, attempts, status and
    whether the caller cut it short); it runs on the event loop and must not block.
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
        service = Service(engine=engine, metrics=metrics, redact=redact, trace_sink=trace_sink)
        detach = _attach_embedder_metrics(engine, metrics)
        unwatch = metrics.watch_breakers(engine.breakers)
        thresholds = gc.get_threshold()
        shared: SharedBreakerState | None = None
        try:
            redis_url = config.shared_state.redis_url(env)
            if redis_url is not None:
                from chatroute.server.shared import SharedBreakerState

                shared = SharedBreakerState(
                    engine.breakers,
                    redis_url,
                    prefix=config.shared_state.key_prefix,
                    on_connected=lambda up: metrics.shared_state_up.set(1 if up else 0),
                    on_event=lambda direction: metrics.shared_breaker_events.labels(
                        direction
                    ).inc(),
                )
                await shared.start()
                logger.info(
                    "breaker state shared through Redis (%s)",
                    "connected" if shared.connected else "unreachable, retrying",
                )
            elif config.shared_state.redis_url_env is not None:
                logger.info(
                    "%s is not set: breaker state is not shared with other replicas",
                    config.shared_state.redis_url_env,
                )
            await engine.warm()
            if config.server.gc_threshold is not None:
                # A proxied call allocates a few hundred objects, nearly all freed by
                # reference counting; collecting every 700 allocations costs latency.
                gc.set_threshold(config.server.gc_threshold, *thresholds[1:])
            if config.server.gc_freeze:
                # The model, tokenizer and index are hundreds of thousands of long-lived
                # objects: a full collection that scans them stalls the event loop for
                # hundreds of ms. Freeze them out of future collections once, at start-up.
                gc.collect()
                gc.freeze()
            service.ready = True
            metrics.ready.set(1)
            app.state.service = service
            endpoint = getattr(app, "chat_endpoint", None)
            if isinstance(endpoint, _ChatEndpoint):
                endpoint.service = service
            logger.info(
                "chatroute ready: %d routes, %d providers",
                len(engine.routes),
                len(engine.providers),
            )
            yield
        finally:
            service.ready = False
            metrics.ready.set(0)
            gc.set_threshold(*thresholds)
            if shared is not None:
                await shared.aclose()
                metrics.shared_state_up.set(0)
            detach()
            unwatch()
            if owned:
                await engine.aclose()

    app = ChatrouteApp(
        title="chatroute",
        summary="Semantic routing and failover gateway for OpenAI-compatible chat APIs",
        version=__version__,
        lifespan=lifespan,
    )
    app.state.service = None
    app.state.metrics = metrics
    _install_error_handlers(app)
    _install_routes(app)
    admission = Admission(
        api_keys=keys,
        max_body_bytes=config.server.max_body_bytes,
        max_json_depth=config.server.max_json_depth,
        body_timeout=config.server.body_timeout,
    )
    app.add_middleware(RequestGuard, admission=admission)
    app.chat_endpoint = _ChatEndpoint(admission)
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
    async def models(request: Request) -> dict[str, Any]:
        """The routes, as models (`auto` routes semantically), and the embedding model."""
        service = _ready_service(request)
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
        data.append(embedding_model_card(service))
        return {"object": "list", "data": data}

    install_embeddings(app, ready=_ready_service, list_models=models)

    @app.post("/v1/route", tags=["routing"])
    async def route(body: RouteRequest, request: Request) -> JSONResponse:
        """The route a text or conversation would take (no provider is called)."""
        service = _ready_service(request)
        started = time.perf_counter()
        engine = service.engine
        if body.messages is not None:
            _check_messages(service, body.messages)
            messages = to_chat_messages(body.messages)
        else:
            _check_length(service, len(body.input or ""), "input")
            messages = [ChatMessage("user", body.input or "")]
        decision = await _decide(service, messages)
        result = engine.describe(decision, matches=True)
        service.metrics.observe_request(
            "route", result["route"], 200, time.perf_counter() - started
        )
        return JSONResponse(result)

    @app.post("/v1/classify", tags=["routing"])
    async def classify(body: ClassifyRequest, request: Request) -> JSONResponse:
        """One decision per input, computed as one batch."""
        service = _ready_service(request)
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
                _check_messages(service, item.messages)
                queries.append(query_text(to_chat_messages(item.messages, prefix=prefix)))
            else:
                _check_length(service, len(item), f"inputs[{position}]")
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

    @app.post(CHAT_PATH, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions, routed by content (`model: auto`) or to a named route.

        Unknown top-level fields are ignored (and named in `x-chatroute-ignored-params`).
        `x-chatroute-timeout: <seconds>` shortens the request's deadline.
        """
        # Served by `_ChatEndpoint` in front of FastAPI (see ChatrouteApp); this route
        # documents the endpoint and serves it where that dispatch is off.
        return await _chat_completion(_ready_service(request), request.scope, request.receive, body)


async def _chat_completion(
    service: Service, scope: Scope, receive: Receive, request: ChatCompletionRequest | ChatCall
) -> Response:
    """Answer a validated chat-completions request (routing, failover, the commit rule)."""
    started = time.perf_counter()
    arrived = asyncio.get_running_loop().time()
    if isinstance(request, ChatCall):  # a plain request, read with its limits checked
        call = request
        caller_timeout = _caller_timeout(service, scope)
    else:
        _check_messages(service, request.messages)
        caller_timeout = _caller_timeout(service, scope)
        call = chat_call(request)
    messages = call.messages
    options = call.options
    named = _named_route(service, call.model)
    if named is not None:  # a route named as the model: no routing to wait for
        route_name, client = named
    else:
        decision = await _decide(service, messages)
        route_name, client = service.engine.route_name(decision.client), decision.client
    trace = start_trace(route_name)
    trace.stream = call.stream
    deadline = _deadline_for(service, route_name, caller_timeout, arrived)
    extra = {}
    ignored = call.ignored
    if ignored:
        logger.debug("ignoring unknown request fields: %s", ", ".join(ignored))
        extra[IGNORED_HEADER] = _header_list(ignored)
    if call.stream:
        return await _stream(
            service,
            scope,
            receive,
            client,
            messages,
            options,
            trace,
            started,
            call.include_usage,
            deadline,
            extra,
        )
    return await _complete(
        service, scope, receive, client, messages, options, trace, started, deadline, extra
    )


def _is_json_type(scope: Scope) -> bool:
    """Whether the request says its body is JSON (`application/json` or `application/*+json`),
    as FastAPI decides it; no content type is not JSON (FastAPI's strict default)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return False


class _ChatEndpoint:
    """`POST /v1/chat/completions` as a plain ASGI endpoint: the hot path of a proxied call.

    It answers exactly as the FastAPI route would (the same admission checks, errors,
    validation model and handler) but skips FastAPI's per-request machinery: the
    middleware stack, the second body read and JSON parse, and the dependency solve. On
    this stack that machinery cost more than routing and failover together.
    """

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        # The running service (set at start-up), read without going through app.state.
        self.service: Service | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self.admission
        if not admission.authorised(scope) and await admission.refuse_unauthorised(scope, send):
            return
        admitted = await admission.admit_body(scope, receive, send)
        if admitted is None:
            return
        try:
            service, body = self._validated(scope, receive, admitted)
            response = await _chat_completion(service, scope, receive, body)
        except APIError as error:
            response = _error_response(error)
        except Exception as exc:
            logger.error("unhandled %s on %s", type(exc).__name__, CHAT_PATH)
            response = _error_response(
                APIError(500, "internal error", type="server_error", code="internal_error")
            )
        await response(scope, receive, send)

    def _validated(
        self, scope: Scope, receive: Receive, admitted: Admitted
    ) -> tuple[Service, ChatCompletionRequest | ChatCall]:
        """The ready service and the validated request, or the APIError to answer.

        Not a coroutine: every await level is resumed again each time the request's task
        wakes.
        """
        # What FastAPI would validate: the parsed JSON of a JSON body, else the raw bytes.
        is_json = _is_json_type(scope)
        payload = admitted.data if is_json else admitted.body
        if isinstance(payload, NotJSON):
            error = payload.error
            if isinstance(error, json.JSONDecodeError):
                raise _validation_error(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ("body", error.pos),
                            "ctx": {"error": error.msg},
                        }
                    ]
                )
            raise APIError(400, "the request body could not be parsed", code="invalid_body")
        service = self.service
        if service is None or not service.ready:
            service = _ready_service(Request(scope, receive))  # app.state's, else the 503
        if not admitted.body:
            raise _validation_error([{"type": "missing", "loc": ("body",)}])
        limits = service.config.server
        call = plain_chat_call(
            payload, max_messages=limits.max_messages, max_chars=limits.max_message_chars
        )
        if call is not None:  # the common plain request: no model to build and convert
            return service, call
        try:
            # What model_validate runs, without its wrapper.
            body: ChatCompletionRequest = _VALIDATE_CHAT(payload)
        except pydantic.ValidationError as exc:
            raise _validation_error(exc.errors()) from None
        return service, body


_VALIDATE_CHAT = ChatCompletionRequest.__pydantic_validator__.validate_python


class ChatrouteApp(FastAPI):
    """The service's FastAPI app, with chat completions answered in front of FastAPI's
    per-request machinery (`_ChatEndpoint`); every other path is plain FastAPI.

    Set `fast_chat = False` to serve chat completions through the FastAPI route instead
    (the same answers, more CPU per call).
    """

    fast_chat: bool = True
    chat_endpoint: _ChatEndpoint | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.chat_endpoint
        if (
            endpoint is not None
            and self.fast_chat
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and _route_path(scope) == CHAT_PATH
        ):
            scope["app"] = self
            await endpoint(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The request path below the app's mount point."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :]
    return path


def _header_list(names: Sequence[str], limit: int = 512) -> str:
    """A comma-separated header value of printable names, cut to `limit` characters."""
    clean = [n for n in names if n.isascii() and n.isprintable() and "," not in n]
    text = ",".join(clean)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _caller_timeout(service: Service, scope: Scope) -> float | None:
    if not service.config.resilience.caller_deadline:
        return None
    # The raw header list, as `request.headers.get` reads it, without building `Headers`.
    raw = None
    for name, value in scope["headers"]:
        if name == _TIMEOUT_HEADER_KEY:
            raw = value.decode("latin-1")
            break
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise APIError(
            400,
            f"{TIMEOUT_HEADER} must be a positive number of seconds",
            param=TIMEOUT_HEADER,
            code="invalid_header",
        )
    return seconds


def _deadline_for(
    service: Service, route: str, caller: float | None, arrived: float
) -> _Deadline | None:
    policy = service.engine.resilience.get(route)
    seconds = policy.deadline if policy is not None else None
    if caller is not None and (seconds is None or caller < seconds):
        seconds = caller
    if seconds is None:
        return None
    return _Deadline(arrived + seconds, seconds)


def _check_messages(service: Service, messages: Sequence[WireMessage]) -> None:
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
            _check_length(service, size, f"messages[{position}].content")


def _check_length(service: Service, size: int, param: str) -> None:
    limit = service.config.server.max_message_chars
    if size > limit:
        raise APIError(
            400,
            f"{param}: at most {limit} characters per message, got {size}",
            param=param,
            code="message_too_long",
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
    metrics = service.metrics
    default = "true" if decision.is_default else "false"
    metrics.labelled(metrics.route_decisions, name, default).inc()
    return decision


def _named_route(service: Service, model: str | None) -> tuple[str, ChatClient] | None:
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


def _headers(
    service: Service, trace: RequestTrace, extra_headers: Mapping[str, str]
) -> dict[str, str]:
    headers = service.route_headers(trace.route, trace)
    headers.update(extra_headers)
    return headers


def _served_model(service: Service, trace: RequestTrace) -> str:
    provider = trace.provider
    if provider is None:
        return trace.route or AUTO_MODEL
    return service.engine.provider_models.get(provider, provider)


async def _complete(
    service: Service,
    scope: Scope,
    receive: Receive,
    client: ChatClient,
    messages: list[ChatMessage],
    options: ChatOptions,
    trace: RequestTrace,
    started: float,
    deadline: _Deadline | None,
    extra_headers: Mapping[str, str],
) -> Response:
    route = trace.route or ""
    try:
        response = await _watched(
            scope,
            receive,
            _bounded(client.get_response(messages, options), deadline),
        )
    except _CallerGone:
        trace.cancelled = "disconnect"
        service.finish(trace, CLIENT_CLOSED, started)
        return Response(status_code=CLIENT_CLOSED)  # nobody is listening any more
    except _DeadlineHit as exc:
        trace.cancelled = "deadline"
        error = _deadline_error(exc.seconds)
        service.finish(trace, error.status, started)
        return _error_response(error, _headers(service, trace, extra_headers))
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed: %s", route, service.redact(str(error)))
        service.finish(trace, error.status, started)
        return _error_response(error, _headers(service, trace, extra_headers))
    body = completion_body(response, model=_served_model(service, trace))
    trace.committed = True
    return _RecordedResponse(
        body,
        _headers(service, trace, extra_headers),
        lambda: service.finish(trace, 200, started),
    )


async def _first_content(
    iterator: AsyncIterator[ChatResponseUpdate],
) -> tuple[list[ChatResponseUpdate], bool]:
    """Pull updates up to the first one that carries output (the commit point).

    Returns the updates pulled and whether the stream already ended.
    """
    pending: list[ChatResponseUpdate] = []
    while True:
        try:
            update = await anext(iterator)
        except StopAsyncIteration:
            return pending, True
        pending.append(update)
        if has_content(update):
            return pending, False


async def _stream(
    service: Service,
    scope: Scope,
    receive: Receive,
    client: ChatClient,
    messages: list[ChatMessage],
    options: ChatOptions,
    trace: RequestTrace,
    started: float,
    include_usage: bool,
    deadline: _Deadline | None,
    extra_headers: Mapping[str, str],
) -> Response:
    route = trace.route or ""
    iterator = aiter(client.get_streaming_response(messages, options))
    handed_over = False
    watch = _DisconnectWatch(scope, receive)  # handed over with the stream
    kept = False  # whether the response took the watch over
    try:
        # The commit point: nothing is sent until the first update that carries output.
        # Until then a disconnect or the deadline cancels the routed call directly.
        try:
            pending, finished = await _watched(
                scope, receive, _bounded(_first_content(iterator), deadline), watch
            )
        except BaseException:
            watch.stop()
            raise
        encoder = StreamEncoder(model=_served_model(service, trace), include_usage=include_usage)

        def unsent() -> None:
            # The caller left before the body started: nothing was sent.
            if trace.cancelled is None:
                trace.cancelled = "disconnect"
            service.finish(trace, CLIENT_CLOSED, started)

        response = _SSEResponse(
            _sse_body(service, iterator, pending, finished, encoder, trace, started, deadline),
            iterator,
            trace,
            unsent,
            {
                "cache-control": "no-cache",
                **service.route_headers(trace.route, trace),
                **extra_headers,
            },
            watch,
        )
        handed_over = kept = True
        return response
    except _CallerGone:
        trace.cancelled = "disconnect"
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        service.finish(trace, CLIENT_CLOSED, started)
        return Response(status_code=CLIENT_CLOSED)
    except _DeadlineHit as exc:
        trace.cancelled = "deadline"
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        error = _deadline_error(exc.seconds)
        service.finish(trace, error.status, started)
        return _error_response(error, _headers(service, trace, extra_headers))
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed before output: %s", route, service.redact(str(error)))
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        service.finish(trace, error.status, started)
        return _error_response(error, _headers(service, trace, extra_headers))
    finally:
        if not kept:
            watch.stop()
        if not handed_over:
            with anyio.CancelScope(shield=True):
                await close_iterator(iterator)
