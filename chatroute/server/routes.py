"""The service's routes: health, metrics, models, route, classify and chat completions."""

from __future__ import annotations

import time
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from chatroute.chat.types import ChatMessage
from chatroute.server.chat import chat_completions
from chatroute.server.embeddings import (
    EMBEDDINGS_PATH,
    embedding_model_card,
    install_embeddings,
)
from chatroute.server.errors import APIError
from chatroute.server.handlers import add_direct_route
from chatroute.server.metrics import PROMETHEUS_CONTENT_TYPE, ServiceMetrics
from chatroute.server.request_log import note_inputs
from chatroute.server.service import (
    AUTO_MODEL,
    CHAT_PATH,
    Service,
    check_length,
    check_messages,
    decide,
    ready_service,
    routing_failure,
)
from chatroute.server.wire import (
    ClassifyRequest,
    ConversationInput,
    RouteRequest,
    to_chat_messages,
)

__all__ = ["install_routes"]


def install_routes(app: FastAPI) -> None:
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
        """The routes, as models; `auto` routes semantically."""
        service = ready_service(request)
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

    install_embeddings(app, ready=ready_service, list_models=models)

    @app.post("/v1/route", tags=["routing"])
    async def route(body: RouteRequest, request: Request) -> JSONResponse:
        """The route a text or conversation would take (no provider is called)."""
        service = ready_service(request)
        started = time.perf_counter()
        engine = service.engine
        if body.messages is not None:
            check_messages(service, body.messages)
            messages = to_chat_messages(body.messages)
        else:
            check_length(service, len(body.input or ""), "input")
            messages = [ChatMessage("user", body.input or "")]
        decision = await decide(service, messages, "route")
        result = engine.describe(decision, matches=True)
        service.metrics.observe_request(
            "route", result["route"], 200, time.perf_counter() - started
        )
        return JSONResponse(result)

    @app.post("/v1/classify", tags=["routing"])
    async def classify(body: ClassifyRequest, request: Request) -> JSONResponse:
        """One decision per input, computed as one batch."""
        service = ready_service(request)
        started = time.perf_counter()
        limit = service.config.server.max_classify_inputs
        if len(body.inputs) > limit:
            raise APIError(
                400, f"inputs: at most {limit} inputs per request", param="inputs", code="too_many"
            )
        texts: list[str] = []
        conversations: list[list[ChatMessage]] = []
        for position, item in enumerate(body.inputs):
            if isinstance(item, ConversationInput):
                prefix = f"inputs[{position}].messages"
                check_messages(service, item.messages)
                conversations.append(to_chat_messages(item.messages, prefix=prefix))
            else:
                check_length(service, len(item), f"inputs[{position}]")
                texts.append(item)
                conversations.append([ChatMessage("user", item)])
        engine = service.engine
        try:  # one batch: texts alone, or every input as a conversation (its last turn)
            if len(texts) == len(conversations):
                decisions = await engine.decide_batch(texts)
            else:
                decisions = await engine.decide_conversations(conversations)
        except Exception as exc:
            raise routing_failure(service, exc)
        data = [{"index": i, **engine.describe(d)} for i, d in enumerate(decisions)]
        service.metrics.observe_decisions("classify", [(d["route"], d["is_default"]) for d in data])
        note_inputs(len(conversations))
        service.metrics.classify_batch_size.observe(len(conversations))
        service.metrics.observe_request("classify", "", 200, time.perf_counter() - started)
        return JSONResponse({"object": "list", "data": data})

    add_direct_route(app, CHAT_PATH, chat_completions, CHAT_REQUEST_SCHEMA)


def hot_paths_first(app: FastAPI) -> None:
    """Put the chat, routing and embeddings paths first in the app's routes: a request is
    matched against the routes in order, and these take nearly all the traffic (FastAPI's
    docs routes come first otherwise, about 50 µs of matching per chat request). No two
    of the service's paths overlap, so the order changes no answer."""
    hot = {CHAT_PATH: 0, "/v1/route": 1, "/v1/classify": 2, EMBEDDINGS_PATH: 3}
    app.router.routes.sort(key=lambda route: hot.get(getattr(route, "path", ""), len(hot)))


CHAT_REQUEST_SCHEMA: Final = "#/components/schemas/ChatCompletionRequest"
"""Where the OpenAPI document holds the chat request's schema (added by `ChatrouteApp`)."""
