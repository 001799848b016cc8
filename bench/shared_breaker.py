"""Shared breaker state: how soon an opening (or closing) on one replica reaches another.

Run from the repository root:

    .venv/bin/python bench/shared_breaker.py [--events 200] [--no-write]

It starts a real `redis-server` on 127.0.0.1 (the Debian package; `make test-deps`
installs it) and two replicas, each a process of its own with its own event loop, its own
`CircuitBreakerRegistry` and a `SharedBreakerState` on that Redis, as two replicas of the
service run them. The first replica then opens a provider's breaker, waits until the
second has applied it, closes it again, waits again, and so on, `--events` times each,
with `--gap-ms` between events. An event's propagation time runs from just before the
first replica's `trip()` / `reset()` (a breaker opened by failures opens through the same
transition) to the moment the second replica's breaker has changed state: the listener
that publishes in the background, the Redis round trip, the subscriber's wake-up and the
breaker update. Both replicas stamp `time.monotonic_ns()`, one clock for every process on
a machine.

The markdown result is printed and written to the `shared-breaker` section of
BENCHMARKS.md (`--no-write` skips that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, command, machine, pct, table, write_section
from chatroute.failover.breaker import (
    BreakerSettings,
    BreakerState,
    CircuitBreakerRegistry,
)
from chatroute.server.shared import SharedBreakerState

PROVIDER = "primary"
COOL_DOWN = 600.0  # long enough that no opening ends on its own during a run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free local port (no persistence); its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run `make test-deps` first")
    port = _free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _registry() -> CircuitBreakerRegistry:
    registry = CircuitBreakerRegistry(BreakerSettings(cool_down=COOL_DOWN))
    registry.get(PROVIDER)
    return registry


# ------------------------------------------------------------------- the second replica


async def follower(url: str, prefix: str) -> None:
    """The second replica: print `ready` once subscribed, then one line per change of the
    provider's breaker (`<state> <monotonic ns>`), until stdin closes."""
    registry = _registry()
    loop = asyncio.get_running_loop()

    def changed(provider: str, old: BreakerState, new: BreakerState) -> None:
        stamp = time.monotonic_ns()
        sys.stdout.write(f"{new.value} {stamp}\n")
        sys.stdout.flush()

    registry.add_listener(changed)
    shared = SharedBreakerState(registry, url, prefix=prefix, replica="follower")
    await shared.start()
    if not shared.connected:
        raise SystemExit("the follower could not subscribe")
    print("ready", flush=True)
    # Run until the parent closes stdin.
    await loop.run_in_executor(None, sys.stdin.read)
    await shared.aclose()


# -------------------------------------------------------------------- the first replica


async def _next_line(stream: asyncio.StreamReader, within: float) -> str:
    async with asyncio.timeout(within):
        line = await stream.readline()
    if not line:
        raise RuntimeError("the follower exited")
    return line.decode().strip()


async def measure(url: str, events: int, gap: float) -> dict[str, list[float]]:
    prefix = f"bench-{os.getpid()}"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--follow",
        url,
        "--prefix",
        prefix,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert child.stdout is not None and child.stdin is not None
    registry = _registry()
    shared = SharedBreakerState(registry, url, prefix=prefix, replica="leader")
    results: dict[str, list[float]] = {"open": [], "closed": []}
    try:
        if await _next_line(child.stdout, 30) != "ready":
            raise RuntimeError("the follower did not start")
        await shared.start()
        if not shared.connected:
            raise RuntimeError("could not reach redis-server")
        breaker = registry.get(PROVIDER)
        for _ in range(events):
            for state, change in (("open", breaker.trip), ("closed", breaker.reset)):
                await asyncio.sleep(gap)
                started = time.monotonic_ns()
                change()
                seen, stamp = (await _next_line(child.stdout, 10)).split()
                if seen != state:
                    raise RuntimeError(f"the follower saw {seen!r}, expected {state!r}")
                results[state].append((int(stamp) - started) / 1e6)
    finally:
        await shared.aclose()
        child.stdin.close()
        try:
            await asyncio.wait_for(child.wait(), 10)
        except TimeoutError:
            child.kill()
    return results


def redis_version() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        return "unknown"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return out.strip()


def run(args: argparse.Namespace) -> str:
    with redis_server() as url:
        results = asyncio.run(measure(url, args.events, args.gap_ms / 1000))
    rows = []
    for state, label in (("open", "opened on one replica"), ("closed", "closed on one replica")):
        values = results[state]
        rows.append(
            [
                label,
                len(values),
                f"{pct(values, 0.5):.2f}",
                f"{pct(values, 0.9):.2f}",
                f"{pct(values, 0.99):.2f}",
                f"{max(values):.2f}",
            ]
        )
    return "\n".join(
        [
            "## Shared breaker state: propagation between replicas (bench/shared_breaker.py)",
            "",
            f"- Machine: {machine()}.",
            f"- Command: `{command()}`",
            f"- redis-server {redis_version()} on 127.0.0.1, started by the bench; two replicas, "
            "each its own process and event loop with a `SharedBreakerState`; "
            f"{args.gap_ms:g} ms between events.",
            "",
            table(
                [
                    "event",
                    "events",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "max ms",
                ],
                rows,
            ),
            "",
            "Time from the change on the first replica to the same change on the second: the "
            "background publish (SET or DEL, and PUBLISH, in one pipeline), Redis, the "
            "subscriber's wake-up and the breaker update. Requests never wait on this: "
            "each replica's own breakers act at once, and Redis is off the request path.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200, help="openings (and closings) timed")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="pause before each event")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--follow", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="chatroute", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.follow:
        asyncio.run(follower(args.follow, args.prefix))
        return
    if args.events < 1:
        parser.error("--events must be at least 1")
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "shared-breaker", text)


if __name__ == "__main__":
    main()
