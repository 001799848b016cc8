"""Sticky sessions: conversation keys, session stores, and a conversation kept on its provider,
shared by two replicas through a real redis-server."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
import redis

from chatroute import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    InMemorySessionStore,
    OrderedFailoverChatClient,
    SessionRecord,
    SessionScope,
    StickyProviderChatClient,
    bind_session,
    conversation_key,
)
from chatroute.session import RedisSessionStore, SessionStore
from chatroute.session.keys import MAX_RAW_SESSION_KEY
from tests.semantic_doubles import NamedClient

U = ChatRole.USER


def _chat(*texts: str) -> list[ChatMessage]:
    roles = [ChatRole.USER, ChatRole.ASSISTANT]
    return [ChatMessage(roles[i % 2], text) for i, text in enumerate(texts)]


# ---------------------------------------------------------------------------- keys


def test_a_session_header_is_kept_when_short_and_plain_and_hashed_otherwise() -> None:
    assert conversation_key([], session="chat-42") == "s:chat-42"
    for odd in ("x" * (MAX_RAW_SESSION_KEY + 1), "café", "a b", "a\nb"):
        key = conversation_key([], session=odd)
        assert key is not None and key.startswith("s#") and odd not in key
        assert key.isascii() and len(key) < 40
        assert key == conversation_key([], session=odd)  # stable


def test_a_user_keys_each_conversation_by_its_opening_and_is_never_stored_raw() -> None:
    first = conversation_key(_chat("plan a trip"), user="alice@example.com")
    later = conversation_key(_chat("plan a trip", "where to?", "Rome"), user="alice@example.com")
    other_talk = conversation_key(_chat("fix my code"), user="alice@example.com")
    other_user = conversation_key(_chat("plan a trip"), user="bob")
    assert first is not None and "alice" not in first
    assert first == later
    assert len({first, other_talk, other_user}) == 3
    assert conversation_key(_chat("hi"), prompt_cache_key="tenant-1") is not None
    assert conversation_key(_chat("hi")) is None
    assert conversation_key(_chat("hi"), session="") is None


# ---------------------------------------------------------------------------- in memory


async def test_the_in_memory_store_forgets_after_its_ttl_and_keeps_a_bound() -> None:
    now = [0.0]
    store = InMemorySessionStore(max_sessions=2, ttl=10.0, clock=lambda: now[0])
    record = SessionRecord("travel", "p1", "openai")
    await store.put("a", record)
    now[0] = 9.0
    assert await store.get("a") == record
    now[0] = 10.5
    assert await store.get("a") is None
    await store.put("a", record)
    await store.put("b", record)
    assert await store.get("a") == record  # "a" now used more recently than "b"
    await store.put("c", record)
    assert len(store) == 2 and await store.get("b") is None
    with pytest.raises(ValueError):
        InMemorySessionStore(ttl=0)


# ---------------------------------------------------------------------------- sticky


class Provider(NamedClient):
    """A provider that can be made to fail."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.failing = False

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        if self.failing:
            raise ConnectionError(f"{self.name} is down")
        return await super().get_response(messages, options)

    async def _stream(self) -> AsyncIterator[ChatResponseUpdate]:
        if self.failing:
            raise ConnectionError(f"{self.name} is down")
        async for update in super()._stream():
            yield update


def _replica(
    store: SessionStore, providers: dict[str, Provider], unhealthy: set[str], route: str = "travel"
) -> StickyProviderChatClient:
    def chain(order: Sequence[tuple[str, ChatClient]]) -> ChatClient:
        return OrderedFailoverChatClient([client for _, client in order], leave_open=True)

    return StickyProviderChatClient(
        route,
        list(providers.items()),
        store,
        chain,
        healthy=lambda name: name not in unhealthy,
        families={"p1": "openai", "p2": "anthropic"},
    )


async def _ask(
    client: ChatClient, messages: list[ChatMessage], key: str
) -> tuple[str, SessionScope]:
    scope = SessionScope(key=key)
    bind_session(scope)
    answer = await client.get_response(messages)
    return answer.text, scope


async def test_a_conversation_stays_on_its_provider_and_moves_on_failover() -> None:
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    unhealthy: set[str] = set()
    store = InMemorySessionStore()
    sticky = _replica(store, providers, unhealthy)
    talk = _chat("plan a trip")

    unhealthy.add("p1")  # not skipped by the chain: only the sticky order reads health
    providers["p1"].failing = True
    text, scope = await _ask(sticky, talk, "s:t1")
    assert (text, scope.outcome, scope.provider) == ("p2", "new", "p2")
    assert await store.get("s:t1") == SessionRecord("travel", "p2", "anthropic")

    unhealthy.clear()
    providers["p1"].failing = False  # p1 is back, but the conversation stays on p2
    text, scope = await _ask(sticky, talk, "s:t1")
    assert (text, scope.outcome, scope.history_family) == ("p2", "kept", "anthropic")

    providers["p2"].failing = True  # p2 fails mid-conversation: failover to p1
    text, scope = await _ask(sticky, talk, "s:t1")
    assert (text, scope.outcome) == ("p1", "failover")
    assert (await store.get("s:t1")) == SessionRecord("travel", "p1", "openai")

    unhealthy.add("p1")  # the stored provider is known unhealthy before the call
    providers["p2"].failing = False
    text, scope = await _ask(sticky, talk, "s:t1")
    assert (text, scope.outcome) == ("p1", "failover")  # configured order; p1 still answers


async def test_a_route_switch_is_reported_and_restarts_stickiness() -> None:
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    store = InMemorySessionStore()
    travel = _replica(store, providers, set())
    food = _replica(store, {"p2": providers["p2"], "p1": providers["p1"]}, set(), route="food")
    _, scope = await _ask(travel, _chat("plan a trip"), "s:t2")
    assert (scope.outcome, scope.provider) == ("new", "p1")
    text, scope = await _ask(food, _chat("plan a trip", "ok", "and dinner?"), "s:t2")
    assert (text, scope.outcome) == ("p2", "switched")
    assert await store.get("s:t2") == SessionRecord("food", "p2", "anthropic")


async def test_streams_report_the_provider_that_answered() -> None:
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    store = InMemorySessionStore()
    sticky = _replica(store, providers, set())
    await store.put("s:t3", SessionRecord("travel", "p2", "anthropic"))
    scope = SessionScope(key="s:t3")
    bind_session(scope)
    parts = [u.text async for u in sticky.get_streaming_response(_chat("hi"))]
    assert parts == ["p2", "!"]
    assert (scope.outcome, scope.provider) == ("kept", "p2")


async def test_without_a_key_the_route_runs_in_order_and_reports_nothing() -> None:
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    store = InMemorySessionStore()
    sticky = _replica(store, providers, set())
    scope = SessionScope()
    bind_session(scope)
    assert (await sticky.get_response(_chat("hi"))).text == "p1"
    assert scope.outcome is None and len(store) == 0
    # a request's own `user` names the conversation when no header does
    scope = SessionScope()
    bind_session(scope)
    await sticky.get_response(_chat("hi"), ChatOptions(user="u-1"))
    assert scope.outcome == "new" and scope.key is not None and len(store) == 1


def test_bad_construction_is_refused() -> None:
    store = InMemorySessionStore()
    with pytest.raises(ValueError, match="distinct"):
        StickyProviderChatClient(
            "r", [("a", NamedClient("a")), ("a", NamedClient("b"))], store, lambda o: o[0][1]
        )
    with pytest.raises(ValueError, match="at least one"):
        StickyProviderChatClient("r", [], store, lambda o: o[0][1])


# ---------------------------------------------------------------------------- redis


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _redis(port: int) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (`make test` installs it)")
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen(
            [*args, "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            probe = redis.Redis(port=port, socket_connect_timeout=0.5)
            for _ in range(200):
                try:
                    probe.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            probe.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with _redis(_free_port()) as url:
        yield url


async def test_a_conversation_started_on_one_replica_keeps_its_provider_on_another(
    redis_url: str,
) -> None:
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    store_a = RedisSessionStore(redis_url, prefix="test-sticky", ttl=60, timeout=1.0)
    store_b = RedisSessionStore(redis_url, prefix="test-sticky", ttl=60, timeout=1.0)
    replica_a = _replica(store_a, providers, {"p1"})  # replica A sees p1 as unhealthy
    replica_b = _replica(store_b, providers, set())  # replica B would start on p1
    try:
        providers["p1"].failing = True
        text, scope = await _ask(replica_a, _chat("plan a trip"), "s:shared")
        assert (text, scope.outcome) == ("p2", "new")
        await store_a.flush()
        providers["p1"].failing = False

        text, scope = await _ask(replica_b, _chat("plan a trip", "where?", "Rome"), "s:shared")
        assert (text, scope.outcome, scope.history_family) == ("p2", "kept", "anthropic")
        text, _ = await _ask(replica_b, _chat("a new talk"), "s:other")
        assert text == "p1"  # another conversation starts in the configured order

        ttl = redis.Redis.from_url(redis_url).pttl("test-sticky:session:s:shared")
        assert 0 < ttl <= 60_000  # records expire
    finally:
        await store_a.aclose()
        await store_b.aclose()


async def test_an_unreachable_redis_leaves_requests_stateless() -> None:
    store = RedisSessionStore(f"redis://127.0.0.1:{_free_port()}/0", timeout=0.2, retry_after=60)
    providers = {"p1": Provider("p1"), "p2": Provider("p2")}
    sticky = _replica(store, providers, set())
    try:
        text, scope = await _ask(sticky, _chat("hi"), "s:nowhere")
        assert (text, scope.outcome) == ("p1", "new")
        assert store.available is False
        text, scope = await _ask(sticky, _chat("hi"), "s:nowhere")  # not tried again yet
        assert (text, scope.outcome) == ("p1", "new")
        await store.flush()
    finally:
        await store.aclose()


async def test_a_corrupt_record_reads_as_none(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("test-bad:session:s:x", b"\xff not json")
    client.set("test-bad:session:s:y", '{"route": 3, "provider": "p"}')
    store = RedisSessionStore(redis_url, prefix="test-bad", timeout=1.0)
    try:
        assert await store.get("s:x") is None
        assert await store.get("s:y") is None
        assert store.available
    finally:
        await store.aclose()
        client.close()
