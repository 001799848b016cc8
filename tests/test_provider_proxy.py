"""Providers reach their endpoint through the proxy the environment names, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from chatroute.chat import ChatMessage, ChatRole
from chatroute.providers import OpenAIChatClient
from chatroute.providers.anthropic_messages import AnthropicChatClient
from tests.fakes import FakeUpstream, Ok

USER = [ChatMessage(ChatRole.USER, "hi")]
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def clean_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@dataclass
class Seen:
    """What the proxy was asked: request lines, and the JSON bodies."""

    lines: list[str] = field(default_factory=list)
    bodies: list[Any] = field(default_factory=list)


@contextlib.asynccontextmanager
async def forward_proxy(
    answer: Callable[[Any], tuple[str, bytes]],
) -> AsyncIterator[tuple[str, Seen]]:
    """A plain-HTTP forward proxy that answers every request itself, as the origin behind
    it would (`answer(body)` gives the content type and body); its URL and what it saw."""
    seen = Seen()
    handlers: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length)) if length else None
                seen.lines.append(lines[0])
                seen.bodies.append(body)
                kind, payload = answer(body)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                    % (kind.encode(), len(payload), payload)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the proxy stops: end quietly
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
        finally:
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers)


def _openai_answer(body: Any) -> tuple[str, bytes]:
    if body.get("stream"):
        chunk = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "via proxy"}, "finish_reason": "stop"}],
        }
        return "text/event-stream", b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(chunk).encode()
    completion = {
        "id": "c1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "via proxy"},
                "finish_reason": "stop",
            }
        ],
    }
    return "application/json", json.dumps(completion).encode()


def _anthropic_answer(body: Any) -> tuple[str, bytes]:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "c",
        "content": [{"type": "text", "text": "via proxy"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }
    return "application/json", json.dumps(message).encode()


async def test_the_openai_provider_goes_through_the_environment_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with forward_proxy(_openai_answer) as (proxy, seen):
        monkeypatch.setenv("HTTP_PROXY", proxy)
        # A host that does not resolve: only the proxy can answer for it.
        async with OpenAIChatClient("m", base_url="http://upstream.invalid/v1") as client:
            response = await client.get_response(USER)
            streamed = [u.text async for u in client.get_streaming_response(USER)]
    assert response.text == "via proxy"
    assert "".join(streamed) == "via proxy"
    assert seen.lines == ["POST http://upstream.invalid/v1/chat/completions HTTP/1.1"] * 2
    assert [bool(body.get("stream")) for body in seen.bodies] == [False, True]


async def test_the_anthropic_provider_goes_through_the_environment_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with forward_proxy(_anthropic_answer) as (proxy, seen):
        monkeypatch.setenv("HTTP_PROXY", proxy)
        async with AnthropicChatClient("c", base_url="http://upstream.invalid") as client:
            response = await client.get_response(USER)
    assert response.text == "via proxy"
    assert seen.lines == ["POST http://upstream.invalid/v1/messages HTTP/1.1"]


async def test_no_proxy_keeps_a_local_endpoint_direct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakeUpstream() as up:
        up.script(Ok("direct"))
        async with forward_proxy(_openai_answer) as (proxy, seen):
            monkeypatch.setenv("HTTP_PROXY", proxy)
            monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
            async with OpenAIChatClient("m", base_url=up.base_url) as client:
                response = await client.get_response(USER)
    assert response.text == "direct"
    assert up.attempts == 1 and seen.lines == []
