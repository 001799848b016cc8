"""HTTP-layer tests of the service app, on in-process provider doubles and a tiny embedder."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    TextReasoningContent,
    UsageDetails,
)
from chatroute.config import parse_config
from chatroute.errors import kind_for_status
from chatroute.providers import ProviderError, ProviderStatusError, StreamInterruptedError
from chatroute.server import build_engine, create_app
from chatroute.server.wire import StreamEncoder
from tests.semantic_doubles import BagOfWordsEmbedder

# ------------------------------------------------------------------------------ doubles


def upstream_error(status: int, message: str, code: str | None = None) -> ProviderError:
    """The typed error a provider raises for an HTTP error status."""
    kind = kind_for_status(status, code, message)
    return ProviderStatusError(
        f"HTTP {status}: {message}",
        provider="double",
        kind=kind,
        status_code=status,
        error_code=code,
        error_message=message,
    )


class Provider(ChatClient):
    """A scripted provider: each call takes the next step (or the default) from its script."""

    def __init__(self, name: str, text: str = "hello") -> None:
        self.name = name
        self.text = text
        self.script: list[Any] = []
        self.calls: list[tuple[list[ChatMessage], ChatOptions | None]] = []
        self.closed = False

    def _next(self) -> Any:
        return self.script.pop(0) if self.script else self.text

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        self.calls.append((list(messages), options))
        step = self._next()
        if isinstance(step, BaseException):
            raise step
        return ChatResponse(
            messages=[ChatMessage(ChatRole.ASSISTANT, step)],
            finish_reason="stop",
            usage=UsageDetails(3, 2, 5),
            response_id="resp-1",
        )

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        self.calls.append((list(messages), options))
        step = self._next()
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, tuple):  # (text pieces, exception after them)
            pieces, failure = step
        else:
            pieces, failure = step.split(" "), None
        yield ChatResponseUpdate(role=ChatRole.ASSISTANT)  # role only: not content
        for piece in pieces:
            await asyncio.sleep(0)
            yield ChatResponseUpdate(contents=[TextContent(piece)])
        if failure is not None:
            raise failure
        yield ChatResponseUpdate(finish_reason="stop", usage=UsageDetails(3, 2, 5))

    async def aclose(self) -> None:
        self.closed = True


CONFIG = {
    "routing": {"top_k": 3, "threshold": 0.3, "default_route": "general"},
    "providers": {
        "fast": {"base_url": "http://127.0.0.1:1/v1", "model": "small-model"},
        "strong": {"base_url": "http://127.0.0.1:2/v1", "model": "big-model"},
    },
    "routes": {
        "code": {
            "utterances": ["fix this python bug", "write a python function", "debug my code"],
            "targets": ["fast", "strong"],
            "options": {"temperature": 0.2},
        },
        "math": {
            "utterances": ["solve this equation", "integral of x squared", "prove the theorem"],
            "targets": ["strong"],
        },
        "general": {"targets": ["strong"]},
    },
    "server": {"max_body_bytes": 4096, "max_messages": 8, "max_classify_inputs": 4},
}


class Harness:
    """The app over doubles, with a started TestClient."""

    def __init__(
        self, client: TestClient, embedder: BagOfWordsEmbedder, fast: Provider, strong: Provider
    ) -> None:
        self.client = client
        self.embedder = embedder
        self.fast = fast
        self.strong = strong

    def chat(self, text: str, headers: dict[str, str] | None = None, **body: Any) -> Any:
        payload = {"model": "auto", "messages": [{"role": "user", "content": text}], **body}
        return self.client.post("/v1/chat/completions", json=payload, headers=headers)


@contextlib.contextmanager
def harness(api_keys: Sequence[str] = ()) -> Iterator[Harness]:
    config = parse_config(CONFIG, environ={})
    embedder = BagOfWordsEmbedder()
    fast, strong = Provider("fast", "quick answer"), Provider("strong", "careful answer")
    engine = build_engine(
        config, embedder=embedder, providers={"fast": fast, "strong": strong}, environ={}
    )
    app = create_app(engine, api_keys=api_keys)
    with TestClient(app) as client:
        yield Harness(client, embedder, fast, strong)
    asyncio.run(engine.aclose())
    assert fast.closed and strong.closed and embedder.closed


@pytest.fixture
def h() -> Iterator[Harness]:
    with harness() as made:
        yield made


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -------------------------------------------------------------------------------- chat


def test_auto_routes_by_content_and_reports_route_provider_attempts(h: Harness) -> None:
    r = h.chat("please fix this python bug in my code")
    assert r.status_code == 200
    assert r.headers["x-chatroute-route"] == "code"
    assert r.headers["x-chatroute-provider"] == "fast"
    assert r.headers["x-chatroute-attempts"] == "1"
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "small-model"  # the provider model that served
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "quick answer"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # The route's options were applied on a clone: temperature 0.2 reached the provider.
    _, options = h.fast.calls[0]
    assert options is not None and options.temperature == 0.2


def test_unmatched_text_goes_to_default_route(h: Harness) -> None:
    r = h.chat("what a lovely afternoon for a walk")
    assert r.status_code == 200
    assert r.headers["x-chatroute-route"] == "general"
    assert r.json()["choices"][0]["message"]["content"] == "careful answer"


def test_model_names_a_route_to_force_it(h: Harness) -> None:
    r = h.chat("please fix this python bug", model="math")
    assert r.status_code == 200
    assert r.headers["x-chatroute-route"] == "math"
    assert r.headers["x-chatroute-provider"] == "strong"
    assert h.fast.calls == []


def test_absent_model_routes_semantically(h: Harness) -> None:
    payload = {"messages": [{"role": "user", "content": "solve this equation for x"}]}
    r = h.client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200
    assert r.headers["x-chatroute-route"] == "math"


def test_unknown_model_is_404_in_openai_shape(h: Harness) -> None:
    r = h.chat("hi", model="nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "nope" in err["message"] and "code" in err["message"]


def test_failover_when_primary_is_unavailable(h: Harness) -> None:
    h.fast.script.append(upstream_error(503, "overloaded"))
    r = h.chat("write a python function")
    assert r.status_code == 200
    assert r.headers["x-chatroute-provider"] == "strong"
    assert r.headers["x-chatroute-attempts"] == "2"
    assert r.json()["model"] == "big-model"
    metrics = h.client.get("/metrics").text
    assert 'chatroute_failovers_total{provider="fast",route="code"} 1.0' in metrics
    assert (
        'chatroute_provider_attempts_total{outcome="failed",provider="fast",route="code"} 1.0'
        in metrics
    )


def test_all_providers_failing_answers_upstream_status(h: Harness) -> None:
    h.fast.script.append(upstream_error(503, "fast is down"))
    h.strong.script.append(upstream_error(500, "strong broke"))
    r = h.chat("write a python function")
    assert r.status_code == 502  # an upstream 500 is a bad gateway for our caller
    assert r.headers["x-chatroute-attempts"] == "2"
    assert r.json()["error"]["message"] == "provider 'double' answered HTTP 500: strong broke"


def test_rate_limited_upstream_answers_429(h: Harness) -> None:
    h.strong.script.append(upstream_error(429, "slow down", "rate_limit_exceeded"))
    r = h.chat("hello there", model="general")
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_upstream_timeout_answers_504(h: Harness) -> None:
    h.strong.script.append(TimeoutError())
    r = h.chat("hello there", model="general")
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


def test_secrets_never_reach_the_caller() -> None:
    with harness(api_keys=["chatroute-key-1"]) as h:
        h.client.app.state.service.redact.add("sk-provider-secret")  # type: ignore[attr-defined]
        h.strong.script.append(
            upstream_error(400, "bad request: sk-provider-secret / chatroute-key-1")
        )
        r = h.chat("hello", model="general", headers={"authorization": "Bearer chatroute-key-1"})
        assert r.status_code == 400
        assert "sk-provider-secret" not in r.text and "chatroute-key-1" not in r.text
        message = r.json()["error"]["message"]
        assert message.startswith("bad request: ") and message.count("***") == 2


# ----------------------------------------------------------------------------- streaming


def test_stream_sends_chunks_then_done_with_headers(h: Harness) -> None:
    with h.client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "code",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x"}],
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-chatroute-route"] == "code"
        assert r.headers["x-chatroute-provider"] == "fast"
        assert r.headers["x-chatroute-attempts"] == "1"
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "quick"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "quickanswer"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["model"] == "small-model" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_stream_fails_over_before_first_content(h: Harness) -> None:
    h.fast.script.append(upstream_error(503, "busy"))
    with h.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "code", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        assert r.headers["x-chatroute-provider"] == "strong"
        assert r.headers["x-chatroute-attempts"] == "2"
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"


def test_stream_failure_before_content_is_a_json_error(h: Harness) -> None:
    h.fast.script.append(upstream_error(503, "busy"))
    h.strong.script.append(upstream_error(503, "also busy"))
    r = h.client.post(
        "/v1/chat/completions",
        json={"model": "code", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == "provider 'double' answered HTTP 503: also busy"


def test_stream_failure_after_content_is_in_band_without_done(h: Harness) -> None:
    h.fast.script.append(
        (["one", "two"], StreamInterruptedError("connection cut", provider="fast"))
    )
    with h.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "code", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode())
    assert "[DONE]" not in events
    assert events[-1]["error"]["message"] == "provider 'fast': connection cut"
    assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["one", "two"]
    assert h.strong.calls == []  # nothing fails over after output
    metrics = h.client.get("/metrics").text
    assert 'outcome="failed_after_output",provider="fast",route="code"} 1.0' in metrics


# ------------------------------------------------------------------------ wire mapping


def test_the_stream_encoder_keeps_the_upstreams_id_and_model_and_maps_every_kind_of_delta() -> None:
    encoder = StreamEncoder(model="configured-model", include_usage=True)
    updates = [
        ChatResponseUpdate(
            role=ChatRole.ASSISTANT,
            contents=[TextReasoningContent("thinking")],
            model_id="served-model",
            response_id="resp-9",
        ),
        ChatResponseUpdate(contents=[FunctionCallContent("call-a", "lookup", '{"q":')]),
        ChatResponseUpdate(contents=[FunctionCallContent("call-b", "fetch", "{}")]),
        ChatResponseUpdate(contents=[FunctionCallContent("call-a", None, '"x"}')]),
        ChatResponseUpdate(finish_reason="tool_calls", usage=UsageDetails(3, 2, 5)),
    ]
    out = b"".join(encoder.encode(u) for u in updates) + encoder.finish()
    events = sse_events(out.decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"resp-9"}  # the upstream's id, on every chunk
    assert {c["model"] for c in chunks} == {"served-model"}  # the model that served
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "reasoning_content": "thinking"}
    calls = [d["tool_calls"][0] for d in deltas[1:4]]
    assert [(c["index"], c.get("id")) for c in calls] == [
        (0, "call-a"),
        (1, "call-b"),
        (0, "call-a"),
    ]
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"q":'}
    assert calls[2]["function"] == {"arguments": '"x"}'}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_roles_content_parts_tools_and_params_map_to_chat_types(h: Harness) -> None:
    body = {
        "model": "general",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "temperature": 0.7,
        "top_p": 0.9,
        "max_completion_tokens": 64,
        "stop": "END",
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "user": "u1",
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "reasoning_effort": "low",
    }
    r = h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    messages, options = h.strong.calls[0]
    assert [m.role for m in messages] == [
        ChatRole.SYSTEM,
        ChatRole.USER,
        ChatRole.ASSISTANT,
        ChatRole.TOOL,
    ]
    assert messages[0].text == "be brief" and messages[1].text == "ab"
    call = messages[2].contents[0]
    assert isinstance(call, FunctionCallContent)
    assert (call.call_id, call.name, call.arguments) == ("c1", "f", "{}")
    result = messages[3].contents[0]
    assert isinstance(result, FunctionResultContent) and result.call_id == "c1"
    assert result.result == "42"
    assert options is not None
    assert (options.temperature, options.top_p, options.max_output_tokens) == (0.7, 0.9, 64)
    assert options.stop_sequences == ["END"] and options.seed == 7 and options.user == "u1"
    assert (options.presence_penalty, options.frequency_penalty) == (0.1, 0.2)
    assert options.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert options.tool_choice == "auto"
    assert options.response_format == {"type": "json_object"}
    assert options.reasoning == {"effort": "low"}
    # max_completion_tokens is kept by name, to reach OpenAI-compatible upstreams as sent
    assert options.additional_properties == {
        "parallel_tool_calls": False,
        "max_completion_tokens": 64,
    }
    assert options.model_id is None  # the route's provider decides the model


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("payload", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'"just a string"', 400, "JSON object"),
        (b"", 400, "body is required"),
        (b"\xff\xfe\x00garbage", 400, ""),
        (b"[" * 100_000 + b"]" * 100_000, 413, "exceeds"),
        (json.dumps({"model": "auto", "messages": []}).encode(), 400, "at least one message"),
        (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": [{"role": "user"}]}).encode(), 400, "content is required"),
        (
            json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(),
            400,
            "tool_call_id",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
            400,
            "messages[0].content",
        ),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
            ).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(),
            400,
            "n:",
        ),
        (
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                        }
                    ]
                }
            ).encode(),
            400,
            "image_url",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}] * 9}).encode(),
            400,
            "at most 8 messages",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 413, ""),
    ],
)
def test_bad_chat_input_is_4xx_in_openai_shape(
    h: Harness, payload: bytes, status: int, fragment: str
) -> None:
    r = h.client.post(
        "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"]
    assert h.fast.calls == [] and h.strong.calls == []


def test_deeply_nested_json_is_400_not_500(h: Harness) -> None:
    nested = b'{"messages": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    r = h.client.post(
        "/v1/chat/completions", content=nested, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_body"


def test_unknown_path_and_method_are_openai_shaped(h: Harness) -> None:
    r = h.client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = h.client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ---------------------------------------------------------------------------------- auth


def test_api_keys_guard_every_v1_path() -> None:
    with harness(api_keys=["key-one", "key-two"]) as h:
        payload = {"input": "solve this equation"}
        assert h.client.post("/v1/route", json=payload).status_code == 401
        r = h.client.post("/v1/route", json=payload, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "wrong" not in r.text and "key-one" not in r.text
        r = h.client.post("/v1/route", json=payload, headers={"authorization": "Basic key-one"})
        assert r.status_code == 401
        assert h.client.get("/v1/models").status_code == 401
        # Unauthenticated bad input is refused for the missing key, not parsed.
        assert h.client.post("/v1/chat/completions", content=b"{").status_code == 401
        for header in ("Bearer key-two", "Bearer key-one", "bearer  key-one"):  # any of them
            ok = h.client.post("/v1/route", json=payload, headers={"authorization": header})
            assert ok.status_code == 200, header
        # Health and metrics stay open for probes and scrapers.
        assert h.client.get("/healthz").status_code == 200
        assert h.client.get("/readyz").status_code == 200
        assert h.client.get("/metrics").status_code == 200


# ------------------------------------------------------------------------ route/classify


def test_route_endpoint_takes_input_or_messages(h: Harness) -> None:
    r = h.client.post("/v1/route", json={"input": "solve this equation please"})
    assert r.status_code == 200
    body = r.json()
    assert body["route"] == "math" and body["is_default"] is False
    assert body["score"] == pytest.approx(max(body["scores"].values()))
    assert body["matches"][0]["route"] == "math"
    assert body["matches"][0]["utterance"] == "solve this equation"
    r = h.client.post(
        "/v1/route",
        json={
            "messages": [
                {"role": "user", "content": "solve this equation"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "now debug my code"},
            ]
        },
    )
    assert r.json()["route"] == "code"
    blank = h.client.post("/v1/route", json={"input": "   "}).json()
    assert blank == {
        "route": "general",
        "score": None,
        "scores": {},
        "is_default": True,
        "scoring": "prototype",
        "matches": [],
        "outcome": "new",
        "conversation_route": None,
        "conversation_score": None,
        "challenger_route": None,
        "challenger_score": None,
        "turns_read": 0,
    }
    assert h.fast.calls == [] and h.strong.calls == []


@pytest.mark.parametrize(
    "payload", [{}, {"input": "a", "messages": []}, {"input": 3}, {"text": "a"}]
)
def test_route_endpoint_rejects_bad_bodies(h: Harness, payload: dict[str, Any]) -> None:
    r = h.client.post("/v1/route", json=payload)
    assert r.status_code == 400
    assert "error" in r.json()


def test_classify_is_one_batch(h: Harness) -> None:
    before = len(h.embedder.calls)
    inputs = [
        "solve this equation",
        "debug my code",
        "",
        {"messages": [{"role": "user", "content": "write a python function"}]},
    ]
    r = h.client.post("/v1/classify", json={"inputs": inputs})
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3]
    assert [d["route"] for d in data] == ["math", "code", "general", "code"]
    assert data[2]["is_default"] is True and data[2]["score"] is None
    assert len(h.embedder.calls) == before + 1  # one embedding batch for all inputs
    assert len(h.embedder.calls[-1]) == 3  # the blank input was never embedded
    too_many = h.client.post("/v1/classify", json={"inputs": ["a"] * 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "inputs"
    wrong = h.client.post("/v1/classify", json={"inputs": [1]})
    assert wrong.status_code == 400


# ----------------------------------------------------------------- models/health/metrics


def test_models_lists_auto_and_routes(h: Harness) -> None:
    body = h.client.get("/v1/models").json()
    assert body["object"] == "list"
    # Then the embedder (a generator with no name of its own: the configured model).
    assert [m["id"] for m in body["data"]] == ["auto", "code", "math", "general", "default"]
    assert body["data"][-1]["type"] == "embedding"
    code = body["data"][1]
    assert code["targets"] == [
        {"provider": "fast", "model": "small-model"},
        {"provider": "strong", "model": "big-model"},
    ]


def test_health_ready_and_metrics(h: Harness) -> None:
    assert h.client.get("/healthz").json() == {"status": "ok"}
    ready = h.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    h.chat("solve this equation")
    text = h.client.get("/metrics").text
    assert "chatroute_ready 1.0" in text
    assert (
        'chatroute_requests_total{endpoint="chat_completions",route="math",status="200"} 1.0'
        in text
    )
    assert (
        'chatroute_route_decisions_total{default="false",endpoint="chat",route="math"} 1.0' in text
    )
    assert (
        'chatroute_provider_attempts_total{outcome="success",provider="strong",route="math"}'
        in text
    )
    assert "chatroute_request_duration_seconds_bucket" in text
