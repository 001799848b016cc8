"""End to end over real sockets: the openai SDK -> uvicorn running chatroute -> fake upstreams."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from chatroute.chat import EmbeddingGenerator
from chatroute.config import parse_config
from chatroute.server import create_app
from tests.fakes import (
    ContentPolicy,
    Cut,
    ErrorEvent,
    FakeUpstream,
    Ok,
    RateLimited,
    Status,
    ToolCall,
    Unavailable,
)

KEY = "test-key-0123456789"
STRONG_SECRET = "sk-strong-secret-abcdef123456"


class Stack:
    """The running service and its two upstreams."""

    def __init__(self, url: str, fast: FakeUpstream, strong: FakeUpstream, app: Any) -> None:
        self.url = url
        self.app = app
        self.fast = fast
        self.strong = strong
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"})

    def chat(self, text: str, **kwargs: Any) -> Any:
        return self.client.chat.completions.with_raw_response.create(
            model=kwargs.pop("model", "auto"),
            messages=[{"role": "user", "content": text}],
            **kwargs,
        )


def _config(fast: FakeUpstream, strong: FakeUpstream) -> dict[str, Any]:
    return {
        "routing": {"top_k": 3, "threshold": 0.25, "default_route": "general"},
        "providers": {
            "fast": {"base_url": fast.base_url, "model": "small-model"},
            "strong": {
                "base_url": strong.base_url,
                "model": "big-model",
                "api_key_env": "STRONG_KEY",
                "timeouts": {"connect": 2, "read": 10},
            },
        },
        "routes": {
            "code": {
                "utterances": [
                    "fix this bug in my python code",
                    "write a function that sorts a list",
                    "why does my program crash with an exception",
                    "explain this stack trace",
                ],
                "targets": ["fast", "strong"],
                "options": {"temperature": 0.2},
            },
            "math": {
                "utterances": [
                    "solve this equation for x",
                    "compute the integral of x squared",
                    "what is the derivative of sine",
                    "prove the theorem by induction",
                ],
                "targets": ["strong", "fast"],
            },
            "general": {
                "utterances": ["hello, how are you", "tell me a fun fact"],
                "targets": ["strong"],
            },
        },
    }


@pytest.fixture(scope="module")
def stack(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> Iterator[Stack]:
    with FakeUpstream() as fast, FakeUpstream() as strong:
        environ = {"STRONG_KEY": STRONG_SECRET}
        config = parse_config(_config(fast, strong), environ=environ)
        app = create_app(config, api_keys=[KEY], environ=environ, embedder=default_embedder())
        with serve_app(app) as url:
            made = Stack(url, fast, strong, app)
            yield made
            made.client.close()
            made.http.close()


@pytest.fixture(autouse=True)
def fresh(stack: Stack) -> None:
    for up in (stack.fast, stack.strong):
        up.reset()
        up.default = Ok("Hello from the fake upstream.")
    for breaker in stack.app.state.service.engine.breakers:
        breaker.reset()  # each test starts with every provider healthy


# -------------------------------------------------------------------------- routing


def test_routes_by_content_to_the_right_upstream(stack: Stack) -> None:
    raw = stack.chat("there is a bug in my python code, please fix it")
    completion = raw.parse()
    assert raw.headers["x-chatroute-route"] == "code"
    assert raw.headers["x-chatroute-provider"] == "fast"
    assert raw.headers["x-chatroute-attempts"] == "1"
    assert completion.choices[0].message.content == "Hello from the fake upstream."
    assert completion.model == "small-model"  # the provider model that served
    assert completion.usage is not None and completion.usage.prompt_tokens == 10
    assert stack.fast.attempts == 1 and stack.strong.attempts == 0
    sent = stack.fast.requests[0].json
    assert sent["model"] == "small-model" and sent["temperature"] == 0.2  # route options
    assert "authorization" not in stack.fast.requests[0].headers  # no key configured

    raw = stack.chat("solve this equation for x: 3x + 5 = 20")
    assert raw.headers["x-chatroute-route"] == "math"
    assert raw.parse().model == "big-model"
    assert stack.strong.attempts == 1
    # The provider key comes from the environment variable the config names.
    assert stack.strong.requests[0].headers["authorization"] == f"Bearer {STRONG_SECRET}"


def test_streams_by_content(stack: Stack) -> None:
    stack.strong.default = Ok("one two three")
    raw = stack.chat("compute the integral of x squared from 0 to 1", stream=True)
    assert raw.headers["x-chatroute-route"] == "math"
    assert raw.headers["x-chatroute-provider"] == "strong"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert {c.model for c in chunks} == {"big-model"}
    assert stack.strong.requests[0].stream


def test_forced_route_overrides_content(stack: Stack) -> None:
    raw = stack.chat("fix this bug in my python code", model="math")
    assert raw.headers["x-chatroute-route"] == "math"
    assert raw.parse().model == "big-model"
    assert stack.fast.attempts == 0 and stack.strong.attempts == 1


def test_async_sdk_streaming_against_forced_route(stack: Stack) -> None:
    stack.fast.default = Ok("alpha beta")

    async def run() -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0
        ) as client:
            stream = await client.chat.completions.create(
                model="code",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = []
            usage = None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            assert usage is not None and usage.total_tokens > 0
            return "".join(parts)

    assert asyncio.run(run()) == "alpha beta"


# -------------------------------------------------------------------------- failover


def test_fails_over_when_the_primary_returns_503(stack: Stack) -> None:
    stack.fast.script(Unavailable())
    raw = stack.chat("write a function that sorts a list")
    assert raw.headers["x-chatroute-route"] == "code"
    assert raw.headers["x-chatroute-provider"] == "strong"
    assert raw.headers["x-chatroute-attempts"] == "2"
    assert raw.parse().model == "big-model"
    assert stack.fast.attempts == 1 and stack.strong.attempts == 1


def test_streaming_fails_over_before_the_first_token(stack: Stack) -> None:
    stack.fast.script(Unavailable())
    stack.strong.default = Ok("from the fallback")
    raw = stack.chat("write a function that sorts a list", stream=True)
    assert raw.headers["x-chatroute-provider"] == "strong"
    assert raw.headers["x-chatroute-attempts"] == "2"
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == "from the fallback"


def test_all_upstreams_down_is_a_clean_503_before_any_byte(stack: Stack) -> None:
    stack.fast.script(Unavailable())
    stack.strong.script(Unavailable())
    with pytest.raises(openai.APIStatusError) as caught:
        stack.client.chat.completions.create(
            model="code", messages=[{"role": "user", "content": "x"}], stream=True
        )
    assert caught.value.status_code == 503
    assert caught.value.response.headers["x-chatroute-attempts"] == "2"


def test_nothing_reaches_the_caller_before_the_first_content(stack: Stack) -> None:
    # Keep-alives, an empty-choices chunk and the role delta come first; content is late.
    stack.fast.script(
        Ok("late words", first_token_delay=0.3, keepalives=2, empty_choices_first=True)
    )
    with stack.http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "code", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as response:
        # The status line only came once the upstream had sent its first content chunk.
        assert stack.fast.requests[0].chunks_sent >= 1
        assert response.status_code == 200
        body = response.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_mid_stream_cut_raises_in_the_sdk_and_never_fails_over(stack: Stack) -> None:
    stack.fast.script(Cut(2, text="one two three four"))
    stream = stack.client.chat.completions.create(
        model="code", messages=[{"role": "user", "content": "x"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received).split() == ["one", "two"]
    assert "provider 'fast'" in str(caught.value)
    assert stack.strong.attempts == 0  # nothing is retried after output


def test_in_band_error_event_has_no_done(stack: Stack) -> None:
    stack.fast.script(ErrorEvent(at=1, text="one two three"))
    with stack.http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "code", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as response:
        assert response.status_code == 200
        body = response.read().decode()
    assert '"error"' in body
    assert "[DONE]" not in body


def test_rate_limited_everywhere_is_429(stack: Stack) -> None:
    stack.strong.script(RateLimited(retry_after=None))
    stack.fast.script(RateLimited(retry_after=None))
    with pytest.raises(openai.RateLimitError):
        stack.client.chat.completions.create(
            model="math", messages=[{"role": "user", "content": "x"}]
        )
    assert stack.strong.attempts == 1 and stack.fast.attempts == 1


def test_upstream_client_errors_are_returned_as_is(stack: Stack) -> None:
    stack.strong.script(ContentPolicy())
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client.chat.completions.create(
            model="general", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.code == "content_policy_violation"


def test_provider_secrets_stay_out_of_errors(stack: Stack) -> None:
    stack.strong.script(Status(401, message=f"Incorrect API key provided: {STRONG_SECRET}"))
    with pytest.raises(openai.APIStatusError) as caught:
        stack.client.chat.completions.create(
            model="general", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.status_code == 502  # the gateway's key was refused, not the caller's
    assert STRONG_SECRET not in caught.value.response.text


# -------------------------------------------------------------------------- auth, input


def test_auth_is_required(stack: Stack) -> None:
    bad = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="auto", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()
    assert httpx.post(f"{stack.url}/v1/route", json={"input": "x"}).status_code == 401
    assert stack.fast.attempts == 0 and stack.strong.attempts == 0


def test_unknown_route_and_bad_bodies_are_4xx(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        stack.client.chat.completions.create(
            model="no-such-route", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(model="auto", messages=[])
    r = stack.http.post(
        "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = stack.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    assert stack.fast.attempts == 0 and stack.strong.attempts == 0


# -------------------------------------------------------------------------- other APIs


def test_route_and_classify(stack: Stack) -> None:
    r = stack.http.post("/v1/route", json={"input": "prove the theorem by induction on n"})
    assert r.status_code == 200
    decision = r.json()
    assert decision["route"] == "math" and decision["is_default"] is False
    assert set(decision["scores"]) <= {"code", "math", "general"}
    assert decision["matches"][0]["utterance"] == "prove the theorem by induction"
    r = stack.http.post(
        "/v1/classify",
        json={
            "inputs": [
                "my python program crashes with an exception",
                "what is the derivative of x cubed",
                "",
                {"messages": [{"role": "user", "content": "hello, how are you doing"}]},
            ]
        },
    )
    assert r.status_code == 200
    routes = [d["route"] for d in r.json()["data"]]
    assert routes == ["code", "math", "general", "general"]
    assert stack.fast.attempts == 0 and stack.strong.attempts == 0


def test_models_lists_routes(stack: Stack) -> None:
    ids = [m.id for m in stack.client.models.list()]
    assert ids == ["auto", "code", "math", "general", "sentence-transformers/all-MiniLM-L6-v2"]


def test_metrics_report_routes_providers_failovers_and_embedder(stack: Stack) -> None:
    stack.fast.script(Unavailable())
    stack.chat("write a function that sorts a list")
    text = httpx.get(f"{stack.url}/metrics").text
    assert 'chatroute_failovers_total{provider="fast",route="code"}' in text
    assert (
        'chatroute_provider_attempts_total{outcome="success",provider="strong",route="code"}'
        in text
    )
    assert 'chatroute_requests_total{endpoint="chat_completions",route="code",status="200"}' in text
    assert "chatroute_provider_attempt_duration_seconds_bucket" in text
    assert "chatroute_embedder_queue_depth" in text
    batches = [
        line for line in text.splitlines() if line.startswith("chatroute_embedder_batch_size_count")
    ]
    assert batches and float(batches[0].split()[-1]) >= 1


# -------------------------------------------------------------------------- images, audio, files

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def test_images_audio_and_files_reach_the_upstream_as_sent_and_route_by_the_text(
    stack: Stack,
) -> None:
    parts: list[Any] = [
        {"type": "text", "text": "there is a bug in my python code, "},
        {"type": "image_url", "image_url": {"url": PNG, "detail": "high"}},
        {"type": "text", "text": "this screenshot shows the stack trace"},
        {"type": "image_url", "image_url": {"url": "https://example.com/trace.png"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "log.pdf"},
        },
        {"type": "file", "file": {"file_id": "file-abc123"}},
    ]
    raw = stack.client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": parts},
        ],
    )
    # The text parts decide the route; the media travel on untouched, in their order.
    assert raw.headers["x-chatroute-route"] == "code"
    assert raw.parse().choices[0].message.content == "Hello from the fake upstream."
    sent = stack.fast.requests[0].json["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[1] == {"role": "user", "content": parts}


def test_an_image_only_message_goes_to_the_default_route_streaming(stack: Stack) -> None:
    stack.strong.default = Ok("a cat")
    stream = stack.client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}],
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "a cat"
    sent = stack.strong.requests[0].json["messages"]
    assert sent == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]


@pytest.mark.parametrize(
    ("part", "param", "fragment"),
    [
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, ".image_url.url", "http"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png,abc"}},
            ".image_url.url",
            "base64",
        ),
        ({"type": "image_url"}, ".image_url", "needs"),
        (
            {"type": "input_audio", "input_audio": {"data": "AA==", "format": "ogg"}},
            ".input_audio.format",
            "wav, mp3",
        ),
        ({"type": "file", "file": {"filename": "a.pdf"}}, ".file", "file_data or file_id"),
        ({"type": "video_url", "video_url": {"url": "https://x"}}, "", "not supported"),
    ],
)
def test_a_malformed_media_part_is_400_naming_the_field(
    stack: Stack, part: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client.chat.completions.create(
            model="code",
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == f"messages[0].content[1]{param}"
    assert fragment in error["message"]
    assert stack.fast.attempts == 0 and stack.strong.attempts == 0


def test_media_outside_user_messages_is_400(stack: Stack) -> None:
    r = stack.http.post(
        "/v1/chat/completions",
        json={
            "model": "code",
            "messages": [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG}}]},
                {"role": "user", "content": "hi"},
            ],
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert "user messages" in r.json()["error"]["message"]
    assert stack.fast.attempts == 0


def test_route_reads_the_text_of_a_message_with_an_image(stack: Stack) -> None:
    r = stack.http.post(
        "/v1/route",
        json={
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": PNG}},
                        {"type": "text", "text": "solve this equation for x"},
                    ],
                }
            ]
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["route"] == "math"


# -------------------------------------------------------------------------- refusals, logprobs


def test_a_refusal_reaches_the_caller_whole_and_streamed(stack: Stack) -> None:
    stack.fast.default = Ok("", refusal="I can't help with that.")
    completion = stack.chat("fix this bug", model="code").parse()
    message = completion.choices[0].message
    assert message.refusal == "I can't help with that."
    assert message.content is None

    stream = stack.client.chat.completions.create(
        model="code", messages=[{"role": "user", "content": "fix this bug"}], stream=True
    )
    chunks = list(stream)
    refusal = "".join(c.choices[0].delta.refusal or "" for c in chunks if c.choices)
    assert refusal == "I can't help with that."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_reach_the_caller_whole_and_streamed(stack: Stack) -> None:
    stack.fast.default = Ok("two words", logprobs=True)
    completion = stack.chat("fix this bug", model="code", logprobs=True).parse()
    assert stack.fast.requests[0].json["logprobs"] is True  # the request field is forwarded
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == ["two ", "words"]
    assert logprobs.content[0].logprob == -0.25

    stream = stack.client.chat.completions.create(
        model="code",
        messages=[{"role": "user", "content": "fix this bug"}],
        stream=True,
        logprobs=True,
    )
    tokens = [
        t.token
        for c in stream
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == ["two ", "words"]


def test_cached_and_reasoning_token_counts_and_the_fingerprint_reach_the_caller(
    stack: Stack,
) -> None:
    details = {
        "prompt_tokens_details": {"cached_tokens": 6},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    stack.fast.default = Ok("done", usage_extra=details, system_fingerprint="fp_42")
    completion = stack.chat("fix this bug", model="code").parse()
    assert completion.system_fingerprint == "fp_42"
    usage = completion.usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 6
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 4

    stream = stack.client.chat.completions.create(
        model="code",
        messages=[{"role": "user", "content": "fix this bug"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 6
    assert last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.reasoning_tokens == 4


# -------------------------------------------------------------------------- a tool loop

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_with_the_sdk_objects_sent_back(stack: Stack, stream: bool) -> None:
    """The agent loop as SDK users write it: the assistant message the SDK returned is
    appended as it is, then the tool's result, and the model answers."""
    stack.strong.script(
        Ok("", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', id="call_w1")]),
        Ok("It is sunny in Paris."),
    )
    messages: list[Any] = [{"role": "user", "content": "what is the weather in Paris?"}]
    if stream:
        chunks = list(
            stack.client.chat.completions.create(
                model="general", messages=messages, tools=[WEATHER_TOOL], stream=True
            )
        )
        calls: dict[int, dict[str, str]] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert calls == {
            0: {"id": "call_w1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
        }
        messages.append(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls.values()
                ],
            }
        )
    else:
        first = stack.client.chat.completions.create(
            model="general", messages=messages, tools=[WEATHER_TOOL]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        call = choice.message.tool_calls[0]
        assert call.id == "call_w1" and call.function.name == "get_weather"
        messages.append(choice.message)  # the SDK's own object, sent back as it is
    messages.append({"role": "tool", "tool_call_id": "call_w1", "content": '{"sky": "sunny"}'})
    second = stack.client.chat.completions.create(
        model="general", messages=messages, tools=[WEATHER_TOOL]
    )
    assert second.choices[0].message.content == "It is sunny in Paris."

    first_sent, second_sent = (r.json for r in stack.strong.requests)
    assert first_sent["tools"] == [WEATHER_TOOL]
    assert second_sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_w1", "content": '{"sky": "sunny"}'},
    ]


def test_a_refused_turn_sent_back_in_the_history_is_forwarded(stack: Stack) -> None:
    """A conversation replayed after a refusal: the assistant turn has no content, only the
    refusal (as the field the API returned, or as a refusal part)."""
    stack.fast.default = Ok("Sure, here is a safer way.")
    for refused in (
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "I can't help with that."}],
        },
    ):
        stack.fast.reset()
        answer = stack.client.chat.completions.create(
            model="code",
            messages=[
                {"role": "user", "content": "fix this bug"},
                refused,
                {"role": "user", "content": "then explain it"},
            ],
        )
        assert answer.choices[0].message.content == "Sure, here is a safer way."
        sent = stack.fast.requests[0].json["messages"][1]
        assert sent == {"role": "assistant", "content": None, "refusal": "I can't help with that."}
