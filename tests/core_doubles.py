"""Test doubles for the routing and failover tests: scripted clients, streams and routers."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextContent,
)
from chatroute.failover import FailoverChatClient, FailoverChatClientAttempt
from chatroute.router import RoutingContext

# A step runs inside a client call or inside a stream's __anext__; it may await, raise,
# cancel its task or advance the fake clock. For get_response its result is returned.
Step = Callable[[], Awaitable[Any]]


def messages(text: str = "hello") -> list[ChatMessage]:
    """A one-message conversation."""
    return [ChatMessage(ChatRole.USER, text)]


def response(text: str = "ok") -> ChatResponse:
    """A response with one assistant message."""
    return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, text)])


def update(text: str) -> ChatResponseUpdate:
    """A streamed update carrying `text`."""
    return ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent(text)])


class FakeClock:
    """Stands in for `time.perf_counter`; time moves only when a test advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ----------------------------------------------------------------------------- steps


def returns(value: Any) -> Step:
    """Return `value` (the same object on every call)."""

    async def step() -> Any:
        return value

    return step


def fail(message: str = "failed", exc_type: type[BaseException] = RuntimeError) -> Step:
    """Raise a new `exc_type(message)` on every call."""

    async def step() -> Any:
        raise exc_type(message)

    return step


def raise_(exc: BaseException) -> Step:
    """Raise this very exception object."""

    async def step() -> Any:
        raise exc

    return step


def cancel_then(exc_factory: Callable[[], BaseException]) -> Step:
    """Cancel the running task, then raise a new exception (without suspending)."""

    async def step() -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        raise exc_factory()

    return step


def pause(times: int = 1) -> Step:
    """Suspend for `times` event-loop turns."""

    async def step() -> Any:
        for _ in range(times):
            await asyncio.sleep(0)

    return step


def block_forever() -> Step:
    """Suspend until the task is cancelled."""

    async def step() -> Any:
        await asyncio.Event().wait()

    return step


def tick(clock: FakeClock, seconds: float) -> Step:
    """Advance the fake clock as if the step took `seconds`."""

    async def step() -> Any:
        clock.advance(seconds)

    return step


def chain(*steps: Step) -> Step:
    """Run the steps in order; the result is the last one's."""

    async def step() -> Any:
        result = None
        for s in steps:
            result = await s()
        return result

    return step


# ----------------------------------------------------------------------------- streams


class FakeStream:
    """An async iterator scripted as strings (items) and steps run before the next item.

    Counts `aclose()` calls; `aclose_error` and `aiter_error` are exception factories.
    """

    def __init__(
        self,
        *script: str | Step,
        aclose_error: Callable[[], BaseException] | None = None,
        aiter_error: Callable[[], BaseException] | None = None,
        aclose_step: Step | None = None,
    ) -> None:
        self.script = list(script)
        self.position = 0
        self.aclose_error = aclose_error
        self.aiter_error = aiter_error
        self.aclose_step = aclose_step
        self.aclose_count = 0
        self.anext_count = 0
        self.produced: list[ChatResponseUpdate] = []

    def __aiter__(self) -> FakeStream:
        if self.aiter_error is not None:
            raise self.aiter_error()
        return self

    async def __anext__(self) -> ChatResponseUpdate:
        self.anext_count += 1
        while self.position < len(self.script):
            entry = self.script[self.position]
            self.position += 1
            if isinstance(entry, str):
                item = update(entry)
                self.produced.append(item)
                return item
            await entry()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.aclose_count += 1
        if self.aclose_step is not None:
            await self.aclose_step()
        if self.aclose_error is not None:
            raise self.aclose_error()


StreamStep = Callable[[], Any]


def stream(*script: str | Step, **kwargs: Any) -> StreamStep:
    """A stream step: each call returns a new `FakeStream(*script, **kwargs)`."""

    def make() -> Any:
        return FakeStream(*script, **kwargs)

    return make


def stream_call_fails(exc_factory: Callable[[], BaseException]) -> StreamStep:
    """A stream step whose `get_streaming_response` call itself raises."""

    def make() -> Any:
        raise exc_factory()

    return make


# ----------------------------------------------------------------------------- clients


class FakeClient(ChatClient):
    """A chat client driven by per-call steps; the last step repeats. Records everything."""

    def __init__(
        self,
        name: str = "client",
        *replies: Step,
        streams: Sequence[StreamStep] = (),
    ) -> None:
        self.name = name
        self.replies = list(replies) or [returns(response(name))]
        self.streams = list(streams) or [stream(name)]
        self.calls: list[tuple[Sequence[ChatMessage], ChatOptions | None]] = []
        self.stream_calls: list[tuple[Sequence[ChatMessage], ChatOptions | None]] = []
        self.returned: list[Any] = []
        self.made_streams: list[Any] = []
        self.close_count = 0
        self.close_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"FakeClient({self.name!r})"

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        index = len(self.calls)
        self.calls.append((messages, options))
        result = await self.replies[min(index, len(self.replies) - 1)]()
        self.returned.append(result)
        return result  # type: ignore[no-any-return]

    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        index = len(self.stream_calls)
        self.stream_calls.append((messages, options))
        made = self.streams[min(index, len(self.streams) - 1)]()
        self.made_streams.append(made)
        return made  # type: ignore[no-any-return]

    @property
    def all_calls(self) -> int:
        return len(self.calls) + len(self.stream_calls)

    async def aclose(self) -> None:
        self.close_count += 1
        if self.close_error is not None:
            raise self.close_error


# ----------------------------------------------------------------------------- routers


@dataclass
class Update:
    """One recorded `on_routing_update` call."""

    context: RoutingContext
    attempt: FailoverChatClientAttempt
    is_terminal: bool


Selector = Callable[[RoutingContext], Any]
Hook = Callable[[RoutingContext, FailoverChatClientAttempt, bool], Any]


def in_order(*clients: ChatClient) -> Selector:
    """A selector that returns the clients one after another, one per selection."""
    remaining = iter(clients)
    return lambda _context: next(remaining)


def always(client: ChatClient) -> Selector:
    """A selector that always returns `client`."""
    return lambda _context: client


class RecordingRouter(FailoverChatClient):
    """The port of upstream's callback failover router: records selections and updates."""

    def __init__(
        self,
        select: Selector,
        on_update: Hook | None = None,
        *,
        maximum_attempts_per_request: int | None = None,
    ) -> None:
        self._select_fn = select
        self._on_update = on_update
        self.selections: list[RoutingContext] = []
        self.updates: list[Update] = []
        self.maximum_attempts_per_request = maximum_attempts_per_request

    async def select_client(self, context: RoutingContext) -> ChatClient:
        self.selections.append(context)
        result = self._select_fn(context)
        if inspect.isawaitable(result):
            result = await result
        return result  # type: ignore[no-any-return]

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        self.updates.append(Update(context, attempt, is_terminal))
        if self._on_update is not None:
            result = self._on_update(context, attempt, is_terminal)
            if inspect.isawaitable(result):
                await result

    @property
    def terminal_flags(self) -> list[bool]:
        return [u.is_terminal for u in self.updates]


# ----------------------------------------------------------------------------- running


async def collect(gen: AsyncIterator[ChatResponseUpdate]) -> list[str]:
    """Read a stream to its end and return the texts of its updates."""
    return [item.text async for item in gen]


def respond(
    router: ChatClient, streaming: bool, msgs: Sequence[ChatMessage] | None = None, **kw: Any
) -> Awaitable[Any]:
    """Run one request; the result is the response, or the list of streamed texts."""
    msgs = messages() if msgs is None else msgs
    if streaming:
        return collect(router.get_streaming_response(msgs, **kw))
    return router.get_response(msgs, **kw)


@dataclass
class Outcome:
    """How a child task ended: its result, or the exception object it raised."""

    result: Any = None
    error: BaseException | None = None


async def run_in_child(awaitable: Awaitable[Any]) -> Outcome:
    """Run `awaitable` in a child task and report what came out of it, errors included.

    Doubles that cancel their own task do it in the child, where the pending
    cancellation is delivered at the child's next suspension point.
    """

    outcome = Outcome()

    async def body() -> None:
        try:
            outcome.result = await awaitable
        except BaseException as exc:  # the outcome is what the test inspects
            outcome.error = exc

    task = asyncio.ensure_future(body())
    await asyncio.wait([task])
    return outcome
