"""Timeouts that share one event-loop timer per loop, so setting and cancelling one is cheap.

Nearly every timeout on the request path is set and then cancelled well before it could
fire: the wait for a request body, a provider's request timeout, each wait for upstream
bytes, the request deadline. On uvloop each `loop.call_at` creates and later closes a
libuv timer, and `asyncio.timeout` adds its own bookkeeping on top: about 5 and 10 µs
a time on the service's machine, several times a request. Here a timeout is an entry in
one heap per loop. Only an entry earlier than every other arms the loop's single timer,
and cancelling one only marks it (the heap is compacted once the marked outnumber the
live).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

__all__ = ["Timeout", "TimerHandle", "TimerQueue", "timeout", "timeout_at", "timer_queue"]

# Cancelled entries are dropped in one pass once there are more of them than this and
# than live ones: at most about twice the live timeouts, plus this many, stay in the heap.
_COMPACT_AFTER: Final = 64
# Entries due within this much of the loop's clock fire together (the loop may wake its
# timer a hair early: asyncio fires handles due within its clock resolution).
_SLACK: Final = 1e-6


class TimerHandle:
    """A pending call of a `TimerQueue`; `cancel()` stops it (a no-op once it ran)."""

    __slots__ = ("_args", "_callback", "_queue", "when")

    def __init__(
        self, when: float, callback: Callable[..., object], args: tuple[Any, ...], queue: TimerQueue
    ) -> None:
        self.when = when
        self._callback: Callable[..., object] | None = callback
        self._args = args
        self._queue: TimerQueue | None = queue

    def cancel(self) -> None:
        queue = self._queue
        if queue is not None:
            self._queue = None
            self._callback = None
            self._args = ()
            queue._dead += 1
            if queue._dead > _COMPACT_AFTER:
                queue._compact()

    def cancelled(self) -> bool:
        """Whether it was cancelled or already ran (it will not run again)."""
        return self._queue is None

    def _run(self) -> None:
        callback, args = self._callback, self._args
        self._queue = None
        self._callback = None
        self._args = ()
        if callback is not None:
            callback(*args)


class TimerQueue:
    """The timeouts of one event loop, kept in a heap behind a single loop timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._order = itertools.count()
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._dead = 0  # cancelled entries still in the heap

    def __len__(self) -> int:
        """Entries in the heap, cancelled ones not yet dropped included."""
        return len(self._heap)

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> TimerHandle:
        """Call `callback(*args)` at loop time `when` (from the loop, as its timers run)."""
        handle = TimerHandle(when, callback, args, self)
        heapq.heappush(self._heap, (when, next(self._order), handle))
        if when < self._armed_at:
            self._arm(when)
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> TimerHandle:
        """Call `callback(*args)` after `delay` seconds."""
        return self.call_at(self._loop.time() + delay, callback, *args)

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed_at = when
        self._armed = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._armed = None
        self._armed_at = math.inf
        heap = self._heap
        end = self._loop.time() + _SLACK
        while heap and heap[0][0] <= end:
            handle = heapq.heappop(heap)[2]
            if handle._queue is None:
                self._dead -= 1
                continue
            try:
                handle._run()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._loop.call_exception_handler(
                    {"message": "Exception in a timer callback", "exception": exc}
                )
        self._drop_dead_head()
        if heap:
            self._arm(heap[0][0])

    def _drop_dead_head(self) -> None:
        heap = self._heap
        while heap and heap[0][2]._queue is None:
            heapq.heappop(heap)
            self._dead -= 1

    def _compact(self) -> None:
        """Drop the cancelled entries once they outnumber the live ones."""
        heap = self._heap
        if self._dead * 2 > len(heap):
            # In place: `_fire` may be iterating this very list (a callback cancelling).
            heap[:] = [entry for entry in heap if entry[2]._queue is not None]
            heapq.heapify(heap)
            self._dead = 0
            if not heap and self._armed is not None:
                self._armed.cancel()
                self._armed = None
                self._armed_at = math.inf


_last: tuple[asyncio.AbstractEventLoop, TimerQueue] | None = None
_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TimerQueue] = (
    weakref.WeakKeyDictionary()
)


def timer_queue(loop: asyncio.AbstractEventLoop) -> TimerQueue:
    """The `TimerQueue` of `loop` (made on first use)."""
    global _last
    last = _last
    if last is not None and last[0] is loop:
        return last[1]
    queue = _queues.get(loop)
    if queue is None:
        queue = _queues[loop] = TimerQueue(loop)
    _last = (loop, queue)
    return queue


class Timeout:
    """`asyncio.timeout` on the loop's `TimerQueue`: the same contract, cheaper to set.

    Used as `async with timeout(delay):`. When the time runs out the task is cancelled, and
    the cancellation leaves the block as TimeoutError, unless the task was also cancelled
    from elsewhere meanwhile (then it stays a cancellation). `expired()` tells whether the
    time ran out. A `None` time never expires and costs nothing.
    """

    __slots__ = ("_cancelling", "_delay", "_expired", "_handle", "_task", "_when")

    def __init__(self, when: float | None, delay: float | None = None) -> None:
        self._when = when
        self._delay = delay  # counted from entering the block, when `when` is None
        self._task: asyncio.Task[Any] | None = None
        self._handle: TimerHandle | asyncio.Handle | None = None
        self._cancelling = 0
        self._expired = False

    def when(self) -> float | None:
        """The loop time the block must end by (None: no limit)."""
        return self._when

    def expired(self) -> bool:
        """Whether the time ran out (the task was cancelled by this timeout)."""
        return self._expired

    async def __aenter__(self) -> Timeout:
        when, delay = self._when, self._delay
        if when is None and delay is None:
            return self
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        loop = task.get_loop()
        if when is None:
            assert delay is not None
            when = self._when = loop.time() + delay
        if when <= loop.time():
            self._handle = loop.call_soon(self._on_timeout)
        else:
            self._handle = timer_queue(loop).call_at(when, self._on_timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        task = self._task
        if (
            self._expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def _on_timeout(self) -> None:
        task = self._task
        self._handle = None
        if task is not None and not task.done():
            task.cancel()
            self._expired = True


def timeout(delay: float | None) -> Timeout:
    """A `Timeout` ending `delay` seconds after the block is entered (None: no limit)."""
    return Timeout(None, delay)


def timeout_at(when: float | None) -> Timeout:
    """A `Timeout` ending at loop time `when` (None: no limit)."""
    return Timeout(when)
