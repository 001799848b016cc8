"""Conversations through the real service: decisions in context, sticky providers, Redis."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from chatroute.chat import EmbeddingGenerator
from chatroute.config import parse_config
from chatroute.server import create_app
from tests.fakes import FakeUpstream, Ok, ServerError
from tests.test_shared_state import _free_port, _redis_server

Serve = Callable[..., contextlib.AbstractContextManager[str]]

ROUTES = {
    "general": {"utterances": ["hello there", "how are you"], "targets": ["first", "second"]},
    "restaurants": {
        "utterances": [
            "book a table at a restaurant",
            "find me a good italian restaurant",
            "reserve dinner for two tonight",
        ],
        "targets": ["first", "second"],
    },
    "weather": {
        "utterances": [
            "what is the weather forecast",
            "will it rain tomorrow",
            "how hot will it be this weekend",
        ],
        "targets": ["second", "first"],
    },
}


def _config(first: FakeUpstream, second: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return {
        "routing": {"default_route": "general"},
        "providers": {
            "first": {"base_url": first.base_url, "model": "first-model"},
            "second": {"base_url": second.base_url, "model": "second-model"},
        },
        "routes": ROUTES,
        **extra,
    }


@contextlib.contextmanager
def _service(
    serve_app: Serve, embedder: EmbeddingGenerator, data: dict[str, Any], env: dict[str, str]
) -> Iterator[tuple[str, openai.OpenAI]]:
    app = create_app(parse_config(data, environ=env), api_keys=[], environ=env, embedder=embedder)
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            yield url, client
        finally:
            client.close()


def _ask(
    client: openai.OpenAI, session: str | None = None, *, stream: bool = False, **kw: Any
) -> tuple[str, str | None]:
    """(provider, x-chatroute-sticky) of one chat request on the `general` route."""
    headers = {"x-chatroute-session": session} if session is not None else None
    messages = kw.pop("messages", [{"role": "user", "content": "hello"}])
    raw = client.chat.completions.with_raw_response.create(
        model=kw.pop("model", "general"),
        messages=messages,
        stream=stream,
        extra_headers=headers,
        **kw,
    )
    if stream:
        for _ in raw.parse():  # the whole stream
            pass
    else:
        assert raw.parse().choices[0].message.content
    return raw.headers["x-chatroute-provider"], raw.headers.get("x-chatroute-sticky")


def test_a_conversation_keeps_its_provider_and_moves_on_failover(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Serve
) -> None:
    with FakeUpstream() as first, FakeUpstream() as second:
        with _service(serve_app, default_embedder(), _config(first, second), {}) as (url, client):
            first.script(ServerError(500))  # the conversation starts on the second provider
            assert _ask(client, "conv-1") == ("second", "new")
            # the first provider is healthy again, yet the conversation stays where it is
            assert _ask(client, "conv-1") == ("second", "kept")
            assert _ask(client, "conv-1", stream=True) == ("second", "kept")
            assert first.attempts == 1
            second.script(ServerError(503))  # its provider fails: it moves, and says so
            assert _ask(client, "conv-1", stream=True) == ("first", "failover")
            assert _ask(client, "conv-1") == ("first", "kept")
            # another route for the same conversation: a switch
            assert _ask(client, "conv-1", model="weather") == ("second", "switched")
            # a request that names no conversation has no session
            assert _ask(client) == ("first", None)
            # `user` with the opening messages is a conversation key too
            assert _ask(client, user="alice") == ("first", "new")
            assert _ask(client, user="alice") == ("first", "kept")
            opening = [{"role": "user", "content": "good morning"}]
            assert _ask(client, user="alice", messages=opening) == ("first", "new")
            # an odd session header is hashed, never refused
            assert _ask(client, "a b/" * 100) == ("first", "new")
            metrics = httpx.get(f"{url}/metrics").text
            for route, outcome, count in [
                ("general", "kept", 4),
                ("general", "failover", 1),
                ("weather", "switched", 1),
            ]:
                line = f'chatroute_sticky_sessions_total{{outcome="{outcome}",route="{route}"}}'
                assert f"{line} {count:.1f}" in metrics, line


def test_sessions_off_sends_no_sticky_header(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Serve
) -> None:
    with FakeUpstream() as first, FakeUpstream() as second:
        data = _config(first, second, sessions={"enabled": False})
        with _service(serve_app, default_embedder(), data, {}) as (_, client):
            first.script(ServerError(500))
            assert _ask(client, "conv-1") == ("second", None)
            assert _ask(client, "conv-1") == ("first", None)  # configured order again


def test_route_and_classify_decide_the_last_turn_in_its_conversation(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Serve
) -> None:
    booking = [
        {"role": "user", "content": "book a table at an italian restaurant for tonight"},
        {"role": "assistant", "content": "Sure. For what time should I reserve the table?"},
        {"role": "user", "content": "7pm, for two people"},
    ]
    moved = [
        *booking,
        {"role": "assistant", "content": "Done. Anything else?"},
        {"role": "user", "content": "what is the weather forecast, will it rain tomorrow?"},
    ]
    with FakeUpstream() as first, FakeUpstream() as second:
        with _service(serve_app, default_embedder(), _config(first, second), {}) as (url, _):
            body = httpx.post(f"{url}/v1/route", json={"messages": booking}).json()
            assert body["route"] == "restaurants" and body["outcome"] == "kept"
            assert body["conversation_route"] == "restaurants" and body["turns_read"] == 2
            assert body["conversation_score"] == pytest.approx(body["score"])
            assert body["challenger_route"] != "restaurants"
            assert body["challenger_score"] <= body["conversation_score"]
            assert body["scoring"] == "prototype"
            inputs = [{"messages": booking}, {"messages": moved}, "will it rain tomorrow"]
            answer = httpx.post(f"{url}/v1/classify", json={"inputs": inputs}).json()
            data = answer["data"]
            assert [d["route"] for d in data] == ["restaurants", "weather", "weather"]
            assert [d["outcome"] for d in data] == ["kept", "switched", "new"]
            switched = data[1]
            assert switched["conversation_route"] == "restaurants"
            assert switched["challenger_route"] == "weather"
            assert switched["challenger_score"] > switched["conversation_score"]
            assert {d["scoring"] for d in data} == {"prototype"}
            # no user turn: the default route, nothing kept
            tools_only = [{"role": "system", "content": "be brief"}]
            body = httpx.post(f"{url}/v1/route", json={"messages": tools_only}).json()
            assert (body["route"], body["is_default"], body["outcome"]) == ("general", True, "new")


def test_a_conversation_keeps_its_provider_across_replicas_through_redis(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Serve
) -> None:
    prefix = f"sessions{time.monotonic_ns()}"
    with (
        _redis_server(_free_port()) as redis_url,
        FakeUpstream() as first,
        FakeUpstream() as second,
    ):
        env = {"TEST_REDIS_URL": redis_url}
        shared = {"redis_url_env": "TEST_REDIS_URL", "key_prefix": prefix}
        data = _config(first, second, shared_state=shared)
        with (
            _service(serve_app, default_embedder(), data, env) as (_, one),
            _service(serve_app, default_embedder(), data, env) as (_, two),
        ):
            first.script(ServerError(500))
            assert _ask(one, "conv-r") == ("second", "new")
            store = redis.Redis.from_url(redis_url)
            deadline = time.monotonic() + 5
            while not store.exists(f"{prefix}:session:s:conv-r"):  # written in the background
                assert time.monotonic() < deadline, "the session record never reached Redis"
                time.sleep(0.01)
            assert store.ttl(f"{prefix}:session:s:conv-r") > 0  # it expires
            store.close()
            # the other replica has never seen the conversation, yet keeps its provider
            assert _ask(two, "conv-r") == ("second", "kept")
            assert _ask(two, "conv-r", stream=True) == ("second", "kept")
            assert first.attempts == 1


def test_redis_unreachable_leaves_requests_answered_without_sessions(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Serve
) -> None:
    env = {"TEST_REDIS_URL": f"redis://127.0.0.1:{_free_port()}/0"}  # nothing listens there
    with FakeUpstream(default=Ok("fine")) as first, FakeUpstream() as second:
        data = _config(first, second, shared_state={"redis_url_env": "TEST_REDIS_URL"})
        with _service(serve_app, default_embedder(), data, env) as (_, client):
            for _ in range(3):  # every turn is a new conversation: nothing could be kept
                assert _ask(client, "conv-x") == ("first", "new")
            assert _ask(client, "conv-x", stream=True) == ("first", "new")
