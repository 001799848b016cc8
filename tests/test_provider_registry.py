"""A third provider is one class and one registry line: a tiny vendor with its own JSON shape,
registered, named by a config's `type:` and called through the service."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import openai
import pytest
from aiohttp import web

from chatroute.chat import (
    ChatFinishReason,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    EmbeddingGenerator,
    TextContent,
)
from chatroute.config import ConfigError, parse_config
from chatroute.errors import ProviderServerError
from chatroute.providers import HTTPChatClient, StreamTranslator
from chatroute.providers.registry import (
    build_from_config,
    provider_class,
    provider_types,
    register_provider,
)
from chatroute.server import create_app

# ------------------------------------------------------------------- the vendor's API

SEEN = web.AppKey("seen", list)


async def _generate(request: web.Request) -> web.StreamResponse:
    """`POST /api/generate {"model", "prompt", "stream"}`: `{"output", "stop"}` back, or
    one `{"token"}` event per word then `{"stop"}`; a prompt of "fail" is a 503."""
    body = await request.json()
    request.app[SEEN].append((dict(request.headers), body))
    if body["prompt"].endswith("fail"):
        return web.json_response({"problem": "overloaded"}, status=503)
    words = ["tiny ", "says ", "hi"]
    if not body["stream"]:
        return web.json_response({"output": "".join(words), "stop": "done", "model": "t-1"})
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for word in words:
        await response.write(b"data: %s\n\n" % json.dumps({"token": word}).encode())
    await response.write(b'data: {"stop": "done"}\n\n')
    await response.write_eof()
    return response


@contextlib.asynccontextmanager
async def tiny_vendor() -> AsyncIterator[tuple[str, list[Any]]]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/api/generate", _generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", app[SEEN]
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------- the provider: one class


class _Tokens:
    """Reads the vendor's stream: a token per event, then a stop."""

    def __init__(self) -> None:
        self.finished = False
        self.ended = False

    def feed(self, event: str | None, data: str) -> ChatResponseUpdate | None:
        payload = json.loads(data)
        if "stop" in payload:
            self.finished = self.ended = True
            return ChatResponseUpdate(finish_reason=ChatFinishReason.STOP)
        return ChatResponseUpdate(contents=[TextContent(payload["token"])])


class TinyChatClient(HTTPChatClient):
    """The tiny vendor: a prompt in, text out."""

    path = "api/generate"

    def _build_body(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> dict[str, Any]:
        prompt = "\n".join(m.text for m in messages)
        return {"model": self.model, "prompt": prompt, "stream": stream}

    def _read_answer(self, data: dict[str, Any]) -> ChatResponse:
        return ChatResponse(
            messages=[ChatMessage(ChatRole.ASSISTANT, data["output"])],
            model_id=data.get("model"),
            finish_reason=ChatFinishReason.STOP,
        )

    def _translator(self) -> StreamTranslator:
        return _Tokens()


@pytest.fixture(autouse=True)
def tiny_registered() -> Iterator[None]:
    register_provider("tiny", TinyChatClient)  # ... and one registry line
    yield
    from chatroute.providers import registry

    registry._PROVIDERS.pop("tiny", None)


# ------------------------------------------------------------------- the tests

HI = [ChatMessage(ChatRole.USER, "hello")]


def _config(base_url: str) -> dict[str, Any]:
    return {
        "routing": {"default_route": "general"},
        "providers": {
            "small": {
                "type": "tiny",
                "base_url": base_url,
                "model": "t-1",
                "api_key_env": "TINY_KEY",
                "headers": {"x-team": "blue"},
            }
        },
        "routes": {"general": {"utterances": ["hello"], "targets": ["small"]}},
    }


def test_the_config_takes_registered_types_and_names_the_known_ones() -> None:
    assert provider_types()[:2] == ("openai", "anthropic") and "tiny" in provider_types()
    assert provider_class("tiny") is TinyChatClient
    parse_config(_config("http://127.0.0.1:1"), environ={})
    bad = _config("http://127.0.0.1:1")
    bad["providers"]["small"]["type"] = "tinny"
    with pytest.raises(ConfigError, match=r"providers\.small\.type.*known: openai, anthropic"):
        parse_config(bad, environ={})
    with pytest.raises(KeyError, match="unknown provider type"):
        provider_class("tinny")


async def test_a_registered_provider_is_built_from_its_config_entry() -> None:
    async with tiny_vendor() as (url, seen):
        config = parse_config(_config(url), environ={})
        client = build_from_config(
            "small", config.providers["small"], model="t-1", base_url=url, api_key="k-123456"
        )
        assert isinstance(client, TinyChatClient) and client.name == "small"
        async with client:
            answer = await client.get_response(HI)
            updates = [u async for u in client.get_streaming_response(HI)]
            with pytest.raises(ProviderServerError) as caught:
                await client.get_response([ChatMessage(ChatRole.USER, "fail")])
    assert answer.text == "tiny says hi" and answer.model_id == "t-1"
    assert "".join(u.text for u in updates) == "tiny says hi"
    assert updates[0].role is ChatRole.ASSISTANT  # the base's commit rule
    assert updates[-1].finish_reason is ChatFinishReason.STOP
    assert caught.value.status_code == 503 and caught.value.provider == "small"
    headers, body = seen[0]
    assert headers["Authorization"] == "Bearer k-123456" and headers["x-team"] == "blue"
    assert body == {"model": "t-1", "prompt": "hello", "stream": False}


async def test_the_service_routes_to_a_registered_provider(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> None:
    import asyncio

    async with tiny_vendor() as (url, seen):
        environ = {"TINY_KEY": "tiny-key-0123456789"}
        config = parse_config(_config(url), environ=environ)
        app = create_app(config, api_keys=[], environ=environ, embedder=default_embedder())

        def ask() -> tuple[str, str]:
            with serve_app(app) as service:
                client = openai.OpenAI(base_url=f"{service}/v1", api_key="x", max_retries=0)
                msgs: Any = [{"role": "user", "content": "hello"}]
                answer = client.chat.completions.create(model="general", messages=msgs)
                stream = client.chat.completions.create(model="general", messages=msgs, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                client.close()
            return answer.choices[0].message.content or "", text

        answer, streamed = await asyncio.to_thread(ask)
    assert answer == "tiny says hi" and streamed == "tiny says hi"
    assert [body["stream"] for _, body in seen] == [False, True]
    assert all(h["Authorization"] == "Bearer tiny-key-0123456789" for h, _ in seen)
