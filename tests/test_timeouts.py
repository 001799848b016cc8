"""TimeoutChatClient: attempt, first-token and stall limits that fail over and close the stream."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence

import pytest

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextContent,
)
from chatroute.errors import (
    FailureKind,
    FirstTokenTimeoutError,
    ProviderTimeoutError,
    StreamStallTimeoutError,
    classify_failure,
)
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.failover.timeouts import TimeoutChatClient
from chatroute.router import RoutingContext

LIMIT = 0.02  # seconds; the only real waiting these tests do is a few of these
HANG = "hang"

MESSAGES = [ChatMessage(ChatRole.USER, "hi")]


def update(text: str) -> ChatResponseUpdate:
    return ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent(text)])


class Scripted(ChatClient):
    """A client whose response or stream follows a script; `HANG` waits forever."""

    def __init__(self, *script: str | BaseException, name: str = "scripted") -> None:
        self.script = script
        self.name = name
        self.context_window = 8000
        self.calls = 0
        self.closed_streams = 0
        self.cancelled = 0
        self.closed = False

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        self.calls += 1
        step = self.script[0]
        try:
            if step == HANG:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(step, BaseException):
            raise step
        return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, str(step))])

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        self.calls += 1
        try:
            for step in self.script:
                if step == HANG:
                    await asyncio.Event().wait()
                elif isinstance(step, BaseException):
                    raise step
                else:
                    yield update(step)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.closed_streams += 1

    async def aclose(self) -> None:
        self.closed = True


def cancelling() -> int:
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


async def collect(stream: AsyncIterator[ChatResponseUpdate]) -> list[str]:
    return [item.text async for item in stream]


# ----------------------------------------------------------------------------- non-streaming


async def test_attempt_timeout_raises_a_typed_timeout_and_leaves_the_task_uncancelled() -> None:
    inner = Scripted(HANG)
    client = TimeoutChatClient(inner, attempt_timeout=LIMIT)
    with pytest.raises(ProviderTimeoutError) as info:
        await client.get_response(MESSAGES)
    assert isinstance(info.value, TimeoutError)
    assert classify_failure(info.value) is FailureKind.TIMEOUT
    assert info.value.provider == "scripted"
    assert inner.cancelled == 1  # the inner call was stopped
    assert cancelling() == 0


def test_the_failover_modules_import_without_the_sdk_stack() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('openai', 'httpx', 'httpx2'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import chatroute.failover.health, chatroute.failover.timeouts\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


async def test_fast_response_passes_through_unchanged() -> None:
    inner = Scripted("answer")
    response = await TimeoutChatClient(inner, attempt_timeout=5.0).get_response(MESSAGES)
    assert response.text == "answer"


async def test_an_inner_timeout_error_before_the_limit_is_not_relabelled() -> None:
    own = TimeoutError("the client's own")
    inner = Scripted(own)
    with pytest.raises(TimeoutError) as info:
        await TimeoutChatClient(inner, attempt_timeout=5.0).get_response(MESSAGES)
    assert info.value is own


async def test_caller_cancellation_stays_a_cancelled_error() -> None:
    inner = Scripted(HANG)
    client = TimeoutChatClient(inner, attempt_timeout=5.0)
    task = asyncio.create_task(client.get_response(MESSAGES))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inner.cancelled == 1


# ----------------------------------------------------------------------------- streaming


async def test_first_token_timeout_closes_the_inner_stream() -> None:
    inner = Scripted(HANG, "late")
    client = TimeoutChatClient(inner, first_token_timeout=LIMIT)
    with pytest.raises(FirstTokenTimeoutError) as info:
        await collect(client.get_streaming_response(MESSAGES))
    assert classify_failure(info.value) is FailureKind.FIRST_TOKEN_TIMEOUT
    assert inner.closed_streams == 1
    assert cancelling() == 0


async def test_stall_timeout_after_output_closes_the_inner_stream() -> None:
    inner = Scripted("one", HANG, "never")
    client = TimeoutChatClient(inner, first_token_timeout=5.0, stall_timeout=LIMIT)
    received: list[str] = []
    with pytest.raises(StreamStallTimeoutError) as info:
        async for item in client.get_streaming_response(MESSAGES):
            received.append(item.text)
    assert received == ["one"]
    assert classify_failure(info.value) is FailureKind.STALL_TIMEOUT
    assert inner.closed_streams == 1
    assert cancelling() == 0


async def test_time_the_caller_spends_between_items_is_not_counted() -> None:
    inner = Scripted("a", "b")
    client = TimeoutChatClient(inner, stall_timeout=LIMIT)
    received = []
    async for item in client.get_streaming_response(MESSAGES):
        received.append(item.text)
        if item.text == "a":
            await asyncio.sleep(LIMIT * 2)  # a slow caller, not a stalled upstream
    assert received == ["a", "b"]


async def test_streaming_caller_cancellation_passes_through_and_closes() -> None:
    inner = Scripted(HANG)
    client = TimeoutChatClient(inner, first_token_timeout=5.0)
    task = asyncio.create_task(collect(client.get_streaming_response(MESSAGES)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inner.cancelled == 1
    assert inner.closed_streams == 1


async def test_caller_aclose_closes_the_inner_stream() -> None:
    inner = Scripted("a", "b", "c")
    stream = TimeoutChatClient(inner, stall_timeout=5.0).get_streaming_response(MESSAGES)
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        first = await anext(stream)
        assert first.text == "a"
    assert inner.closed_streams == 1


async def test_no_limits_is_a_plain_passthrough() -> None:
    inner = Scripted("a", "b")
    client = TimeoutChatClient(inner)
    assert await collect(client.get_streaming_response(MESSAGES)) == ["a", "b"]
    assert inner.closed_streams == 1


# ----------------------------------------------------------------------------- with failover


async def test_a_first_token_timeout_fails_over_to_the_next_client() -> None:
    silent = Scripted(HANG, name="silent")
    healthy = Scripted("x", "y", name="healthy")
    updates: list[tuple[FailoverChatClientAttempt, bool]] = []

    class Recording(OrderedFailoverChatClient):
        async def on_routing_update(
            self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
        ) -> None:
            updates.append((attempt, is_terminal))
            await super().on_routing_update(context, attempt, is_terminal)

    router = Recording([TimeoutChatClient(silent, first_token_timeout=LIMIT), healthy])
    assert await collect(router.get_streaming_response(MESSAGES)) == ["x", "y"]
    assert isinstance(updates[0][0].exception, FirstTokenTimeoutError)
    assert updates[0][1] is False
    assert updates[1][0].response_completed
    assert silent.closed_streams == 1
    assert cancelling() == 0


async def test_an_attempt_timeout_fails_over_non_streaming() -> None:
    silent = Scripted(HANG)
    router = OrderedFailoverChatClient(
        [TimeoutChatClient(silent, attempt_timeout=LIMIT), Scripted("served")]
    )
    response = await router.get_response(MESSAGES)
    assert response.text == "served"
    assert silent.cancelled == 1


# ----------------------------------------------------------------------------- configuration


def test_wrapper_forwards_name_and_context_window() -> None:
    client = TimeoutChatClient(Scripted(name="p1"))
    assert client.name == "p1"
    assert client.context_window == 8000


async def test_aclose_closes_inner_unless_left_open() -> None:
    inner = Scripted()
    await TimeoutChatClient(inner, leave_open=True).aclose()
    assert not inner.closed
    await TimeoutChatClient(inner).aclose()
    assert inner.closed


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"attempt_timeout": 0}, ValueError),
        ({"first_token_timeout": -1.0}, ValueError),
        ({"stall_timeout": float("nan")}, ValueError),
        ({"attempt_timeout": "1"}, TypeError),
        ({"stall_timeout": True}, TypeError),
        ({"leave_open": 1}, TypeError),
    ],
)
def test_bad_limits_are_rejected(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        TimeoutChatClient(Scripted(), **kwargs)  # type: ignore[arg-type]


def test_infinite_limit_means_none() -> None:
    assert TimeoutChatClient(Scripted(), stall_timeout=float("inf")).stall_timeout is None
