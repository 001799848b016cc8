"""Provider errors: the error-class table, classification, and every fault over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest

from chatroute.chat import ChatMessage, ChatRole
from chatroute.errors import error_fields, redact
from chatroute.errors import status_error as make_status_error
from chatroute.providers import (
    FAILURE_POLICIES,
    ContextLengthExceededError,
    FailureKind,
    FirstTokenTimeoutError,
    MalformedResponseError,
    OpenAIChatClient,
    ProviderAuthError,
    ProviderBadRequestError,
    ProviderConnectionError,
    ProviderError,
    ProviderServerError,
    ProviderTimeoutError,
    RateLimitedError,
    StreamInterruptedError,
    StreamStallTimeoutError,
    TruncatedStreamError,
    UpstreamStreamError,
    classify_failure,
    parse_retry_after,
)
from tests.fakes import (
    ContentPolicy,
    ContextLengthExceeded,
    Cut,
    ErrorEvent,
    Events,
    FakeUpstream,
    Hang,
    Malformed,
    ModelNotFound,
    Ok,
    RateLimited,
    Reset,
    ServerError,
    SlowFirstToken,
    Stall,
    Status,
    Truncated,
    Unauthorized,
    Unavailable,
)

HI = [ChatMessage(ChatRole.USER, "hi")]
REQUEST = httpx2.Request("POST", "http://upstream.test/v1/chat/completions")


def status_error(status: int, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    response = httpx2.Response(status, request=REQUEST, headers=headers or {})
    return openai.APIStatusError(f"Error code: {status}", response=response, body=body)


def connection_error(cause: BaseException) -> openai.APIConnectionError:
    exc = openai.APIConnectionError(request=REQUEST)
    exc.__cause__ = cause
    return exc


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream() as fake:
        yield fake


@pytest.fixture
async def client(up: FakeUpstream) -> AsyncIterator[OpenAIChatClient]:
    provider = OpenAIChatClient(
        "m",
        base_url=up.base_url,
        api_key="sk-live-abcdef123456",
        name="primary",
        first_token_timeout=2.0,
        stall_timeout=2.0,
    )
    yield provider
    await provider.aclose()


async def warm(up: FakeUpstream, **kwargs: Any) -> OpenAIChatClient:
    """A provider on `up` that has made one request already, with the fake's records reset.

    The SDK's first request does one-off work (platform detection in a thread) that must not
    count against the tight time limits these tests use.
    """
    provider = OpenAIChatClient("m", base_url=up.base_url, **kwargs)
    up.script(Ok("warm-up"))
    await provider.get_response(HI)
    up.reset()
    return provider


async def drain(client: OpenAIChatClient) -> tuple[list[str], BaseException | None]:
    """The texts streamed before the iterator ended, and what it raised (or None)."""
    texts: list[str] = []
    try:
        async for update in client.get_streaming_response(HI):
            texts.append(update.text)
    except Exception as exc:
        return texts, exc
    return texts, None


# ---------------------------------------------------------------------------- the table


def test_every_kind_has_a_policy() -> None:
    assert set(FAILURE_POLICIES) == set(FailureKind)
    for kind in FailureKind:
        assert kind.policy is FAILURE_POLICIES[kind]


@pytest.mark.parametrize(
    ("kind", "fail_over", "retry_same", "counts", "unhealthy", "to_caller"),
    [
        # connect error, reset before headers, 5xx, 408: fail over
        (FailureKind.CONNECT, True, True, True, False, False),
        (FailureKind.SERVER_ERROR, True, True, True, False, False),
        # 429: fail over, Retry-After honoured when it fits
        (FailureKind.RATE_LIMITED, True, True, True, False, False),
        # no first token in time: fail over, never retry that provider in the request
        (FailureKind.FIRST_TOKEN_TIMEOUT, True, False, True, False, False),
        # 401/403/404: fail over and mark unhealthy
        (FailureKind.AUTH, True, False, True, True, False),
        # 400 context length: only to a larger context, else return it
        (FailureKind.CONTEXT_LENGTH, True, False, False, False, True),
        # other 4xx: return as is
        (FailureKind.CLIENT_ERROR, False, False, False, False, True),
        # caller went away: stop, not counted against the provider
        (FailureKind.CANCELLED, False, False, False, False, False),
        (FailureKind.STREAM_INTERRUPTED, True, True, True, False, False),
        (FailureKind.MALFORMED, True, True, True, False, False),
        (FailureKind.STREAM_ERROR, True, True, True, False, False),
        (FailureKind.STALL_TIMEOUT, True, False, True, False, False),
    ],
)
def test_error_class_table(
    kind: FailureKind,
    fail_over: bool,
    retry_same: bool,
    counts: bool,
    unhealthy: bool,
    to_caller: bool,
) -> None:
    policy = kind.policy
    assert policy.fail_over is fail_over
    assert policy.retry_same_provider is retry_same
    assert policy.counts_against_health is counts
    assert policy.mark_unhealthy is unhealthy
    assert policy.return_to_caller is to_caller
    assert policy.honour_retry_after is (kind is FailureKind.RATE_LIMITED)
    assert policy.needs_larger_context is (kind is FailureKind.CONTEXT_LENGTH)


CONTEXT_BODY = {
    "message": "This model's maximum context length is 8192 tokens.",
    "type": "invalid_request_error",
    "code": "context_length_exceeded",
}


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (status_error(500), FailureKind.SERVER_ERROR),
        (status_error(502), FailureKind.SERVER_ERROR),
        (status_error(503), FailureKind.SERVER_ERROR),
        (status_error(408), FailureKind.SERVER_ERROR),
        (status_error(429), FailureKind.RATE_LIMITED),
        (status_error(401), FailureKind.AUTH),
        (status_error(403), FailureKind.AUTH),
        (status_error(404), FailureKind.AUTH),
        (status_error(400, CONTEXT_BODY), FailureKind.CONTEXT_LENGTH),
        (status_error(400, {"error": CONTEXT_BODY}), FailureKind.CONTEXT_LENGTH),
        (
            status_error(400, {"message": "prompt is too long: 210000 tokens > 200000"}),
            FailureKind.CONTEXT_LENGTH,
        ),
        (
            status_error(413, {"message": "Please reduce the length of the messages."}),
            FailureKind.CONTEXT_LENGTH,
        ),
        (status_error(400, {"code": "content_policy_violation"}), FailureKind.CLIENT_ERROR),
        (status_error(400, None), FailureKind.CLIENT_ERROR),
        (status_error(422), FailureKind.CLIENT_ERROR),
        (status_error(302), FailureKind.UNKNOWN),
        (openai.APITimeoutError(request=REQUEST), FailureKind.TIMEOUT),
        (connection_error(httpx2.ConnectError("refused")), FailureKind.CONNECT),
        (httpx.ConnectError("refused"), FailureKind.CONNECT),
        (httpx2.ReadError("reset"), FailureKind.CONNECT),
        (ConnectionResetError(), FailureKind.CONNECT),
        (httpx.ReadTimeout("slow"), FailureKind.TIMEOUT),
        (TimeoutError(), FailureKind.TIMEOUT),
        (json.JSONDecodeError("bad", "{", 0), FailureKind.MALFORMED),
        (openai.APIError("boom", REQUEST, body={"message": "boom"}), FailureKind.STREAM_ERROR),
        (asyncio.CancelledError(), FailureKind.CANCELLED),
        (FirstTokenTimeoutError("x"), FailureKind.FIRST_TOKEN_TIMEOUT),
        (StreamStallTimeoutError("x"), FailureKind.STALL_TIMEOUT),
        (TruncatedStreamError("x"), FailureKind.STREAM_INTERRUPTED),
        (ProviderError("x", kind=FailureKind.AUTH), FailureKind.AUTH),
        (KeyError("x"), FailureKind.UNKNOWN),
    ],
)
def test_classify(exc: BaseException, kind: FailureKind) -> None:
    assert classify_failure(exc) is kind


def test_status_error_fields_and_retry_after() -> None:
    body = {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}
    exc = make_status_error(
        429,
        error_fields({"error": body}),
        None,
        {"retry-after": "7"},
        label="rate_limit_exceeded",
        request_id="req-1",
        provider="p",
    )
    assert isinstance(exc, RateLimitedError)
    assert (exc.status_code, exc.error_type, exc.error_code) == (
        429,
        "requests",
        "rate_limit_exceeded",
    )
    assert exc.error_message == "slow down" and exc.retry_after == 7.0
    assert exc.request_id == "req-1"
    assert exc.to_openai_error() == {
        "message": "slow down",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_timeout_errors_are_timeout_errors() -> None:
    for cls in (ProviderTimeoutError, FirstTokenTimeoutError, StreamStallTimeoutError):
        exc = cls("late", provider="p")
        assert isinstance(exc, TimeoutError) and isinstance(exc, ProviderError)
        assert isinstance(exc, RuntimeError)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "3"}, 3.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after-ms": "junk", "retry-after": "2"}, 2.0),
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after": "Thu, 01 Jan 1970 00:01:40 GMT"}, 60.0),
        ({"retry-after": "Thu, 01 Jan 1970 00:00:10 GMT"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str] | None, expected: float | None) -> None:
    assert parse_retry_after(headers, now=40.0) == expected


def test_redact_masks_keys() -> None:
    assert redact("Incorrect API key provided: sk-abc123def456") == (
        "Incorrect API key provided: sk-***"
    )
    assert redact("token hunter2-x is wrong", ("hunter2-x",)) == "token *** is wrong"


# ---------------------------------------------------------------------------- against the fake


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("behaviour", "exc_type", "kind", "status"),
    [
        (ServerError(), ProviderServerError, FailureKind.SERVER_ERROR, 500),
        (Unavailable(), ProviderServerError, FailureKind.SERVER_ERROR, 503),
        (Status(408), ProviderServerError, FailureKind.SERVER_ERROR, 408),
        (RateLimited(1), RateLimitedError, FailureKind.RATE_LIMITED, 429),
        (Unauthorized(), ProviderAuthError, FailureKind.AUTH, 401),
        (Status(403), ProviderAuthError, FailureKind.AUTH, 403),
        (ModelNotFound(), ProviderAuthError, FailureKind.AUTH, 404),
        (ContextLengthExceeded(), ContextLengthExceededError, FailureKind.CONTEXT_LENGTH, 400),
        (ContentPolicy(), ProviderBadRequestError, FailureKind.CLIENT_ERROR, 400),
        (Reset(), ProviderConnectionError, FailureKind.CONNECT, None),
    ],
)
async def test_pre_output_errors_are_typed_with_exactly_one_attempt(
    up: FakeUpstream,
    client: OpenAIChatClient,
    stream: bool,
    behaviour: Any,
    exc_type: type[ProviderError],
    kind: FailureKind,
    status: int | None,
) -> None:
    up.script(behaviour)
    if stream:
        texts, exc = await drain(client)
        assert texts == []
    else:
        with pytest.raises(ProviderError) as info:
            await client.get_response(HI)
        exc = info.value
    assert type(exc) is exc_type
    assert isinstance(exc, ProviderError)
    assert exc.kind is kind and classify_failure(exc) is kind
    assert exc.status_code == status
    assert exc.provider == "primary" and not exc.after_output
    # A status error carries what the upstream said; a transport error its cause.
    assert exc.error_message if status is not None else exc.__cause__ is not None
    assert up.attempts == 1


async def test_rate_limit_carries_retry_after(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(RateLimited(2), RateLimited(None, retry_after_ms=300), RateLimited(None))
    seen = []
    for _ in range(3):
        with pytest.raises(RateLimitedError) as info:
            await client.get_response(HI)
        seen.append(info.value.retry_after)
    assert seen == [2.0, 0.3, None]


async def test_error_messages_never_contain_the_api_key(up: FakeUpstream) -> None:
    key = "sk-live-abcdef123456"
    up.script(Status(401, message=f"Incorrect API key provided: {key}"))
    provider = OpenAIChatClient("m", base_url=up.base_url, api_key=key)
    try:
        with pytest.raises(ProviderAuthError) as info:
            await provider.get_response(HI)
    finally:
        await provider.aclose()
    assert key not in str(info.value)
    assert info.value.error_message is not None and key not in info.value.error_message
    assert key not in json.dumps(info.value.to_openai_error())


async def test_connect_error_to_a_closed_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port}/v1", connect_timeout=2)
    try:
        with pytest.raises(ProviderConnectionError) as info:
            await provider.get_response(HI)
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert info.value.kind is FailureKind.CONNECT
    assert texts == [] and isinstance(exc, ProviderConnectionError)


# --- stream faults (F05-F11, F14)


@pytest.mark.parametrize("rst", [False, True])
async def test_cut_after_output_is_an_interrupted_stream(
    up: FakeUpstream, client: OpenAIChatClient, rst: bool
) -> None:
    up.script(Cut(2, rst=rst))
    texts, exc = await drain(client)
    assert texts == ["one ", "two "]
    assert isinstance(exc, StreamInterruptedError)
    assert exc.kind is FailureKind.STREAM_INTERRUPTED and exc.after_output
    assert up.attempts == 1


async def test_cut_before_content_is_a_pre_output_failure(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Cut(0))
    texts, exc = await drain(client)
    assert texts == []
    assert isinstance(exc, StreamInterruptedError) and not exc.after_output


async def test_cut_non_streaming_body(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Cut(0))
    with pytest.raises(ProviderConnectionError):
        await client.get_response(HI)


@pytest.mark.parametrize(("at", "before"), [(0, []), (2, ["one ", "two "])])
async def test_malformed_chunk(
    up: FakeUpstream, client: OpenAIChatClient, at: int, before: list[str]
) -> None:
    up.script(Malformed(at))
    texts, exc = await drain(client)
    assert texts == before
    assert isinstance(exc, MalformedResponseError)
    assert exc.after_output is bool(before)


async def test_malformed_non_streaming_body(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Malformed())
    with pytest.raises(MalformedResponseError):
        await client.get_response(HI)


async def test_non_chat_completion_json_is_malformed(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Status(200, body={"unexpected": True}))
    with pytest.raises(MalformedResponseError):
        await client.get_response(HI)


@pytest.mark.parametrize(("at", "before"), [(0, []), (1, ["one "])])
async def test_error_event(
    up: FakeUpstream, client: OpenAIChatClient, at: int, before: list[str]
) -> None:
    up.script(ErrorEvent(at, "model overloaded", code="overloaded"))
    texts, exc = await drain(client)
    assert texts == before
    assert isinstance(exc, UpstreamStreamError)
    assert exc.kind is FailureKind.STREAM_ERROR
    assert exc.error_code == "overloaded" and exc.error_message == "model overloaded"
    assert exc.after_output is bool(before)


async def test_truncated_stream_is_an_error_not_a_success(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Truncated(2))
    texts, exc = await drain(client)
    assert texts == ["one ", "two "]
    assert isinstance(exc, TruncatedStreamError) and exc.after_output


async def test_truncated_before_content(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Truncated(0))
    texts, exc = await drain(client)
    assert texts == [] and isinstance(exc, TruncatedStreamError) and not exc.after_output


async def test_connection_cut_after_the_finish_reason_still_completes(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok("all of it", done=False, abort_at_end=True))
    texts, exc = await drain(client)
    assert exc is None and "".join(texts) == "all of it"


def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    body = {
        "id": "c1",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return "data: " + json.dumps(body) + "\n\n"


async def test_done_without_finish_reason_completes(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok("x y", finish_reason=None, done=True))
    texts, exc = await drain(client)
    assert exc is None and "".join(texts) == "x y"


async def test_events_after_done_are_ignored(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Events([chunk({"content": "a"}), "data: [DONE]\n\n", chunk({"content": "zzz"})]))
    texts, exc = await drain(client)
    assert exc is None and texts == ["a"]


async def test_a_stream_with_no_role_delta_is_still_the_assistant_speaking(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(
        Events([chunk({"content": "a"}), chunk({"content": "b"}, "stop"), "data: [DONE]\n\n"])
    )
    updates = [u async for u in client.get_streaming_response(HI)]
    assert updates[0].role is ChatRole.ASSISTANT  # the upstream never said so
    assert "".join(u.text for u in updates) == "ab"


async def test_multi_line_data_and_comments_are_sse(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    first = {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    split = "data: " + json.dumps(first).replace(", ", ",\ndata: ") + "\n\n"
    up.script(Events([": keep-alive\n\n", split, chunk({}, "stop"), "data: [DONE]\n\n"]))
    texts, exc = await drain(client)
    assert exc is None and texts == ["hi", ""]


async def test_named_error_event(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(
        Events([chunk({"content": "a"}), 'event: error\ndata: {"message": "overloaded"}\n\n'])
    )
    texts, exc = await drain(client)
    assert texts == ["a"]
    assert isinstance(exc, UpstreamStreamError) and exc.after_output


@pytest.mark.parametrize(
    "event",
    [
        "data: [1, 2]\n\n",
        'data: {"choices": "nope"}\n\n',
        'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": 7}]}\n\n',
        'data: {"choices": [{"delta": {"tool_calls": ["bad"]}}]}\n\n',
    ],
)
async def test_chunks_that_are_not_chat_chunks_are_malformed(
    up: FakeUpstream, client: OpenAIChatClient, event: str
) -> None:
    up.script(Events([event]))
    texts, exc = await drain(client)
    assert texts == [] and isinstance(exc, MalformedResponseError)


async def test_error_body_with_status_200(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Status(200, body={"error": {"message": "quota", "code": "insufficient_quota"}}))
    with pytest.raises(UpstreamStreamError) as info:
        await client.get_response(HI)
    assert info.value.error_code == "insufficient_quota"


async def test_stream_answered_with_plain_json_is_truncated(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Status(200, body={"id": "x", "choices": []}))
    texts, exc = await drain(client)
    assert texts == [] and isinstance(exc, TruncatedStreamError)


# --- timeouts (F06, F07, F09)


async def test_hang_hits_the_first_token_timeout_and_closes_the_connection(
    up: FakeUpstream,
) -> None:
    provider = await warm(up, first_token_timeout=0.2)
    up.script(Hang())
    try:
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert texts == []
    assert isinstance(exc, FirstTokenTimeoutError) and isinstance(exc, TimeoutError)
    assert classify_failure(exc) is FailureKind.FIRST_TOKEN_TIMEOUT
    await up.await_disconnect(0, timeout=5)


async def test_slow_first_token_hits_the_first_token_timeout(up: FakeUpstream) -> None:
    provider = await warm(up, first_token_timeout=0.2)
    up.script(SlowFirstToken(30))
    try:
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert texts == [] and isinstance(exc, FirstTokenTimeoutError)
    await up.await_disconnect(0, timeout=5)
    assert up.requests[0].chunks_sent == 0


async def test_stall_hits_the_stall_timeout_after_output(up: FakeUpstream) -> None:
    up.script(Stall(2))
    provider = OpenAIChatClient("m", base_url=up.base_url, first_token_timeout=5, stall_timeout=0.5)
    try:
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert texts == ["one ", "two "]
    assert isinstance(exc, StreamStallTimeoutError) and exc.after_output
    assert classify_failure(exc) is FailureKind.STALL_TIMEOUT
    await up.await_disconnect(0, timeout=5)


async def test_stall_timeout_does_not_cut_a_slow_but_steady_stream(up: FakeUpstream) -> None:
    up.script(Ok("a b c d", chunk_delay=0.1))
    provider = OpenAIChatClient("m", base_url=up.base_url, first_token_timeout=2, stall_timeout=2)
    try:
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert exc is None and "".join(texts) == "a b c d"


async def test_request_timeout_bounds_a_non_streaming_attempt(up: FakeUpstream) -> None:
    provider = await warm(up, request_timeout=0.2)
    up.script(Hang())
    try:
        with pytest.raises(ProviderTimeoutError) as info:
            await provider.get_response(HI)
    finally:
        await provider.aclose()
    assert info.value.kind is FailureKind.TIMEOUT
    assert isinstance(info.value, TimeoutError)
    await up.await_disconnect(0, timeout=5)


async def test_request_timeout_bounds_a_whole_stream(up: FakeUpstream) -> None:
    provider = await warm(up, request_timeout=0.5)
    up.script(Stall(2))
    try:
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert texts == ["one ", "two "]
    assert type(exc) is ProviderTimeoutError and exc.after_output
    await up.await_disconnect(0, timeout=5)


async def test_read_timeout_of_the_transport_is_typed(up: FakeUpstream) -> None:
    provider = await warm(up, read_timeout=0.2)
    up.script(Hang(), Stall(1))
    try:
        with pytest.raises(ProviderTimeoutError) as info:
            await provider.get_response(HI)
        texts, exc = await drain(provider)
    finally:
        await provider.aclose()
    assert info.value.kind is FailureKind.TIMEOUT
    assert texts == ["one "] and isinstance(exc, StreamStallTimeoutError)


async def test_first_token_timeout_is_not_a_caller_cancellation(up: FakeUpstream) -> None:
    # The timeout must surface as an ordinary failure, never as CancelledError.
    provider = await warm(up, first_token_timeout=0.2)
    up.script(Hang(), Ok("fine"))
    try:
        _, exc = await drain(provider)
        assert isinstance(exc, FirstTokenTimeoutError)
        again, exc2 = await drain(provider)
    finally:
        await provider.aclose()
    assert exc2 is None and "".join(again) == "fine"
    assert up.attempts == 2


async def test_no_sdk_retries_on_connection_errors(up: FakeUpstream) -> None:
    up.script(Reset(), Reset(), Reset())
    provider = OpenAIChatClient("m", base_url=up.base_url)
    try:
        with pytest.raises(ProviderConnectionError):
            await provider.get_response(HI)
    finally:
        await provider.aclose()
    assert up.attempts == 1
    assert up.pending == 2


async def test_ok_after_failure_on_the_same_client(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(ServerError(), Ok("recovered"))
    with pytest.raises(ProviderServerError):
        await client.get_response(HI)
    assert (await client.get_response(HI)).text == "recovered"
