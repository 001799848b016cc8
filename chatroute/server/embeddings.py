"""`POST /v1/embeddings` (OpenAI's wire format) on the local embedder, and `GET /v1/models/{id}`."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import numpy.typing as npt
import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictInt

from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.embedder.errors import EmbedderClosedError, EmbedderOverloadedError
from chatroute.server.errors import APIError
from chatroute.server.guard import PARSED_BODY, is_json, parse_json
from chatroute.server.handlers import add_direct_route, validation_error

if TYPE_CHECKING:
    from chatroute.server.app import Service

__all__ = [
    "EMBEDDINGS_PATH",
    "EMBEDDINGS_REQUEST_SCHEMA",
    "EmbeddingsRequest",
    "embedder_dimension",
    "embedder_name",
    "embedding_model_card",
    "install_embeddings",
]

logger = logging.getLogger("chatroute.server")

EMBEDDINGS_PATH = "/v1/embeddings"
EMBEDDINGS_REQUEST_SCHEMA: Final = "#/components/schemas/EmbeddingsRequest"
"""Where the OpenAPI document holds the request's schema (added by `ChatrouteApp`)."""
_IGNORED_HEADER = "x-chatroute-ignored-params"
_UNREAD: Final = object()


class EmbeddingsRequest(BaseModel):
    """The body of `POST /v1/embeddings`. `input` is checked by hand (token arrays get
    their own message); unknown fields are ignored and named in a response header."""

    model_config = ConfigDict(extra="allow")

    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None


def embedder_name(service: Service) -> str:
    """The model id the embeddings API answers to: the embedder's own name (e.g.
    'sentence-transformers/all-MiniLM-L6-v2'), else the configured `embedder.model`."""
    name = getattr(service.engine.embedder, "model", None)
    return name if isinstance(name, str) and name else service.config.embedder.model


def embedder_dimension(embedder: EmbeddingGenerator) -> int | None:
    """The length of the embedder's vectors, when it says."""
    fingerprint = embedder.fingerprint
    if fingerprint is not None:
        return fingerprint.dimension
    dimension = getattr(embedder, "dimension", None)
    return dimension if isinstance(dimension, int) else None


def embedding_model_card(service: Service) -> dict[str, Any]:
    """The embedder as an entry of `/v1/models`."""
    card: dict[str, Any] = {
        "id": embedder_name(service),
        "object": "model",
        "created": service.started_at,
        "owned_by": "chatroute",
        "type": "embedding",
    }
    dimension = embedder_dimension(service.engine.embedder)
    if dimension is not None:
        card["dimensions"] = dimension
    return card


def _texts(value: Any) -> list[str]:
    """The texts of an `input`: a string or a non-empty list of strings; token arrays and
    anything else are a 400 naming what is wrong."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _invalid("input", "must be a string or a list of strings")
    if not value:
        raise _invalid("input", "must not be an empty list")
    if all(isinstance(item, str) for item in value):
        return value
    if _token_ids(value) or all(isinstance(item, list) and _token_ids(item) for item in value):
        raise APIError(
            400,
            "input: token arrays are not supported; send the text itself "
            "(a string or a list of strings), the server tokenises it",
            param="input",
            code="unsupported_input",
        )
    for position, item in enumerate(value):
        if not isinstance(item, str):
            raise _invalid(f"input[{position}]", "must be a string")
    raise AssertionError("unreachable")  # pragma: no cover


def _token_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _check_limits(service: Service, texts: Sequence[str]) -> None:
    limits = service.config.server
    if len(texts) > limits.max_classify_inputs:
        raise APIError(
            400,
            f"input: at most {limits.max_classify_inputs} inputs per request, got {len(texts)}",
            param="input",
            code="too_many",
        )
    limit = limits.max_message_chars
    for position, text in enumerate(texts):
        if len(text) > limit:
            param = f"input[{position}]"
            raise APIError(
                400,
                f"{param}: at most {limit} characters per input, got {len(text)}",
                param=param,
                code="message_too_long",
            )


def _check_model(service: Service, model: str | None) -> str:
    name = embedder_name(service)
    if not model or model in (name, service.config.embedder.model):
        return name
    shown = model if len(model) <= 80 else model[:77] + "..."
    raise APIError(
        404,
        f"The model '{shown}' does not exist or is not an embedding model: use {name}",
        param="model",
        code="model_not_found",
    )


def _check_dimensions(requested: int | None, dimension: int, model: str) -> None:
    if requested is not None and requested != dimension:
        raise APIError(
            400,
            f"dimensions: {model} makes vectors of {dimension} dimensions and cannot "
            f"shorten them; leave dimensions out or send {dimension}",
            param="dimensions",
            code="unsupported_value",
        )


async def _embed(embedder: EmbeddingGenerator, texts: list[str]) -> tuple[npt.NDArray[Any], int]:
    """The vectors and the tokens read (0 from a generator that does not count them)."""
    counted = getattr(embedder, "generate_with_usage", None)
    try:
        if callable(counted):
            vectors, tokens = await counted(texts)
            return vectors, int(tokens)
        return await embedder.generate(texts), 0
    except EmbedderOverloadedError:
        raise APIError(
            503,
            "the embedder is overloaded, retry shortly",
            type="overloaded_error",
            code="overloaded",
            headers={"retry-after": "1"},
        ) from None
    except EmbedderClosedError:
        raise APIError(
            503,
            "the embedder is shutting down",
            type="server_error",
            code="not_ready",
            headers={"retry-after": "1"},
        ) from None
    except APIError:
        raise
    except Exception as exc:
        logger.error("embedding failed: %s", type(exc).__name__)
        raise APIError(
            500, "embedding failed", type="server_error", code="embedding_failed"
        ) from None


async def _request(request: Request, service: Service) -> EmbeddingsRequest:
    """The validated body: the JSON the admission guard parsed (once, with orjson), read
    and parsed here only when no guard ran or the content type is not JSON (then the
    bytes fail validation)."""
    payload: Any = request.scope.get(PARSED_BODY, _UNREAD)
    if payload is _UNREAD:
        payload = await request.body()
        if payload and is_json(request.scope):
            payload = parse_json(payload, service.config.server.max_json_depth)
    if payload == b"":
        raise validation_error([{"type": "missing", "loc": ("body",)}])
    try:
        return EmbeddingsRequest.model_validate(payload)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from None


def encode_body(vectors: npt.NDArray[Any], model: str, tokens: int, encoding_format: str) -> bytes:
    """The JSON answer: OpenAI's `list` of `embedding` objects, base64 as little-endian
    float32 bytes (what OpenAI sends), float as JSON numbers."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    data: list[dict[str, Any]]
    if encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row).decode()}
            for i, row in enumerate(rows)
        ]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def install_embeddings(
    app: FastAPI,
    *,
    ready: Callable[[Request], Service],
    list_models: Callable[[Request], Awaitable[dict[str, Any]]],
) -> None:
    """Add `POST /v1/embeddings` and `GET /v1/models/{model_id}` to `app`.

    `ready` returns the running service (or raises the not-ready APIError); `list_models`
    answers `GET /v1/models`, whose entries `GET /v1/models/{model_id}` looks up.
    """

    async def embeddings(request: Request) -> Response:
        """OpenAI embeddings from the local embedder (the one routing uses, same batches).

        `input`: a string or a list of strings (token arrays are refused);
        `encoding_format`: float or base64; `dimensions`: only the model's own.
        """
        service = ready(request)
        started = time.perf_counter()
        body = await _request(request, service)
        model = _check_model(service, body.model)
        texts = _texts(body.input)
        _check_limits(service, texts)
        embedder = service.engine.embedder
        dimension = embedder_dimension(embedder)
        if dimension is not None:
            _check_dimensions(body.dimensions, dimension, model)
        vectors, tokens = await _embed(embedder, texts)
        if dimension is None:  # a generator that does not say: its vectors do
            _check_dimensions(body.dimensions, int(vectors.shape[1]), model)
        headers = {}
        ignored = ",".join(
            name
            for name in body.model_extra or ()
            if name.isascii() and name.isprintable() and "," not in name
        )
        if ignored:
            headers[_IGNORED_HEADER] = ignored[:512]
        content = encode_body(vectors, model, tokens, body.encoding_format)
        service.metrics.observe_request("embeddings", "", 200, time.perf_counter() - started)
        return Response(content, media_type="application/json", headers=headers)

    # On the app itself, so that `hot_paths_first` can put this path first.
    add_direct_route(app, EMBEDDINGS_PATH, embeddings, EMBEDDINGS_REQUEST_SCHEMA)

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        """One entry of `/v1/models`; 404 for an id it does not list."""
        listing = await list_models(request)
        for card in listing["data"]:
            if card.get("id") == model_id:
                return dict(card)
        shown = model_id if len(model_id) <= 80 else model_id[:77] + "..."
        raise APIError(
            404, f"The model '{shown}' does not exist", param="model", code="model_not_found"
        )
