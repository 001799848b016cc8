"""The shared-timer timeouts: asyncio.timeout's contract, on one loop timer per loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from chatroute._timer import TimerQueue, timeout, timeout_at, timer_queue

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    def runner(coro: Coroutine[Any, Any, Any]) -> Any:
        loop = LOOPS[request.param]()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()

    return runner


def test_a_timeout_that_runs_out_raises_timeout_error_after_its_delay(run: Any) -> None:
    async def main() -> tuple[float, bool]:
        started = time.monotonic()
        block = timeout(0.05)
        with pytest.raises(TimeoutError):
            async with block:
                await asyncio.sleep(5)
        return time.monotonic() - started, block.expired()

    elapsed, expired = run(main())
    assert expired
    assert 0.045 <= elapsed < 1.0  # loop clocks may round the timer by a millisecond


def test_a_block_that_ends_in_time_leaves_nothing_behind(run: Any) -> None:
    async def main() -> tuple[bool, int, list[float]]:
        loop = asyncio.get_running_loop()
        block = timeout(0.05)
        async with block:
            await asyncio.sleep(0)
        # Many set-and-cancelled timeouts: the heap is compacted instead of growing.
        for _ in range(5000):
            async with timeout(30):
                pass
        size = len(timer_queue(loop))
        # The queue still fires timers set after all that churn.
        fired: list[float] = []
        timer_queue(loop).call_later(0.01, lambda: fired.append(loop.time()))
        await asyncio.sleep(0.1)
        return block.expired(), size, fired

    expired, size, fired = run(main())
    assert not expired
    assert size <= 2 * 64 + 2
    assert len(fired) == 1


def test_a_cancellation_from_elsewhere_stays_a_cancellation(run: Any) -> None:
    async def victim(started: asyncio.Event) -> None:
        async with timeout(30):
            started.set()
            await asyncio.sleep(5)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.ensure_future(victim(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_an_outside_cancel_racing_the_expiry_is_not_turned_into_a_timeout(run: Any) -> None:
    # The timer fires and, in the same turn of the loop, before the task runs again, someone
    # else cancels the task: the block must not swallow that second cancellation as its
    # own timeout.
    async def victim(when: float, block_entered: asyncio.Event) -> None:
        async with timeout_at(when):
            block_entered.set()
            await asyncio.sleep(5)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.05
        entered = asyncio.Event()
        task = asyncio.ensure_future(victim(when, entered))
        await entered.wait()
        # Due at the same time and queued after the block's own timeout: both run in one
        # pass of the queue, the timeout first, before the task resumes.
        timer_queue(loop).call_at(when, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    run(main())


def test_nested_timeouts_report_the_one_that_ran_out(run: Any) -> None:
    async def main() -> tuple[bool, bool, str]:
        outer = timeout(5)
        inner = timeout(0.02)
        async with outer:
            try:
                async with inner:
                    await asyncio.sleep(5)
            except TimeoutError:
                where = "inner"
            else:
                where = "none"
        return outer.expired(), inner.expired(), where

    assert run(main()) == (False, True, "inner")


def test_no_limit_never_expires_and_a_past_time_expires_at_once(run: Any) -> None:
    async def main() -> tuple[bool, bool]:
        never = timeout(None)
        async with never:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        past = timeout_at(loop.time() - 1)
        with pytest.raises(TimeoutError):
            async with past:
                await asyncio.sleep(5)
        return never.expired(), past.expired()

    assert run(main()) == (False, True)


def test_the_queue_fires_in_time_order_and_survives_a_failing_callback(run: Any) -> None:
    async def main() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context["message"]))
        queue = TimerQueue(loop)
        order: list[str] = []

        def boom() -> None:
            raise RuntimeError("boom")

        queue.call_later(0.06, order.append, "late")
        queue.call_later(0.02, boom)
        queue.call_later(0.02, order.append, "early")  # earlier than the armed timer
        cancelled = queue.call_later(0.04, order.append, "cancelled")
        cancelled.cancel()
        fired = queue.call_later(0.01, order.append, "first")
        await asyncio.sleep(0.15)
        fired.cancel()  # already ran: a no-op
        return order, errors

    order, errors = run(main())
    assert order == ["first", "early", "late"]
    assert errors == ["Exception in a timer callback"]


def test_outside_a_task_a_real_limit_is_refused() -> None:
    loop = asyncio.new_event_loop()
    try:
        block = timeout(1)
        with pytest.raises(RuntimeError, match="inside a task"):
            loop.run_until_complete(_enter_outside_task(block, loop))
    finally:
        loop.close()


async def _enter_outside_task(block: Any, loop: asyncio.AbstractEventLoop) -> None:
    # Drive __aenter__ by hand from a callback: no current task there.
    coro = block.__aenter__()
    result: asyncio.Future[None] = loop.create_future()

    def step() -> None:
        try:
            coro.send(None)
        except BaseException as exc:  # handed to the awaiting test
            result.set_exception(exc)

    loop.call_soon(step)
    await result
