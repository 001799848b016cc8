"""The app's exception handlers: each error a request meets, answered as an OpenAI-style error."""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatroute.server.errors import APIError
from chatroute.server.service import ready_service

__all__ = [
    "DirectRoute",
    "add_direct_route",
    "error_response",
    "install_error_handlers",
    "validation_error",
]

logger = logging.getLogger("chatroute.server")


class DirectRoute(APIRoute):
    """A route whose endpoint takes the `Request` alone and returns a `Response`: FastAPI
    documents it as any other (OpenAPI, tags, docstring), but calls it directly instead of
    through its request handler, whose per-request work (body and content-type checks,
    dependency solving, telemetry hooks) such an endpoint does not use: it reads the body
    the admission guard parsed and validates it itself. About 30 us of event-loop time a
    request on the hot paths (chat completions, embeddings)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint
        parameters = list(inspect.signature(endpoint).parameters.values())
        if (
            not inspect.iscoroutinefunction(endpoint)
            or len(parameters) != 1
            or self.dependencies
            or self.response_model is not None
        ):
            raise TypeError(
                f"DirectRoute needs an async endpoint taking only the request, without "
                f"dependencies or a response model: {self.path}"
            )
        return endpoint  # type: ignore[no-any-return]


def add_direct_route(
    app: FastAPI,
    path: str,
    endpoint: Callable[[Request], Coroutine[Any, Any, Response]],
    request_schema: str,
) -> None:
    """Register a POST `endpoint` on `DirectRoute`, on the app itself (not an included
    router, which FastAPI matches after the app's own routes), its request body documented
    by the schema `request_schema` refers to."""
    app.router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        route_class_override=DirectRoute,
        tags=["openai"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": request_schema}}},
            }
        },
    )


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
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


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # The endpoints check readiness themselves, once the body is validated; a body that
        # parsed as JSON but does not validate still gets the not-ready answer first.
        if not isinstance(exc.__cause__, json.JSONDecodeError) and request.scope.get(
            "path", ""
        ).startswith("/v1/"):
            try:
                ready_service(request)
            except APIError as not_ready:
                return error_response(not_ready)
        return error_response(validation_error(exc.errors()))

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
        return error_response(
            APIError(exc.status_code, message, code=code), dict(exc.headers or {})
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled %s on %s", type(exc).__name__, request.url.path)
        return error_response(
            APIError(500, "internal error", type="server_error", code="internal_error")
        )
