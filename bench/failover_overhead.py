"""Micro-benchmark: per-attempt overhead of the failover loop against calling a client directly.

Run: `.venv/bin/python bench/failover_overhead.py [--rounds N] [--batch N] [--updates N]
[--no-write]`; the table is printed and written to the `failover-overhead` section of
BENCHMARKS.md.

Each scenario runs `rounds` rounds of `batch` requests in one event loop; the figure
for a round is its mean time per request, and the table reports the median over rounds.
The overhead per attempt is (router time - direct time of the same client calls) divided
by the number of attempts the request made. The clients never suspend, so what is
measured is the loop itself: context and options clone, selection, attempt records,
hook calls, the streaming generator and the inner iterator's close.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, write_section
from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextContent,
)
from chatroute.failover import OrderedFailoverChatClient

MESSAGES = [ChatMessage(ChatRole.USER, "How do I reverse a list in Python?")]
OPTIONS = ChatOptions(model_id="bench", temperature=0.2)
RESPONSE = ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, "Use reversed().")])


class Healthy(ChatClient):
    """Answers at once; streams `updates` ready-made updates from an async generator."""

    def __init__(self, updates: int) -> None:
        self.items = [
            ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent(f"t{i} ")])
            for i in range(updates)
        ]

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        return RESPONSE

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        for item in self.items:
            yield item


class Failing(ChatClient):
    """Fails at once with a new 503-like error, before any output."""

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        raise ConnectionError("503 service unavailable")

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        raise ConnectionError("503 service unavailable")
        yield  # pragma: no cover - makes this an async generator


async def drain(stream: AsyncIterator[ChatResponseUpdate]) -> int:
    """Read a stream to its end and close it, as the router does with an inner stream."""
    count = 0
    try:
        async for _ in stream:
            count += 1
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    return count


async def direct_failure_then(
    call: Callable[[], Awaitable[object]], failing: Callable[[], Awaitable[object]]
) -> None:
    """The baseline for a two-attempt request: the failing call, caught, then the good one."""
    with contextlib.suppress(ConnectionError):
        await failing()
    await call()


Scenario = Callable[[], Awaitable[object]]


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


async def time_pair(
    base: Scenario, routed: Scenario, rounds: int, batch: int, clock: Callable[[], float]
) -> tuple[float, float, float]:
    """Median seconds per request of `base` and `routed`, and the median per-round difference.

    The two run in alternating rounds so that load from elsewhere on the machine hits
    both alike; the difference is taken within each round before the median.
    """
    for run in (base, routed):  # warm-up
        for _ in range(batch):
            await run()
    base_samples: list[float] = []
    routed_samples: list[float] = []
    for _ in range(rounds):
        for run, samples in ((base, base_samples), (routed, routed_samples)):
            start = clock()
            for _ in range(batch):
                await run()
            samples.append((clock() - start) / batch)
    differences = [r - b for b, r in zip(base_samples, routed_samples, strict=True)]
    return (
        statistics.median(base_samples),
        statistics.median(routed_samples),
        statistics.median(differences),
    )


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


async def main(
    rounds: int, batch: int, updates: int, clock: Callable[[], float]
) -> list[tuple[str, int, float, float, float]]:
    healthy = Healthy(updates)
    failing = Failing()
    one = OrderedFailoverChatClient([healthy])
    two = OrderedFailoverChatClient([failing, healthy])

    async def direct() -> object:
        return await healthy.get_response(MESSAGES, OPTIONS)

    async def direct_two() -> object:
        await direct_failure_then(direct, lambda: failing.get_response(MESSAGES, OPTIONS))
        return None

    async def routed_one() -> object:
        return await one.get_response(MESSAGES, OPTIONS)

    async def routed_two() -> object:
        return await two.get_response(MESSAGES, OPTIONS)

    async def direct_stream() -> object:
        return await drain(healthy.get_streaming_response(MESSAGES, OPTIONS))

    async def direct_stream_two() -> object:
        await direct_failure_then(
            direct_stream, lambda: drain(failing.get_streaming_response(MESSAGES, OPTIONS))
        )
        return None

    async def routed_stream_one() -> object:
        return await drain(one.get_streaming_response(MESSAGES, OPTIONS))

    async def routed_stream_two() -> object:
        return await drain(two.get_streaming_response(MESSAGES, OPTIONS))

    assert await routed_two() is RESPONSE
    assert await routed_stream_two() == updates

    rows = []
    for label, attempts, base, routed in (
        ("non-streaming, 1 attempt", 1, direct, routed_one),
        ("non-streaming, 2 attempts (first fails)", 2, direct_two, routed_two),
        (f"streaming {updates} updates, 1 attempt", 1, direct_stream, routed_stream_one),
        (
            f"streaming {updates} updates, 2 attempts (first fails before output)",
            2,
            direct_stream_two,
            routed_stream_two,
        ),
    ):
        base_s, routed_s, difference = await time_pair(base, routed, rounds, batch, clock)
        rows.append((label, attempts, base_s, routed_s, difference / attempts))
    return rows


def report(rows: list[tuple[str, int, float, float, float]], args: argparse.Namespace) -> str:
    command = " ".join(
        [".venv/bin/python", "bench/failover_overhead.py", *map(shlex.quote, sys.argv[1:])]
    )
    lines = [
        "## Failover loop overhead",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        f"- clock: {args.clock} ({'thread CPU time' if args.clock == 'cpu' else 'wall time'});"
        f" load average at the end: {load_average()}",
        f"- command: `{command}`",
        f"- {args.rounds} alternating rounds x {args.batch} requests per scenario; medians of the"
        " per-round means; overhead = median per-round (routed - direct) / attempts",
        "",
        "| scenario | attempts | direct µs/request | routed µs/request | overhead µs/attempt |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, attempts, base_s, routed_s, overhead in rows:
        lines.append(
            f"| {label} | {attempts} | {base_s * 1e6:.2f} | {routed_s * 1e6:.2f} | {overhead * 1e6:.2f} |"
        )
    worst = max(r[4] for r in rows) * 1e6
    lines += ["", f"Worst overhead: {worst:.2f} µs per attempt (target: under 30 µs)."]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds per scenario")
    parser.add_argument("--batch", type=int, default=2000, help="requests per round")
    parser.add_argument("--updates", type=int, default=10, help="updates per streamed response")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this thread's CPU time (robust to other load on the machine); wall: perf_counter",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    if args.rounds < 1 or args.batch < 1 or args.updates < 1:
        parser.error("--rounds, --batch and --updates must be at least 1")
    results = asyncio.run(main(args.rounds, args.batch, args.updates, CLOCKS[args.clock]))
    text = report(results, args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "failover-overhead", text)
