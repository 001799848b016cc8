"""A bounded load test: many concurrent streaming and plain clients, a few percent of faults.

Three fake upstreams answer every request with text derived from the request's id, and
inject a fault (reset, 5xx, 429, error event, malformed or cut stream, stall, slow first
token) in about 4% of the requests they see. Every caller's outcome is then checked
against what the upstreams did for that id:

- nothing lost: every request got an answer (a complete one, or an explicit error);
- nothing duplicated or truncated-as-complete: a complete answer is exactly the expected
  text, and a stream whose serving attempt broke after output never ends with [DONE];
- an error only when no attempt could serve; never more attempts than the route's budget;
- and no leak: open file descriptors (less the providers' idle keep-alive connections,
  bounded by the pools' limit), per-request state and live request objects are flat after
  a warm-up round (memory is measured in bench/load_soak.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from chatroute.router.context import RoutingContext
from chatroute.tracing import RequestTrace
from tests.conftest import ServiceStack
from tests.fakes import (
    Behaviour,
    Cut,
    ErrorEvent,
    Malformed,
    Ok,
    RateLimited,
    Request,
    Reset,
    ServerError,
    SlowFirstToken,
    Stall,
    Truncated,
)

FAULT_RATE = 0.04
CLIENTS = 24
PER_ROUND = 120
BUDGETS = {"a": 3, "b": 2, "c": 3}
WORDS = "alpha beta gamma delta epsilon zeta eta"


def build(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            # Generous against the load itself (one process serves the clients, the
            # service and the upstreams: a healthy answer can take 0.7 s), so only injected
            # faults time out. `attempt` ends a non-streamed answer that stalls half-way.
            "timeouts": {"connect": 2, "attempt": 2.5, "first_token": 1.0, "stall": 1.0},
        }

    return {
        "routing": {"default_route": "a", "threshold": 0.3},
        "resilience": {"deadline": 10},
        "providers": {name: provider(name) for name in ("p1", "p2", "p3")},
        "routes": {
            "a": {"targets": ["p1", "p2", "p3"], "max_attempts": 3, "utterances": ["hello"]},
            "b": {"targets": ["p2", "p3", "p1"], "max_attempts": 2},
            "c": {"targets": ["p3", "p1"], "retry_same_provider": True, "max_attempts": 3},
        },
    }


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Iterator[ServiceStack]:
    with service_stack(build, ["p1", "p2", "p3"]) as made:
        yield made


def expected_text(rid: str) -> str:
    return f"reply {rid} {WORDS}"


# Post-commit faults: the attempt broke after output reached the caller.
_AFTER_OUTPUT = ("cut", "stall", "malformed_late", "truncated")


def _fault(kind: str, text: str) -> Behaviour:
    return {
        "reset": lambda: Reset(),
        "server_error": lambda: ServerError(),
        "rate_limited": lambda: RateLimited(retry_after=None),
        "error_event": lambda: ErrorEvent(0, text=text),
        "malformed_first": lambda: Malformed(0, text=text),
        "slow_first_token": lambda: SlowFirstToken(1.5, text),
        "cut": lambda: Cut(3, text=text),
        "stall": lambda: Stall(3, text=text),
        "malformed_late": lambda: Malformed(3, text=text),
        "truncated": lambda: Truncated(3, text=text),
    }[kind]()


# What a non-streamed request gets from each behaviour: the fake sends the whole answer
# for these (an error event, a slow first token or a missing finish only matter in streams).
_SERVES_PLAIN = frozenset({"ok", "slow_first_token", "truncated", "error_event"})


def serves(kind: str, stream: bool) -> bool:
    """Whether an attempt with this behaviour delivers the whole answer."""
    return kind == "ok" or (not stream and kind in _SERVES_PLAIN)


FAULTS = (
    "reset",
    "server_error",
    "rate_limited",
    "error_event",
    "malformed_first",
    "slow_first_token",
    *_AFTER_OUTPUT,
)


@dataclass
class Seen:
    """What one upstream did with one request."""

    upstream: str
    rid: str
    kind: str  # "ok" or a fault name
    stream: bool


class Injector:
    """The fakes' handler: a deterministic fault (or the right answer) per request."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.seen: dict[str, list[Seen]] = defaultdict(list)

    def handler(self, upstream: str) -> Callable[[Request], Behaviour]:
        def choose(request: Request) -> Behaviour:
            rid = str(request.messages[-1]["content"])
            text = expected_text(rid)
            kind = "ok"
            if self.random.random() < FAULT_RATE:
                kind = self.random.choice(FAULTS)
            self.seen[rid].append(Seen(upstream, rid, kind, request.stream))
            return Ok(text) if kind == "ok" else _fault(kind, text)

        return choose


@dataclass
class Outcome:
    rid: str
    route: str
    stream: bool
    status: int | None = None
    complete: bool = False
    in_band_error: bool = False
    text: str = ""
    attempts_header: int | None = None
    transport_error: str | None = None


def _content(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def one_request(client: httpx.AsyncClient, rid: str, route: str, stream: bool) -> Outcome:
    out = Outcome(rid, route, stream)
    body = {"model": route, "stream": stream, "messages": [{"role": "user", "content": rid}]}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            raw = (await response.aread()).decode()
            out.status = response.status_code
            header = response.headers.get("x-chatroute-attempts")
            out.attempts_header = int(header) if header else None
    except httpx.HTTPError as exc:
        out.transport_error = repr(exc)
        return out
    if out.status != 200:
        assert "error" in json.loads(raw)
        return out
    if not stream:
        message = json.loads(raw)["choices"][0]["message"]
        out.text, out.complete = message["content"] or "", True
        return out
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    out.complete = bool(events) and events[-1] == "[DONE]"
    out.in_band_error = any(isinstance(e, dict) and "error" in e for e in events)
    out.text = _content(events)
    return out


async def run_round(stack: ServiceStack, injector: Injector, prefix: str) -> list[Outcome]:
    plan = [
        (f"{prefix}-{i}", "abc"[i % 3], i % 4 != 0)  # three quarters stream
        for i in range(PER_ROUND)
    ]
    queue: asyncio.Queue[tuple[str, str, bool]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(
        base_url=stack.url,
        headers={"authorization": f"Bearer {stack.key}"},
        timeout=30,
        limits=limits,
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                rid, route, stream = queue.get_nowait()
                outcomes.append(await one_request(client, rid, route, stream))

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return outcomes


def check(outcomes: list[Outcome], injector: Injector) -> dict[str, int]:
    """Every outcome against what the upstreams did; returns counts by kind of outcome."""
    counts: dict[str, int] = defaultdict(int)
    assert len({o.rid for o in outcomes}) == len(outcomes) == PER_ROUND
    for o in outcomes:
        seen = injector.seen[o.rid]
        assert o.transport_error is None, f"lost: {o} {seen}"
        assert o.status is not None
        budget = BUDGETS[o.route]
        assert 1 <= len(seen) <= budget, f"{o.rid}: {len(seen)} attempts over budget {budget}"
        if o.attempts_header is not None:
            assert len(seen) <= o.attempts_header <= budget, (o, seen)
        last = seen[-1]
        if o.status == 200 and o.complete:
            assert o.text == expected_text(o.rid), f"corrupted: {o.text!r} ({seen})"
            assert serves(last.kind, o.stream), (o, seen)
            counts["complete"] += 1
        elif o.status == 200:
            # Truncated: never with [DONE], always an in-band error, and only when the
            # serving attempt really broke after output.
            assert o.stream and o.in_band_error and not o.complete, o
            assert last.kind in _AFTER_OUTPUT, (o, seen)
            assert expected_text(o.rid).startswith(o.text.rstrip()), o
            counts["truncated_with_error"] += 1
        else:
            assert not any(serves(s.kind, o.stream) for s in seen), f"an error, but: {seen}"
            counts[f"status_{o.status}"] += 1
        if len(seen) > 1:
            counts["failed_over"] += 1
    return counts


def check_traces(stack: ServiceStack) -> None:
    """Every request's attempts were reported and within budget; then forget the traces
    (they hold their attempts' exceptions, and through them the requests' frames)."""
    for trace in stack.wait_traces(PER_ROUND):
        assert trace.attempt_count <= BUDGETS[trace.route]
        assert len(trace.attempts) == trace.attempt_count
    stack.traces.clear()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pooled(stack: ServiceStack) -> int:
    """Idle keep-alive connections in the providers' pools. Each holds two descriptors of
    this process (the service's end and the fake upstream's); the pools grow up to their
    idle limit as the rounds' peaks of concurrency vary, which is no leak."""
    count = 0
    for provider in stack.service.engine.providers.values():
        session = provider._transport.session
        if session is not None:
            count += sum(len(idle) for idle in session.connector._conns.values())
    return count


async def live(kind: type) -> int:
    """Objects of `kind` still alive once the service is idle (requests that just ended
    may still be unwinding on the server's thread for a moment)."""
    count = -1
    for _ in range(20):
        gc.collect()
        count = sum(1 for obj in gc.get_objects() if type(obj) is kind)
        if count == 0:
            break
        await asyncio.sleep(0.1)
    return count


async def settle_fds(stack: ServiceStack, limit: int) -> int:
    """Wait (2 s at most) for sockets being closed to go: until the count of descriptors
    other than the pools' idle connections is at most `limit`, or has not changed for a
    quarter of a second; returns that count."""
    count = open_fds() - 2 * pooled(stack)
    unchanged = 0
    for _ in range(40):
        if count <= limit or unchanged == 5:
            break
        await asyncio.sleep(0.05)
        before, count = count, open_fds() - 2 * pooled(stack)
        unchanged = unchanged + 1 if count == before else 0
    return count


async def test_concurrent_clients_under_faults_lose_nothing_and_leak_nothing(
    stack: ServiceStack,
) -> None:
    stack.reset()
    injector = Injector(seed=20240607)
    for name, up in stack.upstreams.items():
        up.handler = injector.handler(name)
    totals: dict[str, int] = defaultdict(int)

    warm = await run_round(stack, injector, "warm")  # pools, caches and code paths warm
    for key, value in check(warm, injector).items():
        totals[key] += value
    await asyncio.to_thread(check_traces, stack)
    fds_before = await settle_fds(stack, 0)
    for n in range(2):
        outcomes = await run_round(stack, injector, f"round{n}")
        for key, value in check(outcomes, injector).items():
            totals[key] += value
        await asyncio.to_thread(check_traces, stack)

    # Faults of every family were exercised, and failovers happened.
    assert totals["complete"] > PER_ROUND * 2
    assert totals["failed_over"] > 0 and totals["truncated_with_error"] > 0
    kinds = {s.kind for seen in injector.seen.values() for s in seen}
    assert len(kinds - {"ok"}) >= 6, kinds
    # Nothing leaks: per-request router state, request objects, sockets.
    for chain in stack.service.engine.chains.values():
        assert chain.active_requests() == 0
    assert await live(RoutingContext) == 0
    assert await live(RequestTrace) == 0
    fds_after = await settle_fds(stack, fds_before + 4)
    assert fds_after <= fds_before + 4, (fds_before, fds_after)
    assert pooled(stack) <= 3 * 20  # each provider's idle limit (max_keepalive_connections)
