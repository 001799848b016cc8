"""The FastAPI app: its factory and lifespan (the engine, shared state, the GC settings)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from chatroute import __version__
from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.config import ChatrouteConfig
from chatroute.engine import Engine, build_engine
from chatroute.server.embeddings import EmbeddingsRequest
from chatroute.server.errors import Redactor
from chatroute.server.guard import Admission, RequestGuard
from chatroute.server.handlers import install_error_handlers
from chatroute.server.metrics import ServiceMetrics
from chatroute.server.observe import load_otel
from chatroute.server.reload import (
    Reloader,
    ReloadMiddleware,
    admin_key,
    install_reload,
    watch_sighup,
)
from chatroute.server.request_log import RequestLog
from chatroute.server.routes import hot_paths_first, install_routes
from chatroute.server.service import Service
from chatroute.server.startup import log_startup, scoring_of, startup_summary
from chatroute.server.wire import ChatCompletionRequest
from chatroute.tracing import TraceSink

__all__ = ["ChatrouteApp", "Service", "create_app"]

if TYPE_CHECKING:
    from chatroute.otel import OTelLayer
    from chatroute.server.shared import SharedBreakerState

logger = logging.getLogger("chatroute.server")


class ChatrouteApp(FastAPI):
    """The service's FastAPI app. The chat and embeddings routes validate their bodies
    themselves (the admission guard parsed them once), so their request schemas are added
    to the OpenAPI document here.
    `RequestLog` wraps everything: every answer carries an `x-request-id`."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is not None:
            return self.openapi_schema
        document = super().openapi()  # FastAPI keeps it as `openapi_schema`
        schema = ChatCompletionRequest.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(schema.pop("$defs", {}))
        schemas["ChatCompletionRequest"] = schema
        schemas["EmbeddingsRequest"] = EmbeddingsRequest.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
        return document

    def build_middleware_stack(self) -> ASGIApp:
        # Outside Starlette's own error middleware too: an unexpected 500 carries its
        # x-request-id and is logged with its status.
        return RequestLog(super().build_middleware_stack())


def create_app(
    source: ChatrouteConfig | Engine,
    *,
    api_keys: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    embedder: EmbeddingGenerator | None = None,
    trace_sink: TraceSink | None = None,
    config_path: str | os.PathLike[str] | None = None,
    tracer_provider: object | None = None,
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
    `config_path`, the file the config came from, turns on live reload (SIGHUP, and
    `POST /admin/reload` with the admin key). OpenTelemetry spans are recorded when the
    `OTEL_*` environment asks for them, or on `tracer_provider` when given.
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
    otel = load_otel(env, tracer_provider)
    if otel is not None:
        trace_sink = otel.chain_sink(trace_sink)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not isinstance(source, Engine)
        if isinstance(source, Engine):
            engine = source
        else:  # loading the model blocks: keep it off the event loop
            engine = await asyncio.to_thread(build_engine, source, embedder=embedder, environ=env)
        redact = Redactor([*keys, *engine.secrets])
        service = Service(engine=engine, metrics=metrics, redact=redact, trace_sink=trace_sink)
        wiring = _Wiring(engine, metrics, otel)
        service.on_decision = otel.on_decision if otel is not None else None
        reloader = None
        unhup = None
        if config_path is not None:
            reloader = Reloader(app, config_path, service, owned=owned, environ=env)
            reloader.on_swap = wiring.swap
            app.state.reloader = reloader
            unhup = watch_sighup(reloader)
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
            summary = startup_summary(
                engine, auth=bool(keys), shared_state=shared is not None, environ=env
            )
            metrics.set_scoring(summary["scoring"] or "", summary["training_seconds"])
            log_startup(summary)
            service.ready = True
            metrics.ready.set(1)
            app.state.service = service
            logger.info(
                "routing context %s; sticky sessions %s",
                config.routing.context,
                "off" if engine.sessions is None else type(engine.sessions).__name__,
            )
            yield
        finally:
            service.ready = False
            swapped_in: Service | None = app.state.service  # by a reload, if any
            if swapped_in is not None:
                swapped_in.ready = False
            metrics.ready.set(0)
            gc.set_threshold(*thresholds)
            if shared is not None:
                await shared.aclose()
                metrics.shared_state_up.set(0)
            wiring.undo()
            if unhup is not None:
                unhup()
            if reloader is not None:
                await reloader.aclose()
            elif owned:
                await engine.aclose()
            if otel is not None:
                otel.shutdown()

    app = ChatrouteApp(
        title="chatroute",
        summary="Semantic routing and failover gateway for OpenAI-compatible chat APIs",
        version=__version__,
        lifespan=lifespan,
        # The service's own tracing layer records its spans (OTEL_* above, or
        # `tracer_provider`); FastAPI's native telemetry would add a second server span
        # per request once a global provider is set, and asks the global providers
        # whether to on every request (about 5% of the event loop's time under load).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = None
    app.state.reloader = None
    app.state.metrics = metrics
    install_error_handlers(app)
    install_routes(app)
    admission = Admission(
        api_keys=keys,
        max_body_bytes=config.server.max_body_bytes,
        max_json_depth=config.server.max_json_depth,
        body_timeout=config.server.body_timeout,
    )
    app.add_middleware(RequestGuard, admission=admission)
    if config_path is not None:
        install_reload(app, admin_key(config, env))
        app.add_middleware(ReloadMiddleware, reloader=lambda: app.state.reloader)
    hot_paths_first(app)
    if otel is not None:
        from chatroute.otel import OTelMiddleware

        app.add_middleware(OTelMiddleware, layer=otel)
    cors = config.server.cors
    if cors is not None:  # outermost: preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, **cors.model_dump())
    return app


class _Wiring:
    """The engine's hooks into the metrics and the tracing layer, moved along by a reload."""

    def __init__(self, engine: Engine, metrics: ServiceMetrics, otel: OTelLayer | None) -> None:
        self.metrics = metrics
        self.otel = otel
        self._undo = self._wire(engine)

    def _wire(self, engine: Engine) -> Callable[[], None]:
        detach = _attach_embedder_metrics(engine, self.metrics)
        unwatch = self.metrics.watch_breakers(engine.breakers)
        if self.otel is not None:
            types = {name: p.type for name, p in engine.config.providers.items()}
            self.otel.describe_engine(types, engine.provider_models)

        def undo() -> None:
            detach()
            unwatch()

        return undo

    def swap(self, old: Service, new: Service) -> None:
        self._undo()
        self._undo = self._wire(new.engine)
        mode, seconds = scoring_of(new.engine)  # the new engine is warm: trained already
        self.metrics.set_scoring(mode or "", seconds)

    def undo(self) -> None:
        self._undo()


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
