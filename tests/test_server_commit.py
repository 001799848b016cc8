"""The service's commit point and its bookkeeping, on provider doubles: what reaches the
caller before the first content, what a request records when output has gone out, and
the headers an error answer keeps.

The provider clients hold role-only deltas themselves (test_providers.py), so these
tests use doubles that do not: the service must keep the commit rule for any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chatroute.chat import ChatMessage, ChatOptions, ChatResponseUpdate, ChatRole, TextContent
from chatroute.config import parse_config
from chatroute.providers import StreamInterruptedError
from chatroute.server import build_engine, create_app
from chatroute.tracing import RequestTrace
from tests.test_fault_matrix import events_of, sample_of
from tests.test_server import CONFIG, BagOfWordsEmbedder, Provider, upstream_error

USER = {"role": "user", "content": "what a lovely afternoon"}


class OneChunkThenSilence(Provider):
    """Streams a role-only delta and one content delta, then waits for ever; records when
    its stream is closed."""

    stream_closed = False

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        try:
            yield ChatResponseUpdate(role=ChatRole.ASSISTANT)
            yield ChatResponseUpdate(contents=[TextContent("only")])
            await asyncio.sleep(30)
            yield ChatResponseUpdate(finish_reason="stop")
        finally:
            self.stream_closed = True


class Stack:
    """The app over doubles (route `general` on `strong` alone), with its traces."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.traces: list[RequestTrace] = []

    def stream(self) -> tuple[int, dict[str, str], str]:
        payload = {"model": "general", "messages": [USER], "stream": True}
        with self.client.stream("POST", "/v1/chat/completions", json=payload) as response:
            text = response.read().decode()
            return response.status_code, dict(response.headers), text

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0.0 when it is absent)."""
        return sample_of(self.client.get("/metrics").text, name, **labels)


@contextlib.contextmanager
def stack(
    strong: Provider, on_finish: Callable[[], None] = lambda: None, **general: Any
) -> Iterator[Stack]:
    raw = copy.deepcopy(CONFIG)
    raw["routes"]["general"].update(general)
    config = parse_config(raw, environ={})
    providers = {"fast": Provider("fast"), "strong": strong}
    engine = build_engine(config, embedder=BagOfWordsEmbedder(), providers=providers, environ={})
    made: Stack

    def sink(trace: RequestTrace) -> None:
        made.traces.append(trace)
        on_finish()

    app = create_app(engine, api_keys=[], trace_sink=sink)
    with TestClient(app) as client:
        made = Stack(client)
        yield made
    asyncio.run(engine.aclose())


def test_a_stream_failing_after_a_role_only_delta_sends_nothing_but_a_json_error() -> None:
    strong = Provider("strong")
    strong.script.append(([], StreamInterruptedError("connection cut", provider="strong")))
    with stack(strong) as s:
        status, headers, text = s.stream()
        assert status == 502
        assert headers["content-type"] == "application/json"
        assert "data:" not in text  # not one event: the role-only delta is not the commit
        assert headers["x-chatroute-provider"] == "strong"
        (trace,) = s.traces
        assert trace.status == 502 and not trace.committed


def test_a_stream_cut_by_the_deadline_after_its_first_content_counts_as_after_output() -> None:
    with stack(OneChunkThenSilence("strong"), deadline=0.3) as s:
        status, _, text = s.stream()
        assert status == 200  # committed: the deadline ends it in band
        events = events_of(text)
        assert [e["choices"][0]["delta"].get("content") for e in events[:-1]] == ["only"]
        assert events[-1]["error"]["code"] == "deadline_exceeded"
        assert "[DONE]" not in events
        (trace,) = s.traces
        assert trace.committed and trace.cancelled == "deadline"
        labels = {"route": "general", "reason": "deadline"}
        assert s.metric("chatroute_cancelled_requests_total", stage="after_output", **labels) == 1
        assert s.metric("chatroute_cancelled_requests_total", stage="before_output", **labels) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_unknown_fields_reach_the_provider_and_an_error_answer_names_none_ignored(
    stream: bool,
) -> None:
    strong = Provider("strong")
    strong.script.append(upstream_error(503, "down"))
    with stack(strong) as s:
        body = {"model": "general", "messages": [USER], "stream": stream, "frobnicate": 1}
        r = s.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503
        assert "x-chatroute-ignored-params" not in r.headers  # no provider dropped it
        assert r.headers["x-chatroute-route"] == "general"
        assert r.json()["error"]["message"].endswith("down")
        (_, options), *_ = strong.calls
        assert options.additional_properties["frobnicate"] == 1
        assert options.pass_through_fields == frozenset({"frobnicate"})


def test_a_failure_preparing_the_stream_after_its_first_content_closes_the_routed_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever fails between the first content and the response's start, the routed
    stream (and the upstream connection behind it) is closed before the answer."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("encoder unavailable")

    monkeypatch.setattr("chatroute.server.chat.StreamEncoder", broken)
    strong = OneChunkThenSilence("strong")
    closed_when_recorded: list[bool] = []
    with stack(strong, lambda: closed_when_recorded.append(strong.stream_closed)) as s:
        status, headers, text = s.stream()
        assert status == 502 and headers["content-type"] == "application/json"
        assert "encoder unavailable" not in text  # an unknown failure's text is not passed on
        assert closed_when_recorded == [True]  # closed at once, not left to the collector
