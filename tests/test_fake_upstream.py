"""The scripted fake upstream behaves as documented, seen through httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

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
    NoDone,
    Ok,
    RateLimited,
    Reset,
    ServerError,
    SlowFirstToken,
    Stall,
    Status,
    ToolCall,
    Truncated,
    Unauthorized,
    Unavailable,
)

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream() as fake:
        yield fake


@pytest.fixture
async def sdk(up: FakeUpstream) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=up.base_url, api_key="sk-test", max_retries=0)
    yield client
    await client.close()


async def sse_lines(up: FakeUpstream, body: dict[str, Any]) -> list[str]:
    """The raw non-empty lines of a streamed answer, read to the end."""
    async with (
        httpx.AsyncClient(timeout=5) as client,
        client.stream("POST", up.base_url + "/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line async for line in response.aiter_lines() if line]


def payloads(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# ---------------------------------------------------------------------------- normal answers


async def test_non_streaming_ok_via_sdk_echoes_model_and_records_request(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    before = time.monotonic()
    reply = await sdk.chat.completions.create(model="small-model", messages=MESSAGES, seed=7)
    assert reply.choices[0].message.content == "Hello from the fake upstream."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model == "small-model"
    assert reply.id == "chatcmpl-fake-0"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (10, 5)
    assert up.attempts == 1
    req = up.requests[0]
    assert req.method == "POST" and req.path == "/v1/chat/completions"
    assert req.json["messages"] == MESSAGES and req.json["seed"] == 7
    assert req.headers["authorization"] == "Bearer sk-test"
    assert req.arrived_at >= before
    assert not req.stream
    assert req.status == 200
    assert isinstance(req.behaviour, Ok)


async def test_streaming_ok_sends_role_delta_content_finish_usage_and_done(
    up: FakeUpstream,
) -> None:
    up.script(Ok("a b c", model="served-model"))
    body = {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = await sse_lines(up, body)
    assert lines[-1] == "data: [DONE]"
    events = payloads(lines)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"].get("content") for e in events[1:4]]
    assert contents == ["a ", "b ", "c"]
    assert events[4]["choices"][0]["finish_reason"] == "stop"
    assert events[5]["choices"] == []
    assert events[5]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert {e["model"] for e in events} == {"served-model"}
    assert up.requests[0].chunks_sent == 3


async def test_streaming_via_sdk_without_usage_request_sends_no_usage(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    up.script(Ok("abcdefg", chunks=3))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = [c async for c in stream]
    assert [c.choices[0].delta.content for c in chunks] == ["", "abc", "de", "fg", None]
    assert all(c.usage is None for c in chunks)


async def test_reasoning_and_tool_calls_stream_and_complete(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    call = ToolCall("get_weather", '{"city": "Paris"}', id="call_w", chunks=3)
    up.script(Ok("", reasoning="think hard", tool_calls=[call]))
    up.script(Ok("", reasoning="think hard", tool_calls=[call]))
    reply = await sdk.chat.completions.create(model="m", messages=MESSAGES)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert message.model_extra == {"reasoning_content": "think hard"}
    assert message.tool_calls is not None
    assert message.tool_calls[0].id == "call_w"
    assert message.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert message.tool_calls[0].function.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]

    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in payloads(lines) if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "think hard"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"] == "call_w" and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert len(calls) == 4
    assert payloads(lines)[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_non_content_events_come_before_the_role_delta(up: FakeUpstream) -> None:
    up.script(Ok("x", empty_choices_first=True, keepalives=2))
    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    assert json.loads(lines[0][6:])["choices"] == []
    assert lines[1:3] == [": keep-alive", ": keep-alive"]
    assert json.loads(lines[3][6:])["choices"][0]["delta"]["role"] == "assistant"


async def test_without_role_chunk_the_first_content_carries_the_role(up: FakeUpstream) -> None:
    up.script(Ok("x y", role_chunk=False))
    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    first = payloads(lines)[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": "x "}


# ---------------------------------------------------------------------------- scripting


def test_script_then_handler_then_default_sync_client(up: FakeUpstream) -> None:
    up.default = Ok("default")
    up.script(Ok("first"), Status(503))
    up.handler = lambda req: Ok("handled") if req.messages[-1]["content"] == "h" else None
    client = openai.OpenAI(base_url=up.base_url, api_key="k", max_retries=0)
    try:
        first = client.chat.completions.create(model="m", messages=MESSAGES)
        assert first.choices[0].message.content == "first"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert up.pending == 0
        handled = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "h"}]
        )
        assert handled.choices[0].message.content == "handled"
        fallback = client.chat.completions.create(model="m", messages=MESSAGES)
        assert fallback.choices[0].message.content == "default"
    finally:
        client.close()
    assert up.attempts == 4
    assert [r.status for r in up.requests] == [200, 503, 200, 200]


def test_script_rejects_non_behaviours(up: FakeUpstream) -> None:
    with pytest.raises(TypeError, match="not a Behaviour"):
        up.script("ok")  # type: ignore[arg-type]


async def test_models_listing_and_unknown_path(sdk: openai.AsyncOpenAI, up: FakeUpstream) -> None:
    up.models = ["a", "b"]
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["a", "b"]
    async with httpx.AsyncClient() as client:
        missing = await client.get(up.url + "/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert up.attempts == 0
    assert [r.path for r in up.all_requests] == ["/v1/models", "/nope"]


async def test_invalid_json_body_is_a_400(up: FakeUpstream) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(up.base_url + "/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_async_context_manager_and_close_is_idempotent() -> None:
    async with FakeUpstream(Ok("via async")) as fake:
        async with httpx.AsyncClient() as client:
            r = await client.post(fake.base_url + "/chat/completions", json={"messages": []})
        assert r.json()["choices"][0]["message"]["content"] == "via async"
        assert r.json()["model"] == "fake-model"
    fake.close()
    with pytest.raises(httpx.ConnectError):
        httpx.post(fake.base_url + "/chat/completions", json={})


def test_base_url_before_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not started"):
        _ = FakeUpstream().base_url


# ---------------------------------------------------------------------------- HTTP errors


@pytest.mark.parametrize(
    ("behaviour", "exc_type", "status", "code"),
    [
        (RateLimited(2), openai.RateLimitError, 429, "rate_limit_exceeded"),
        (ServerError(), openai.InternalServerError, 500, None),
        (Unavailable(), openai.InternalServerError, 503, None),
        (ContextLengthExceeded(), openai.BadRequestError, 400, "context_length_exceeded"),
        (ContentPolicy(), openai.BadRequestError, 400, "content_policy_violation"),
        (Unauthorized(), openai.AuthenticationError, 401, "invalid_api_key"),
        (ModelNotFound(), openai.NotFoundError, 404, "model_not_found"),
        (Status(408), openai.APIStatusError, 408, None),
    ],
)
async def test_status_behaviours_reach_the_sdk_in_openai_error_shape(
    up: FakeUpstream,
    sdk: openai.AsyncOpenAI,
    behaviour: Status,
    exc_type: type[openai.APIStatusError],
    status: int,
    code: str | None,
) -> None:
    up.script(behaviour)
    with pytest.raises(exc_type) as info:
        await sdk.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == status
    assert info.value.code == code
    assert isinstance(info.value.body, dict) and info.value.body["message"]


async def test_rate_limit_headers_and_custom_body(up: FakeUpstream) -> None:
    up.script(
        RateLimited(1.5, retry_after_ms=250),
        Status(418, body={"weird": True}, headers={"x-extra": "1"}),
    )
    async with httpx.AsyncClient() as client:
        r1 = await client.post(up.base_url + "/chat/completions", json={"messages": []})
        r2 = await client.post(up.base_url + "/chat/completions", json={"messages": []})
    assert (r1.status_code, r1.headers["retry-after"], r1.headers["retry-after-ms"]) == (
        429,
        "1.5",
        "250",
    )
    assert (r2.status_code, r2.json(), r2.headers["x-extra"]) == (418, {"weird": True}, "1")


# ---------------------------------------------------------------------------- connection faults


async def test_reset_before_headers(up: FakeUpstream) -> None:
    up.script(Reset())
    async with httpx.AsyncClient() as client:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.post(up.base_url + "/chat/completions", json={"messages": []})
    assert up.attempts == 1
    conn = up.requests[0].connection
    assert conn.server_closed_at is not None and conn.client_closed_at is None


async def test_reset_reaches_the_sdk_as_a_connection_error(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    up.script(Reset())
    with pytest.raises(openai.APIConnectionError):
        await sdk.chat.completions.create(model="m", messages=MESSAGES)


async def test_hang_until_the_client_gives_up_and_the_disconnect_is_recorded(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    await sdk.chat.completions.create(model="m", messages=MESSAGES)  # SDK warm-up
    up.script(Hang())
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        await sdk.with_options(timeout=0.3).chat.completions.create(model="m", messages=MESSAGES)
    gone = await up.await_disconnect(1, timeout=5)
    assert gone > started
    assert up.requests[1].disconnected_at == gone
    finished = await up.await_finish(1)
    assert finished.status is None and isinstance(finished.behaviour, Hang)


async def test_slow_first_token_sends_headers_and_role_then_waits(up: FakeUpstream) -> None:
    up.script(SlowFirstToken(30))
    async with (
        httpx.AsyncClient(timeout=5) as client,
        client.stream(
            "POST",
            up.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        first = await anext(lines)
        assert json.loads(first[6:])["choices"][0]["delta"]["content"] == ""
        assert await anext(lines) == ""
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(lines), 0.3)
    await up.await_disconnect(0)
    assert up.requests[0].chunks_sent == 0


async def test_slow_first_token_non_streaming_delays_the_whole_answer(up: FakeUpstream) -> None:
    up.script(SlowFirstToken(30))
    async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(up.base_url + "/chat/completions", json={"messages": []})
    await up.await_disconnect(0)


@pytest.mark.parametrize("rst", [False, True])
async def test_cut_after_n_chunks(up: FakeUpstream, sdk: openai.AsyncOpenAI, rst: bool) -> None:
    up.script(Cut(2, rst=rst))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    received: list[str | None] = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "one ", "two "]
    assert up.requests[0].chunks_sent == 2
    assert up.requests[0].connection.server_closed_at is not None


async def test_cut_non_streaming_mid_body(up: FakeUpstream) -> None:
    up.script(Cut(0))
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(up.base_url + "/chat/completions", json={"messages": []})


async def test_stall_after_n_chunks_until_the_client_leaves(up: FakeUpstream) -> None:
    up.script(Stall(1))
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.5)) as client,
        client.stream(
            "POST",
            up.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        ) as response,
    ):
        seen: list[str] = []
        with pytest.raises(httpx.ReadTimeout):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
    assert seen == ["", "one "]
    await up.await_disconnect(0)
    assert up.requests[0].chunks_sent == 1


async def test_a_paused_stream_sends_the_rest_once_resumed(up: FakeUpstream) -> None:
    resume = threading.Event()
    up.script(Ok("one two three", paused_after=1, resume=resume))
    async with (
        httpx.AsyncClient(timeout=5) as client,
        client.stream(
            "POST",
            up.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        ) as response,
    ):
        lines = response.aiter_lines()
        seen: list[str] = []
        while seen != ["", "one "]:
            line = await anext(lines)
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
        await asyncio.sleep(0.1)
        assert up.requests[0].chunks_sent == 1  # nothing more until resumed
        resume.set()
        rest = [line async for line in lines if line]
    assert [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in rest[:-1]] == [
        "two ",
        "three",
        None,  # the finishing chunk
    ]
    assert rest[-1] == "data: [DONE]"
    assert up.requests[0].chunks_sent == 3


@pytest.mark.parametrize(("at", "before_error"), [(0, [""]), (2, ["", "one ", "two "])])
async def test_malformed_chunk(
    up: FakeUpstream, sdk: openai.AsyncOpenAI, at: int, before_error: list[str]
) -> None:
    up.script(Malformed(at))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    received: list[str | None] = []
    with pytest.raises(ValueError):
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == before_error


async def test_malformed_non_streaming_body(up: FakeUpstream) -> None:
    up.script(Malformed())
    async with httpx.AsyncClient() as client:
        response = await client.post(up.base_url + "/chat/completions", json={"messages": []})
    with pytest.raises(ValueError):
        response.json()


@pytest.mark.parametrize(("at", "before_error"), [(0, [""]), (1, ["", "one "])])
async def test_error_event(
    up: FakeUpstream, sdk: openai.AsyncOpenAI, at: int, before_error: list[str]
) -> None:
    up.script(ErrorEvent(at, "upstream exploded"))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    received: list[str | None] = []
    with pytest.raises(openai.APIError, match="upstream exploded") as info:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == before_error
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "server_error"


async def test_error_event_raw_stream_has_no_done(up: FakeUpstream) -> None:
    up.script(ErrorEvent(0))
    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    assert "data: [DONE]" not in lines
    assert "error" in payloads(lines)[-1]


async def test_no_done_ends_cleanly_with_finish_reason(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    up.script(NoDone("x y"))
    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    assert "data: [DONE]" not in lines
    assert payloads(lines)[-1]["choices"][0]["finish_reason"] == "stop"
    up.script(NoDone("x y"))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_abort_at_end_leaves_the_body_unterminated(up: FakeUpstream) -> None:
    up.script(Ok("x y", done=False, abort_at_end=True))
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST",
                up.base_url + "/chat/completions",
                json={"model": "m", "messages": MESSAGES, "stream": True},
            ) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
    assert payloads([x for x in lines if x])[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("end", ["clean", "cut", "hold"])
async def test_events_are_sent_verbatim(up: FakeUpstream, end: str) -> None:
    up.script(Events(["event: ping\ndata: {}\n\n", ": note\n\n"], end=end))  # type: ignore[arg-type]
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.3)) as client:
        try:
            async with client.stream(
                "POST", up.base_url + "/chat/completions", json={"stream": True}
            ) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
            outcome = "clean"
        except httpx.RemoteProtocolError:
            outcome = "cut"
        except httpx.ReadTimeout:
            outcome = "hold"
    assert outcome == end
    assert [x for x in lines if x] == ["event: ping", "data: {}", ": note"]
    assert up.requests[0].chunks_sent == 2


async def test_truncated_ends_cleanly_without_finish_reason_or_done(up: FakeUpstream) -> None:
    up.script(Truncated(2))
    lines = await sse_lines(up, {"model": "m", "messages": MESSAGES, "stream": True})
    assert "data: [DONE]" not in lines
    events = payloads(lines)
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["", "one ", "two "]
    assert all(e["choices"][0]["finish_reason"] is None for e in events)


async def test_early_close_mid_stream_is_recorded_as_client_disconnect(
    up: FakeUpstream, sdk: openai.AsyncOpenAI
) -> None:
    up.script(Ok("a b c d e f", chunk_delay=0.2))
    stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    iterator = stream.__aiter__()
    await anext(iterator)
    await anext(iterator)
    closed_at = time.monotonic()
    await stream.close()
    gone = await up.await_disconnect(0, timeout=5)
    assert gone >= closed_at
    record = await up.await_finish(0)
    assert record.chunks_sent < 6
    assert record.connection.server_closed_at is None


async def test_chunk_delay_does_not_hold_the_server_after_disconnect(up: FakeUpstream) -> None:
    up.script(Ok("a b c", chunk_delay=30))
    async with (
        httpx.AsyncClient(timeout=5) as client,
        client.stream(
            "POST",
            up.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        ) as response,
    ):
        await anext(response.aiter_lines())
    record = await up.await_finish(0, timeout=5)
    assert record.chunks_sent == 1


def test_keep_alive_reuses_one_connection(up: FakeUpstream) -> None:
    with httpx.Client() as client:
        for _ in range(3):
            client.post(up.base_url + "/chat/completions", json={"messages": []})
    assert len({r.connection.id for r in up.requests}) == 1
    assert up.connections[0].request_indices == [0, 1, 2]


def test_wait_for_requests_times_out_with_a_clear_error(up: FakeUpstream) -> None:
    with pytest.raises(TimeoutError, match="for 1 chat requests"):
        up.wait_for_requests(1, timeout=0.05)
