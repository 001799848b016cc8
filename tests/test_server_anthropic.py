"""The service with an Anthropic provider, end to end: the openai SDK, chatroute, fake upstreams."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from chatroute.chat import EmbeddingGenerator
from chatroute.config import ConfigError, parse_config
from chatroute.server import create_app
from tests.fakes import FakeUpstream, Ok, Status, ToolCall, Unavailable
from tests.fakes.anthropic import FakeAnthropic

KEY = "test-key-0123456789"
CLAUDE_SECRET = "sk-ant-claude-secret-abcdef123456"


class Stack:
    def __init__(self, url: str, gpt: FakeUpstream, claude: FakeAnthropic) -> None:
        self.url = url
        self.gpt = gpt
        self.claude = claude
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    def chat(self, route: str, text: str = "hello", **kwargs: Any) -> Any:
        return self.client.chat.completions.with_raw_response.create(
            model=route, messages=[{"role": "user", "content": text}], **kwargs
        )


def _config(gpt: FakeUpstream, claude: FakeAnthropic) -> dict[str, Any]:
    return {
        "routing": {"top_k": 3, "threshold": 0.25, "default_route": "general"},
        "providers": {
            "gpt": {"base_url": gpt.base_url, "model": "gpt-fake"},
            "claude": {
                "type": "anthropic",
                "base_url": claude.url,
                "model": "claude-fake",
                "api_key_env": "CLAUDE_KEY",
                "default_max_tokens": 512,
                "timeouts": {"first_token": 5},
            },
        },
        "routes": {
            "general": {
                "utterances": ["hello, how are you", "tell me a fun fact"],
                "targets": ["gpt", "claude"],
            },
            "claude": {"targets": ["claude"], "options": {"temperature": 0.3}},
            "quick": {"targets": ["claude", "gpt"], "timeouts": {"first_token": 0.5}},
        },
    }


@pytest.fixture(scope="module")
def stack(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> Iterator[Stack]:
    with FakeUpstream() as gpt, FakeAnthropic() as claude:
        environ = {"CLAUDE_KEY": CLAUDE_SECRET}
        config = parse_config(_config(gpt, claude), environ=environ)
        app = create_app(config, api_keys=[KEY], environ=environ, embedder=default_embedder())
        with serve_app(app) as url:
            made = Stack(url, gpt, claude)
            yield made
            made.client.close()
            for breaker in app.state.service.engine.breakers:
                breaker.reset()


@pytest.fixture(autouse=True)
def fresh(stack: Stack) -> None:
    for up in (stack.gpt, stack.claude):
        up.reset()
        up.default = Ok("Hello from the fake upstream.")


def test_a_route_served_by_anthropic(stack: Stack) -> None:
    stack.claude.script(Ok("Bonjour.", prompt_tokens=11, completion_tokens=2))
    raw = stack.chat("claude", "say hello in French", max_tokens=50)
    completion = raw.parse()
    assert raw.headers["x-chatroute-provider"] == "claude"
    assert completion.model == "claude-fake"
    assert completion.choices[0].message.content == "Bonjour."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 2)
    sent = stack.claude.requests[0]
    assert sent.path == "/v1/messages"
    assert sent.json["model"] == "claude-fake" and sent.json["max_tokens"] == 50
    assert sent.json["temperature"] == 0.3  # the route's options
    assert sent.headers["authorization"] == f"Bearer {CLAUDE_SECRET}"


def test_the_configured_default_max_tokens_is_sent(stack: Stack) -> None:
    stack.chat("claude")
    assert stack.claude.requests[0].json["max_tokens"] == 512


def test_streams_from_anthropic_with_usage(stack: Stack) -> None:
    stack.claude.script(Ok("one two three", prompt_tokens=4, completion_tokens=3))
    stream = stack.client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": "count"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7
    assert {c.model for c in chunks} == {"claude-fake"}


def test_tool_calls_stream_in_the_openai_shape(stack: Stack) -> None:
    stack.claude.script(Ok("", tool_calls=[ToolCall("lookup", '{"q": "x"}', id="toolu_7")]))
    stream = stack.client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": "look it up"}],
        tools=[
            {
                "type": "function",
                "function": {"name": "lookup", "parameters": {"type": "object"}},
            }
        ],
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert calls == {0: {"id": "toolu_7", "name": "lookup", "arguments": '{"q": "x"}'}}
    assert finish == "tool_calls"
    sent = stack.claude.requests[0].json
    assert sent["tools"] == [{"name": "lookup", "input_schema": {"type": "object"}}]


def test_fails_over_from_openai_to_anthropic(stack: Stack) -> None:
    stack.gpt.script(Unavailable())
    raw = stack.chat("general")
    assert raw.headers["x-chatroute-provider"] == "claude"
    assert raw.headers["x-chatroute-attempts"] == "2"
    assert raw.parse().model == "claude-fake"
    assert stack.gpt.attempts == 1 and stack.claude.attempts == 1


def test_a_slow_first_token_from_anthropic_fails_over(stack: Stack) -> None:
    stack.claude.script(Ok("too late", first_token_delay=3.0, hold_open=True))
    stack.gpt.script(Ok("in time"))
    stream = stack.client.chat.completions.with_raw_response.create(
        model="quick", messages=[{"role": "user", "content": "x"}], stream=True
    )
    assert stream.headers["x-chatroute-provider"] == "gpt"
    assert stream.headers["x-chatroute-attempts"] == "2"
    text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    assert text == "in time"
    stack.claude.wait_for_disconnect(0, timeout=5)  # the slow stream was closed, not left open


def test_anthropic_overloaded_mid_stream_raises_in_the_sdk(stack: Stack) -> None:
    stack.claude.script(Ok("one two three", error_at=2))
    stream = stack.client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "x"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "one two "
    assert "provider 'claude'" in str(caught.value)


def test_anthropic_client_errors_reach_the_caller_without_the_key(stack: Stack) -> None:
    stack.claude.script(
        Status(400, message=f"prompt is too long: 300000 tokens > 200000 ({CLAUDE_SECRET})")
    )
    with pytest.raises(openai.BadRequestError) as caught:
        stack.chat("claude")
    assert "prompt is too long" in str(caught.value)
    assert CLAUDE_SECRET not in caught.value.response.text
    assert json.loads(caught.value.response.text)["error"]["code"] == "context_length"


def test_config_names_the_anthropic_keys_at_fault() -> None:
    base = {
        "routing": {"default_route": "r"},
        "routes": {"r": {"utterances": ["hi"], "targets": ["c"]}},
    }
    # No base_url is needed: the Messages API has a default one.
    config = parse_config(
        {**base, "providers": {"c": {"type": "anthropic", "model": "claude-x"}}}, environ={}
    )
    assert config.providers["c"].type == "anthropic"
    with pytest.raises(ConfigError, match=r"providers\.c\.type"):
        parse_config({**base, "providers": {"c": {"type": "claude", "model": "m"}}}, environ={})
    with pytest.raises(ConfigError, match=r"providers\.c\.default_max_tokens"):
        parse_config(
            {
                **base,
                "providers": {"c": {"type": "anthropic", "model": "m", "default_max_tokens": 0}},
            },
            environ={},
        )


PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def test_images_and_pdfs_become_anthropic_blocks(stack: Stack) -> None:
    stack.client.chat.completions.create(
        model="claude",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare these"},
                    {"type": "image_url", "image_url": {"url": PNG}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
                    {
                        "type": "file",
                        "file": {
                            "file_data": "data:application/pdf;base64,JVBERi0=",
                            "filename": "r.pdf",
                        },
                    },
                ],
            }
        ],
    )
    content = stack.claude.requests[0].json["messages"][0]["content"]
    assert content == [
        {"type": "text", "text": "compare these"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": PNG.split(",")[1]},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
            "title": "r.pdf",
        },
    ]


def test_audio_for_anthropic_is_400_and_not_sent(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client.chat.completions.create(
            model="claude",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "AA==", "format": "mp3"}}
                    ],
                }
            ],
        )
    assert "audio/mpeg" in str(caught.value)
    assert stack.claude.requests == []


def test_anthropic_drops_what_it_cannot_take_and_names_it(stack: Stack) -> None:
    raw = stack.chat("claude", seed=3, logprobs=True, extra_body={"min_p": 0.1, "top_k": 20}, n=1)
    assert raw.headers["x-chatroute-provider"] == "claude"
    assert raw.headers["x-chatroute-ignored-params"] == "logprobs,min_p,seed,top_k"
    sent = stack.claude.requests[0].json
    assert not {"seed", "logprobs", "min_p", "top_k", "n"} & set(sent)


def test_anthropic_names_what_it_dropped_in_a_stream_too(stack: Stack) -> None:
    raw = stack.chat("claude", stream=True, extra_body={"repetition_penalty": 1.1})
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert raw.headers["x-chatroute-ignored-params"] == "repetition_penalty"


def test_n_above_1_on_anthropic_is_a_clear_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.chat("claude", n=2)
    assert "n=2" in str(caught.value) and "one choice" in str(caught.value)
    assert stack.claude.attempts == 0  # refused before anything was sent
