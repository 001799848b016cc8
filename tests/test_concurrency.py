"""Many concurrent requests through one ordered failover chain, each with its own failure script."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from core_doubles import update

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
)
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.router import RoutingContext

REQUESTS = 120
CHAIN = 4


@dataclass(frozen=True)
class Script:
    """What should happen to request `rid`: how many clients fail before output, and
    whether the client that starts answering breaks after its first item (streaming)."""

    rid: int
    failures: int  # 0..CHAIN; CHAIN means every client fails
    mid_stream_break: bool

    @property
    def expected_path(self) -> list[int]:
        return list(range(min(self.failures + 1, CHAIN)))

    @property
    def exhausted(self) -> bool:
        return self.failures >= CHAIN


def script_for(rid: int) -> Script:
    return Script(rid, failures=(rid * 7) % (CHAIN + 1), mid_stream_break=rid % 6 == 1)


def rid_of(messages: Sequence[ChatMessage]) -> int:
    return int(messages[-1].text.removeprefix("request "))


class PerRequestClient(ChatClient):
    """Client `position` of the chain: fails or answers as request's script says.

    It suspends a request-dependent number of times so that requests interleave, and the
    first client waits at a barrier so that every request is inside it at once.
    """

    def __init__(self, position: int, barrier: asyncio.Barrier) -> None:
        self.position = position
        self.barrier = barrier
        self.seen: list[int] = []

    async def _enter(self, rid: int) -> Script:
        self.seen.append(rid)
        if self.position == 0:
            await self.barrier.wait()
        for _ in range((rid + self.position) % 4):
            await asyncio.sleep(0)
        return script_for(rid)

    def _failure(self, rid: int) -> RuntimeError:
        return RuntimeError(f"client {self.position} failed request {rid}")

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        rid = rid_of(messages)
        script = await self._enter(rid)
        if self.position < script.failures:
            raise self._failure(rid)
        return ChatResponse(
            messages=[ChatMessage(ChatRole.ASSISTANT, f"client {self.position} -> {rid}")]
        )

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        rid = rid_of(messages)
        script = await self._enter(rid)
        if self.position < script.failures:
            raise self._failure(rid)
        yield update(f"{self.position}:{rid}:a")
        await asyncio.sleep(0)
        if script.mid_stream_break:
            raise ConnectionError(f"client {self.position} broke request {rid} mid-stream")
        yield update(f"{self.position}:{rid}:b")


@dataclass
class Seen:
    path: list[int] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Recording(OrderedFailoverChatClient):
    """Records every update per request id; keeps contexts only weakly."""

    def __init__(self, clients: Sequence[ChatClient]) -> None:
        super().__init__(clients)
        self.by_request: dict[int, Seen] = {}
        self.contexts: weakref.WeakSet[RoutingContext] = weakref.WeakSet()

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        self.contexts.add(context)
        seen = self.by_request.setdefault(rid_of(context.messages), Seen())
        assert isinstance(attempt.client, PerRequestClient)
        seen.path.append(attempt.client.position)
        seen.flags.append(is_terminal)
        seen.errors.append("" if attempt.exception is None else str(attempt.exception))
        await super().on_routing_update(context, attempt, is_terminal)


def build() -> tuple[Recording, list[PerRequestClient]]:
    barrier = asyncio.Barrier(REQUESTS)
    clients = [PerRequestClient(i, barrier) for i in range(CHAIN)]
    return Recording(clients), clients


def request(rid: int) -> list[ChatMessage]:
    return [ChatMessage(ChatRole.USER, f"request {rid}")]


def check_path(router: Recording, clients: list[PerRequestClient]) -> None:
    for rid in range(REQUESTS):
        script = script_for(rid)
        seen = router.by_request[rid]
        assert seen.path == script.expected_path, rid
        failed_over = len(script.expected_path) - 1
        if script.exhausted:
            # exhaustion ends routing from the nonterminal hook (no terminal update)
            assert seen.flags == [False] * CHAIN, rid
        else:
            assert seen.flags == [False] * failed_over + [True], rid
        for position, error in zip(seen.path, seen.errors, strict=True):
            if position < script.failures:
                assert error == f"client {position} failed request {rid}"
    for client in clients:
        expected = sorted(
            r for r in range(REQUESTS) if client.position in script_for(r).expected_path
        )
        assert sorted(client.seen) == expected


def check_no_state_left(router: Recording) -> None:
    gc.collect()
    assert len(router.contexts) == 0
    assert len(router._positions) == 0


@pytest.mark.timeout(60)
async def test_concurrent_requests_follow_their_own_failover_path() -> None:
    router, clients = build()

    async def one(rid: int) -> tuple[str, str]:
        # Exceptions are reduced to text here: an exception the caller keeps would pin
        # the request's finished frames (and so its context) through its traceback.
        try:
            result = await router.get_response(request(rid))
        except RuntimeError as exc:
            return "error", str(exc)
        return "ok", result.text

    outcomes = await asyncio.gather(*(one(rid) for rid in range(REQUESTS)))
    for rid, outcome in enumerate(outcomes):
        script = script_for(rid)
        if script.exhausted:
            assert outcome == ("error", f"client {CHAIN - 1} failed request {rid}")
        else:
            assert outcome == ("ok", f"client {script.failures} -> {rid}")
    check_path(router, clients)
    assert any(script_for(r).exhausted for r in range(REQUESTS))
    assert any(script_for(r).failures == 0 for r in range(REQUESTS))
    check_no_state_left(router)


@pytest.mark.timeout(60)
async def test_concurrent_streams_follow_their_own_failover_path() -> None:
    router, clients = build()

    async def consume(rid: int) -> tuple[list[str], tuple[type[Exception], str] | None]:
        got: list[str] = []
        try:
            async for item in router.get_streaming_response(request(rid)):
                got.append(item.text)
        except Exception as exc:  # reduced to type and text, see above
            return got, (type(exc), str(exc))
        return got, None

    outcomes = await asyncio.gather(*(consume(rid) for rid in range(REQUESTS)))
    for rid, (got, error) in enumerate(outcomes):
        script = script_for(rid)
        if script.exhausted:
            assert got == []
            assert error == (RuntimeError, f"client {CHAIN - 1} failed request {rid}")
            continue
        winner = script.failures
        if script.mid_stream_break:
            assert got == [f"{winner}:{rid}:a"]  # items already received are kept
            assert error == (ConnectionError, f"client {winner} broke request {rid} mid-stream")
        else:
            assert got == [f"{winner}:{rid}:a", f"{winner}:{rid}:b"]
            assert error is None
    check_path(router, clients)
    for rid in range(REQUESTS):
        script = script_for(rid)
        if not script.exhausted:
            last_error = router.by_request[rid].errors[-1]
            assert ("mid-stream" in last_error) == script.mid_stream_break
    check_no_state_left(router)


@pytest.mark.timeout(60)
async def test_mixed_streaming_and_non_streaming_share_nothing() -> None:
    router, _clients = build()

    async def one(rid: int) -> str:
        try:
            if rid % 2:
                texts = [u.text async for u in router.get_streaming_response(request(rid))]
                return texts[-1]
            return (await router.get_response(request(rid))).text
        except Exception as exc:
            return type(exc).__name__

    outcomes = await asyncio.gather(*(one(rid) for rid in range(REQUESTS)))
    for rid, outcome in enumerate(outcomes):
        script = script_for(rid)
        assert router.by_request[rid].path == script.expected_path
        if script.exhausted:
            assert outcome == "RuntimeError"
        elif rid % 2 and script.mid_stream_break:
            assert outcome == "ConnectionError"
        elif rid % 2:
            assert outcome == f"{script.failures}:{rid}:b"
        else:
            assert outcome == f"client {script.failures} -> {rid}"
    check_no_state_left(router)
