"""AnthropicChatClient: request and answer mapping, streaming and faults, over a real server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from chatroute.chat.types import (
    ChatFinishReason,
    ChatMessage,
    ChatOptions,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    TextReasoningContent,
)
from chatroute.providers import (
    ContextLengthExceededError,
    FailureKind,
    MalformedResponseError,
    ProviderAuthError,
    ProviderBadRequestError,
    ProviderConnectionError,
    ProviderServerError,
    ProviderTimeoutError,
    RateLimitedError,
    StreamInterruptedError,
    TruncatedStreamError,
    UpstreamStreamError,
    classify_failure,
)
from chatroute.providers.anthropic_messages import (
    AnthropicChatClient,
    build_anthropic_request,
    response_from_anthropic,
)
from tests.fakes import Hang, Ok, RateLimited, Reset, Status, ToolCall
from tests.fakes.anthropic import FakeAnthropic

SECRET = "sk-ant-test-secret-0123456789"
USER = [ChatMessage(ChatRole.USER, "hi")]


def _client(up: FakeAnthropic, **kw: Any) -> AnthropicChatClient:
    kw.setdefault("name", "claude")
    return AnthropicChatClient("claude-test", base_url=up.url, **kw)


async def _collect(client: AnthropicChatClient, **kw: Any) -> list[ChatResponseUpdate]:
    return [u async for u in client.get_streaming_response(kw.pop("messages", USER), **kw)]


@pytest.fixture
def up() -> Any:
    with FakeAnthropic() as server:
        yield server


# ---------------------------------------------------------------------------- requests


def test_request_maps_system_tools_and_results() -> None:
    messages = [
        ChatMessage(ChatRole.SYSTEM, "Be brief."),
        ChatMessage(ChatRole.USER, "weather in Paris and Rome?"),
        ChatMessage(
            ChatRole.ASSISTANT,
            contents=[
                TextReasoningContent("two calls"),  # not sent back: no signature
                FunctionCallContent("toolu_1", "weather", '{"city": "Paris"}'),
                FunctionCallContent("toolu_2", "weather", '{"city": "Rome"}'),
            ],
        ),
        ChatMessage(ChatRole.TOOL, contents=[FunctionResultContent("toolu_1", {"c": 21})]),
        ChatMessage(ChatRole.TOOL, contents=[FunctionResultContent("toolu_2", "sunny")]),
    ]
    options = ChatOptions(
        instructions="You are a weather bot.",
        temperature=0.5,
        stop_sequences=["END"],
        user="u-42",
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Weather for a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        tool_choice="required",
        seed=7,  # no counterpart: not sent
        additional_properties={"parallel_tool_calls": False, "logprobs": True, "top_k": 5},
    )
    body = build_anthropic_request(messages, options, default_model="claude-x")
    assert body["model"] == "claude-x"
    assert body["max_tokens"] == 4096  # required by the API: the default when unset
    assert body["system"] == "You are a weather bot.\n\nBe brief."
    assert body["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {  # both results in one user turn
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"c": 21}'},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"},
            ],
        },
    ]
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["temperature"] == 0.5 and body["stop_sequences"] == ["END"]
    assert body["metadata"] == {"user_id": "u-42"}
    assert body["top_k"] == 5  # a Messages API field passes through
    for dropped in ("seed", "logprobs", "parallel_tool_calls"):
        assert dropped not in body


def test_signed_reasoning_goes_back_as_thinking_blocks() -> None:
    turn = ChatMessage(
        ChatRole.ASSISTANT,
        contents=[
            TextReasoningContent("first, the weather", protected_data="sig-1"),
            TextReasoningContent("", protected_data="opaque"),
            TextReasoningContent("unsigned: left out"),
            FunctionCallContent("toolu_1", "weather", "{}"),
        ],
    )
    result = ChatMessage(ChatRole.TOOL, contents=[FunctionResultContent("toolu_1", "rain")])
    body = build_anthropic_request([*USER, turn, result], None, default_model="m")
    assert body["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "first, the weather", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
    ]


def test_request_options_thinking_model_and_named_tool_choice() -> None:
    options = ChatOptions(
        model_id="claude-other",
        max_output_tokens=1000,
        reasoning={"effort": "medium"},
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        tools=[{"name": "lookup", "parameters": {"type": "object"}}],
    )
    body = build_anthropic_request(USER, options, default_model="claude-x")
    assert body["model"] == "claude-other"
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 8192}
    assert body["max_tokens"] == 8192 + 1000  # room for the answer beyond the budget
    assert body["tool_choice"] == {"type": "tool", "name": "lookup"}
    assert body["tools"] == [{"name": "lookup", "input_schema": {"type": "object"}}]


def test_request_refusals_are_clear() -> None:
    with pytest.raises(ValueError, match="response_format 'json_object' is not supported"):
        build_anthropic_request(
            USER, ChatOptions(response_format={"type": "json_object"}), default_model="m"
        )
    bad_call = ChatMessage(ChatRole.ASSISTANT, contents=[FunctionCallContent("t1", "f", "{oops")])
    with pytest.raises(ValueError, match="arguments of tool call 't1' are not JSON"):
        build_anthropic_request([*USER, bad_call], None, default_model="m")
    with pytest.raises(ValueError, match="no model"):
        build_anthropic_request(USER, None, default_model=None)


def test_response_mapping_of_blocks_usage_and_stop_reasons() -> None:
    message = {
        "id": "msg_1",
        "model": "claude-x",
        "content": [
            {"type": "thinking", "thinking": "let me see", "signature": "s"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {"a": [1, 2]}},
        ],
        "stop_reason": "tool_use",
        "usage": {
            "input_tokens": 5,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 20,
            "output_tokens": 7,
        },
    }
    response = response_from_anthropic(message, provider="claude")
    contents = response.messages[0].contents
    assert contents == [
        TextReasoningContent("let me see", protected_data="s"),
        TextReasoningContent("", protected_data="xx"),  # redacted: kept to send back
        TextContent("Calling."),
        FunctionCallContent("toolu_9", "f", '{"a":[1,2]}', 0),
    ]
    assert response.finish_reason is ChatFinishReason.TOOL_CALLS
    assert response.response_id == "msg_1" and response.model_id == "claude-x"
    usage = response.usage
    assert usage is not None
    assert (usage.input_token_count, usage.output_token_count, usage.total_token_count) == (
        125,
        7,
        132,
    )
    assert usage.additional_counts == {
        "cache_creation_input_tokens": 20,
        "cache_read_input_tokens": 100,
    }
    assert usage.cached_input_token_count == 100 and usage.reasoning_token_count is None
    for reason, expected in [
        ("end_turn", ChatFinishReason.STOP),
        ("max_tokens", ChatFinishReason.LENGTH),
        ("refusal", ChatFinishReason.CONTENT_FILTER),
        ("something_new", "something_new"),
    ]:
        assert response_from_anthropic({**message, "stop_reason": reason}).finish_reason == expected


# ---------------------------------------------------------------------------- over HTTP


async def test_answer_over_http(up: FakeAnthropic) -> None:
    up.script(
        Ok(
            "It is sunny.",
            reasoning="check the sky",
            finish_reason="length",
            prompt_tokens=12,
            completion_tokens=4,
            usage_extra={"cache_read_input_tokens": 3},
        )
    )
    async with _client(up) as client:
        response = await client.get_response(
            [ChatMessage(ChatRole.SYSTEM, "Be brief."), *USER], ChatOptions(temperature=0.1)
        )
    assert response.text == "It is sunny."
    assert response.messages[0].contents[0] == TextReasoningContent("check the sky", "sig")
    assert response.finish_reason is ChatFinishReason.LENGTH
    assert response.model_id == "claude-test" and response.response_id == "msg_fake_0"
    assert response.usage is not None and response.usage.input_token_count == 15
    assert response.additional_properties == {"provider": "claude"}
    request = up.requests[0]
    assert request.path == "/v1/messages"
    assert request.json["system"] == "Be brief." and request.json["temperature"] == 0.1
    assert request.json["messages"] == [{"role": "user", "content": "hi"}]
    assert request.json["stream"] is False
    assert "authorization" not in request.headers and "x-api-key" not in request.headers


async def test_the_key_comes_from_the_caller_and_stays_out_of_errors(up: FakeAnthropic) -> None:
    up.script(Ok("fine"), Status(401, message=f"invalid x-api-key {SECRET}"))
    async with _client(up, api_key=SECRET) as client:
        await client.get_response(USER)
        assert SECRET in json.dumps(up.requests[0].headers)
        with pytest.raises(ProviderAuthError) as info:
            await client.get_response(USER)
    assert SECRET not in str(info.value)
    assert SECRET not in (info.value.error_message or "")
    assert info.value.kind is FailureKind.AUTH


async def test_tool_calls_come_back_as_function_calls(up: FakeAnthropic) -> None:
    up.script(Ok("", tool_calls=[ToolCall("weather", '{"city": "Oslo"}', id="toolu_a")]))
    async with _client(up) as client:
        response = await client.get_response(USER)
    assert response.finish_reason is ChatFinishReason.TOOL_CALLS
    call = response.messages[0].contents[0]
    assert isinstance(call, FunctionCallContent)
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "toolu_a",
        "weather",
        {"city": "Oslo"},
    )


async def test_stream_commits_on_content_and_ends_with_finish_and_usage(
    up: FakeAnthropic,
) -> None:
    up.script(
        Ok(
            "one two",
            reasoning="hmm",
            tool_calls=[ToolCall("f", '{"x": 1}', id="toolu_s", chunks=2)],
            finish_reason="tool_calls",
            prompt_tokens=9,
            completion_tokens=6,
        )
    )
    async with _client(up) as client:
        updates = await _collect(client)
    # message_start and ping carry nothing: the first update already has content.
    assert updates[0].contents == [TextReasoningContent("hmm")]
    assert updates[0].role is ChatRole.ASSISTANT
    assert updates[0].response_id == "msg_fake_0" and updates[0].model_id == "claude-test"
    text = "".join(u.text for u in updates)
    assert text == "one two"
    calls = [c for u in updates for c in u.contents if isinstance(c, FunctionCallContent)]
    assert calls[0] == FunctionCallContent("toolu_s", "f", "", 0)
    assert "".join(c.arguments for c in calls) == '{"x": 1}'
    assert {c.index for c in calls} == {0}
    last = updates[-1]
    assert last.finish_reason is ChatFinishReason.TOOL_CALLS and last.contents == []
    assert last.usage is not None
    assert (last.usage.input_token_count, last.usage.output_token_count) == (9, 6)
    assert up.requests[0].json["stream"] is True


async def test_closing_a_stream_early_closes_the_connection(up: FakeAnthropic) -> None:
    up.script(Ok("a b c d e f", chunk_delay=0.05, hold_open=True))
    async with _client(up) as client:
        stream = client.get_streaming_response(USER)
        first = await anext(stream)
        assert first.text == "a "
        await stream.aclose()  # type: ignore[attr-defined]
        await up.await_disconnect(0, timeout=5)


# ---------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    ("behaviour", "error", "kind"),
    [
        (Status(529), ProviderServerError, FailureKind.SERVER_ERROR),
        (Status(500), ProviderServerError, FailureKind.SERVER_ERROR),
        (Status(404), ProviderAuthError, FailureKind.AUTH),
        (
            Status(400, message="prompt is too long: 210000 tokens > 200000 maximum"),
            ContextLengthExceededError,
            FailureKind.CONTEXT_LENGTH,
        ),
        (Status(400, message="max_tokens: too large"), ProviderBadRequestError, None),
        (Reset(), ProviderConnectionError, FailureKind.CONNECT),
        (Ok("x", malformed_at=0), MalformedResponseError, FailureKind.MALFORMED),
    ],
)
async def test_status_and_transport_faults_are_typed(
    up: FakeAnthropic, behaviour: Any, error: type[Exception], kind: FailureKind | None
) -> None:
    up.script(behaviour)
    async with _client(up) as client:
        with pytest.raises(error) as info:
            await client.get_response(USER)
    assert classify_failure(info.value) is (kind or FailureKind.CLIENT_ERROR)
    assert "claude" in str(info.value)


async def test_rate_limit_carries_retry_after_and_request_id(up: FakeAnthropic) -> None:
    up.script(RateLimited(retry_after=7))
    async with _client(up) as client:
        with pytest.raises(RateLimitedError) as info:
            await client.get_response(USER)
    assert info.value.retry_after == 7.0
    assert info.value.request_id == "req_fake"
    assert info.value.error_type == "rate_limit_error"


async def test_unreachable_upstream_is_a_connection_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = AnthropicChatClient("m", base_url=f"http://127.0.0.1:{port}", connect_timeout=2)
    async with client:
        with pytest.raises(ProviderConnectionError):
            await client.get_response(USER)


async def test_silent_upstream_hits_the_read_timeout(up: FakeAnthropic) -> None:
    up.script(Hang())
    async with _client(up, read_timeout=0.3) as client:
        with pytest.raises(ProviderTimeoutError) as info:
            await asyncio.wait_for(client.get_response(USER), 10)
    assert classify_failure(info.value) is FailureKind.TIMEOUT


async def test_error_event_after_output_is_an_upstream_stream_error(up: FakeAnthropic) -> None:
    up.script(Ok("one two three", error_at=1))
    async with _client(up) as client:
        seen: list[str] = []
        with pytest.raises(UpstreamStreamError) as info:
            async for update in client.get_streaming_response(USER):
                seen.append(update.text)
    assert seen == ["one "]
    assert info.value.after_output is True
    assert info.value.error_type == "overloaded_error"


async def test_error_event_before_output_is_not_committed(up: FakeAnthropic) -> None:
    up.script(Ok("one two", error_at=0))
    async with _client(up) as client:
        with pytest.raises(UpstreamStreamError) as info:
            await _collect(client)
    assert info.value.after_output is False


async def test_cut_stream_is_interrupted(up: FakeAnthropic) -> None:
    up.script(Ok("one two three", cut_after=2))
    async with _client(up) as client:
        with pytest.raises(StreamInterruptedError) as info:
            await _collect(client)
    assert info.value.after_output is True
    assert classify_failure(info.value) is FailureKind.STREAM_INTERRUPTED


async def test_stream_without_stop_reason_is_truncated(up: FakeAnthropic) -> None:
    up.script(Ok("one two", finish_reason=None))
    async with _client(up) as client:
        with pytest.raises(TruncatedStreamError):
            await _collect(client)


async def test_malformed_event_is_malformed(up: FakeAnthropic) -> None:
    up.script(Ok("one two three", malformed_at=1))
    async with _client(up) as client:
        with pytest.raises(MalformedResponseError):
            await _collect(client)


async def test_json_response_format_is_refused_before_sending(up: FakeAnthropic) -> None:
    async with _client(up) as client:
        with pytest.raises(ProviderBadRequestError, match="response_format"):
            await client.get_response(USER, ChatOptions(response_format={"type": "json_object"}))
    assert up.attempts == 0


async def test_closed_client_refuses_calls(up: FakeAnthropic) -> None:
    client = _client(up)
    await client.aclose()
    await client.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await client.get_response(USER)


# ---------------------------------------------------------------------------- transport


async def test_requests_carry_the_key_and_the_api_version_the_sdk_sends(up: FakeAnthropic) -> None:
    """What the Messages API needs on every request: the key as the anthropic SDK sends it
    (a Bearer token), the API version, a JSON body; without a key no credentials at all."""
    up.script(Ok("one"), Ok("two"))
    async with _client(up, api_key=SECRET) as client:
        await client.get_response(USER)
    async with _client(up) as keyless:
        await keyless.get_response(USER)
    keyed, bare = (r.headers for r in up.requests)
    assert keyed["authorization"] == f"Bearer {SECRET}"
    assert keyed["anthropic-version"] == "2026-10-21"
    assert keyed["content-type"] == "application/json"
    assert "x-api-key" not in bare and "authorization" not in bare
    assert bare["anthropic-version"] == "2026-10-21"


@contextlib.asynccontextmanager
async def _raw_stream(events: list[tuple[str, Any]]) -> AsyncIterator[str]:
    """A one-shot upstream that answers with these server-sent events (JSON data, or text
    as it is); its base URL."""
    body = b"".join(
        b"event: %s\ndata: %s\n\n"
        % (name.encode(), data.encode() if isinstance(data, str) else json.dumps(data).encode())
        for name, data in events
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


_START = ("message_start", {"type": "message_start", "message": {"id": "m1", "model": "c"}})


async def test_pings_and_unknown_events_are_skipped() -> None:
    """A stream as the API may send it: pings, and an event type this client does not
    know, between the ones it reads."""
    events = [
        _START,
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        ),
        ("future_event", {"type": "future_event", "anything": [1, 2]}),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hello"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    async with _raw_stream(events) as url, AnthropicChatClient("c", base_url=url) as client:
        updates = await _collect(client)
    assert "".join(u.text for u in updates) == "hello"
    assert updates[-1].finish_reason is ChatFinishReason.STOP


async def test_an_error_event_that_is_not_json_is_still_an_upstream_error() -> None:
    events = [_START, ("error", "upstream overloaded, try later")]
    async with _raw_stream(events) as url, AnthropicChatClient("c", base_url=url) as client:
        with pytest.raises(UpstreamStreamError, match="upstream overloaded") as info:
            await _collect(client)
    assert info.value.after_output is False


async def test_an_event_that_is_not_a_json_object_is_malformed() -> None:
    async with _raw_stream([_START, ("content_block_delta", [1, 2])]) as url:
        async with AnthropicChatClient("c", base_url=url) as client:
            with pytest.raises(MalformedResponseError, match="not a JSON object"):
                await _collect(client)
