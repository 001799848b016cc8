"""The local engine of `chatroute classify`: read, decide and write batches in one process."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator

from chatroute.cli.classify_layout import Result, results_of
from chatroute.cli.classify_read import RowBatch
from chatroute.engine import Engine
from chatroute.router.decision import RouteDecision

__all__ = ["classify_batches"]

# Batches being decided at once: while one batch's results are written, the next one is
# already in the embedder's queue, so the model never waits for the writer or the reader.
_IN_FLIGHT = 2


async def classify_batches(
    engine: Engine,
    batches: Iterator[RowBatch],
    on_batch: Callable[[RowBatch, list[Result]], None],
    *,
    scoring: str,
    with_scores: bool,
) -> None:
    """Decide every batch of `batches` and hand each, in input order, to `on_batch`.

    Batches are read in a worker thread one ahead of need and at most `_IN_FLIGHT` are
    being decided at a time, so memory stays bounded by a few batches whatever the input's
    size. `on_batch` runs on the event loop (it writes, counts and reports); an exception
    from it stops the run.
    """
    route_name = engine.route_name
    pending: deque[tuple[RowBatch, asyncio.Task[list[RouteDecision]]]] = deque()

    def read() -> RowBatch | None:
        return next(batches, None)

    reading: asyncio.Future[RowBatch | None] | None = asyncio.ensure_future(asyncio.to_thread(read))
    try:
        while True:
            while reading is not None and len(pending) < _IN_FLIGHT:
                batch = await reading
                if batch is None:
                    reading = None
                    break
                reading = asyncio.ensure_future(asyncio.to_thread(read))
                pending.append((batch, asyncio.ensure_future(engine.decide_batch(batch.texts))))
            if not pending:
                return
            batch, deciding = pending.popleft()
            decisions = await deciding
            on_batch(batch, results_of(decisions, route_name, scoring, with_scores=with_scores))
    finally:
        for _, task in pending:
            task.cancel()
        for _, task in pending:
            with contextlib.suppress(BaseException):
                await task
        if reading is not None:
            with contextlib.suppress(BaseException):
                await reading
