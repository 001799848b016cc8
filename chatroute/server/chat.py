"""`POST /v1/chat/completions`: routing, failover and the commit rule for one chat request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import anyio
import pydantic
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope

from chatroute.chat.client import ChatClient
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponseUpdate
from chatroute.router.base import close_iterator
from chatroute.server.deadlines import (
    CallerGone,
    Deadline,
    DeadlineHit,
    DisconnectWatch,
    bounded,
    caller_timeout,
    deadline_error,
    deadline_for,
    watched,
)
from chatroute.server.errors import error_from_exception
from chatroute.server.guard import PARSED_BODY, is_json, parse_json
from chatroute.server.handlers import error_response, validation_error
from chatroute.server.options import (
    ignored_headers,
    overridden_headers,
    stream_ignored_headers,
)
from chatroute.server.responses import RecordedResponse, SSEResponse, sse_body
from chatroute.server.service import (
    AUTO_MODEL,
    CLIENT_CLOSED,
    Service,
    check_messages,
    decide,
    named_route,
    ready_service,
)
from chatroute.server.sessions import StickyHeaders, open_session
from chatroute.server.wire import (
    ChatCompletionRequest,
    StreamEncoder,
    chat_call,
    completion_body,
    has_content,
)
from chatroute.tracing import RequestTrace, start_trace

__all__ = ["chat_completion", "chat_completions"]

logger = logging.getLogger("chatroute.server")


async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, routed by content (`model: auto`) or to a named route.

    Unknown top-level fields are passed on to the provider (as its `pass_through` allows);
    what the answering provider dropped is named in `x-chatroute-ignored-params`, and what
    the route's `override` forced in `x-chatroute-overridden`.
    `x-chatroute-timeout: <seconds>` shortens the request's deadline.
    """
    scope = request.scope
    # The body as the admission guard parsed it (once); read here only when no guard ran
    # or the body is not JSON by its content type (then the bytes fail validation).
    service = ready_service(request)
    payload: Any = scope.get(PARSED_BODY, _UNREAD)
    if payload is _UNREAD:
        payload = await request.body()
        if payload and is_json(scope):
            payload = parse_json(payload, service.config.server.max_json_depth)
    if payload == b"":
        raise validation_error([{"type": "missing", "loc": ("body",)}])
    try:
        body = ChatCompletionRequest.model_validate(payload)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return await chat_completion(service, scope, request.receive, body)


_UNREAD: Final = object()


async def chat_completion(
    service: Service, scope: Scope, receive: Receive, request: ChatCompletionRequest
) -> Response:
    """Answer a validated chat-completions request (routing, failover, the commit rule)."""
    started = time.perf_counter()
    arrived = asyncio.get_running_loop().time()
    check_messages(service, request.messages)
    timeout = caller_timeout(service, scope)
    call = chat_call(request)
    messages = call.messages
    options = call.options
    named = named_route(service, call.model)
    if named is not None:  # a route named as the model: no routing to wait for
        route_name, client = named
    else:
        decision = await decide(service, messages)
        route_name, client = service.engine.route_name(decision.client), decision.client
    trace = start_trace(route_name)
    trace.stream = call.stream
    deadline = deadline_for(service, route_name, timeout, arrived)
    extra: Mapping[str, str] = overridden_headers(service.config, route_name, options)
    session = open_session(service.engine, scope, messages)
    if session is not None:  # x-chatroute-sticky, once a provider has answered
        extra = StickyHeaders(extra, session)
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
    deadline: Deadline | None,
    extra_headers: Mapping[str, str],
) -> Response:
    route = trace.route or ""
    try:
        response = await watched(receive, bounded(client.get_response(messages, options), deadline))
    except CallerGone:
        trace.cancelled = "disconnect"
        service.finish(trace, CLIENT_CLOSED, started)
        return Response(status_code=CLIENT_CLOSED)  # nobody is listening any more
    except DeadlineHit as exc:
        trace.cancelled = "deadline"
        error = deadline_error(exc.seconds)
        service.finish(trace, error.status, started)
        return error_response(error, _headers(service, trace, extra_headers))
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed: %s", route, service.redact(str(error)))
        service.finish(trace, error.status, started)
        return error_response(error, _headers(service, trace, extra_headers))
    body = completion_body(response, model=_served_model(service, trace))
    trace.committed = True
    trace.usage, trace.response_model = response.usage, response.model_id
    headers = _headers(service, trace, extra_headers)
    headers.update(ignored_headers(response.additional_properties))
    return RecordedResponse(
        body,
        headers,
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
    deadline: Deadline | None,
    extra_headers: Mapping[str, str],
) -> Response:
    route = trace.route or ""
    iterator = aiter(client.get_streaming_response(messages, options))
    handed_over = False
    watch = DisconnectWatch(receive)  # handed over with the stream
    kept = False  # whether the response took the watch over
    try:
        # The commit point: nothing is sent until the first update that carries output.
        # Until then a disconnect or the deadline cancels the routed call directly.
        try:
            pending, finished = await watched(
                receive, bounded(_first_content(iterator), deadline), watch
            )
        except BaseException:
            watch.stop()
            raise
        if not finished:  # stopped at the first update that carries output
            trace.first_output_at = time.perf_counter()
        encoder = StreamEncoder(model=_served_model(service, trace), include_usage=include_usage)

        def unsent() -> None:
            # The caller left before the body started: nothing was sent.
            if trace.cancelled is None:
                trace.cancelled = "disconnect"
            service.finish(trace, CLIENT_CLOSED, started)

        response = SSEResponse(
            sse_body(service, iterator, pending, finished, encoder, trace, started, deadline),
            iterator,
            trace,
            unsent,
            {
                "cache-control": "no-cache",
                **service.route_headers(trace.route, trace),
                **extra_headers,
                **stream_ignored_headers(pending),
            },
            watch,
        )
        handed_over = kept = True
        return response
    except CallerGone:
        trace.cancelled = "disconnect"
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        service.finish(trace, CLIENT_CLOSED, started)
        return Response(status_code=CLIENT_CLOSED)
    except DeadlineHit as exc:
        trace.cancelled = "deadline"
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        error = deadline_error(exc.seconds)
        service.finish(trace, error.status, started)
        return error_response(error, _headers(service, trace, extra_headers))
    except Exception as exc:
        error = error_from_exception(exc, service.redact)
        logger.warning("route %s failed before output: %s", route, service.redact(str(error)))
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        handed_over = True
        service.finish(trace, error.status, started)
        return error_response(error, _headers(service, trace, extra_headers))
    finally:
        if not kept:
            watch.stop()
        if not handed_over:
            with anyio.CancelScope(shield=True):
                await close_iterator(iterator)
