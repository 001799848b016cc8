"""Soak test: many concurrent streaming clients through the real service, with injected faults.

Run (defaults: 200 streaming clients, 5 minutes, 2% mixed faults, 30 s warm-up):

    .venv/bin/python bench/load_soak.py [--clients 200] [--duration 300] [--fault-rate 0.02]
        [--warmup 30] [--plain-share 0.0] [--chunks 20] [--chunk-delay 0.25]
        [--first-token-delay 0.25] [--seed 1] [--json PATH]

The upstream pacing sets the load: with the defaults each answer streams for about 5.5 s,
so 200 clients ask for about 36 requests and 760 chunks per second.

The service runs in its own process (`chatroute.server.create_app` under uvicorn, the
real default-model embedder on CPU), in front of three scripted OpenAI-compatible fake
upstreams on 127.0.0.1 (tests/fakes/upstream.py, each in a child process) that
answer each request with text derived from its id and inject a fault (reset, 5xx, 429,
hang, slow first token, error event, malformed first or later chunk, cut, stall,
truncation) at the given rate. The clients run in this process, on one asyncio loop, each
with its own keep-alive HTTP/1.1 connection (the clients' loop lag is reported, to show
they did not set the pace).

Reported as a markdown section on stdout and in BENCHMARKS.md (`--no-write` to skip):
- lost (no answer, or a transport error), truncated-as-complete (a stream that ends with
  [DONE] but whose text is not the whole answer, or whose serving attempt broke after
  output), over-budget (more upstream attempts than the route's budget): all must be 0;
- added latency p50/p99: client-observed time of a request served at the first attempt
  by a healthy upstream, minus that upstream's own time for it;
- service RSS and open file descriptors after the warm-up and at the end;
- failover time to a healthy fallback when the primary accepts and never answers
  (first-token timeout + one connect + the fallback's first token), and how fast the
  upstream sees the connection closed when a caller disconnects (target: 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._common import REPO, command, machine, pct, table, write_section
from bench._soak_clients import Caller, Result, one_request
from bench._soak_service import FAILOVER_FIRST_TOKEN_TIMEOUT, Service, service_config
from bench._soak_upstreams import FAULTS, FAULTY, FakesChild, Seen, answer_text, run_fake_child
from tests.fakes import FakeUpstream, Hang, Ok

BUDGETS = {"a": 3, "b": 2, "c": 3}
SERVES_PLAIN = frozenset({"ok", "slow_first_token", "truncated", "error_event"})


@dataclass
class Soak:
    results: list[Result] = field(default_factory=list)
    rss: list[tuple[float, float, int]] = field(default_factory=list)  # (t, MiB, fds)
    service_cpu: float = 0.0  # share of one core, over the run
    bench_cpu: float = 0.0
    client_lag: list[float] = field(default_factory=list)  # the clients' event-loop lag


async def soak(args: argparse.Namespace, service: Service) -> Soak:
    out = Soak()
    rng = random.Random(args.seed)
    cpu_service, cpu_bench = service.cpu_seconds(), sum(os.times()[:2])
    start = time.monotonic()
    stop_at = start + args.duration

    async def user(n: int) -> None:
        count = 0
        caller = Caller("127.0.0.1", service.port)
        await asyncio.sleep(rng.random() * min(5.0, args.warmup))  # ramp up
        while time.monotonic() < stop_at:
            rid = f"soak-{n}-{count}"
            count += 1
            route = "abc"[(n + count) % 3]
            stream = rng.random() >= args.plain_share
            out.results.append(await one_request(caller, rid, route, stream, 120))
        await caller.close()

    async def sample() -> None:
        next_rss = 0.0
        while time.monotonic() < stop_at:
            now = time.monotonic()
            if now >= next_rss:
                out.rss.append((now - start, service.rss_mib(), service.fds()))
                next_rss = now + 2.0
            await asyncio.sleep(0.1)
            out.client_lag.append(time.monotonic() - now - 0.1)

    sampler = asyncio.ensure_future(sample())
    await asyncio.gather(*(user(n) for n in range(args.clients)))
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    out.rss.append((time.monotonic() - start, service.rss_mib(), service.fds()))
    wall = time.monotonic() - start
    out.service_cpu = (service.cpu_seconds() - cpu_service) / wall
    out.bench_cpu = (sum(os.times()[:2]) - cpu_bench) / wall
    return out


def verify(
    results: list[Result], records: dict[str, list[Seen]], words: int, warmup_end: float
) -> dict[str, Any]:
    lost: list[str] = []
    truncated_complete: list[str] = []
    over_budget: list[str] = []
    outcomes: Counter[str] = Counter()
    added: list[float] = []
    for res in results:
        seen = records.get(res.rid, [])
        budget = BUDGETS[res.route]
        if len(seen) > budget or (res.attempts_header or 0) > budget:
            over_budget.append(res.rid)
        if res.transport_error is not None or res.status is None:
            lost.append(f"{res.rid}: {res.transport_error}")
            continue
        expected = answer_text(res.rid, words)
        if res.status == 200 and res.complete:
            last = seen[-1].kind if seen else "?"
            served = last == "ok" or (not res.stream and last in SERVES_PLAIN)
            if res.text != expected or not served:
                truncated_complete.append(res.rid)
            outcomes["complete"] += 1
            if len(seen) == 1 and last == "ok" and res.started >= warmup_end:
                upstream = seen[0]
                if upstream.finished_at is not None:
                    added.append(
                        (res.ended - res.started) - (upstream.finished_at - upstream.arrived_at)
                    )
        elif res.status == 200:
            outcomes["in-band error (broken after output)"] += 1
            if not res.in_band_error:
                lost.append(f"{res.rid}: ended with neither [DONE] nor an error")
        else:
            outcomes[f"HTTP {res.status}"] += 1
        if len(seen) > 1:
            outcomes["failed over"] += 1
    return {
        "lost": lost,
        "truncated_as_complete": truncated_complete,
        "over_budget": over_budget,
        "outcomes": outcomes,
        "added": added,
    }


# ------------------------------------------------------------------------ side measurements


async def failover_time(service: Service, dead: FakeUpstream, samples: int) -> list[float]:
    """Time to the first content byte when the primary accepts and never answers."""
    dead.default = Hang()
    times = []
    async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
        for n in range(samples):
            body = {
                "model": "failover",
                "stream": True,
                "messages": [{"role": "user", "content": f"failover-{n}"}],
            }
            started = time.monotonic()
            first: float | None = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and '"content"' in line:
                        first = time.monotonic() - started
            if first is not None:
                times.append(first)
    return times


async def disconnect_lag(service: Service, dead: FakeUpstream, samples: int) -> list[float]:
    """How long after a caller closes its connection the upstream sees its own closed."""
    dead.default = Hang()
    lags = []
    host, port = "127.0.0.1", service.port
    for n in range(samples):
        dead.reset()
        dead.default = Hang()
        body = json.dumps(
            {
                "model": "dead_only",
                "stream": n % 2 == 0,
                "messages": [{"role": "user", "content": f"disconnect-{n}"}],
            }
        ).encode()
        _reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await writer.drain()
        await dead.await_requests(1, timeout=10)
        await asyncio.sleep(0.05)
        left = time.monotonic()
        writer.close()
        closed = await dead.await_disconnect(0, timeout=10)
        lags.append(closed - left)
    return lags


# ------------------------------------------------------------------------ report


def report(
    args: argparse.Namespace,
    verdict: dict[str, Any],
    run: Soak,
    failover: list[float],
    lags: list[float],
    elapsed: float,
) -> str:
    results = run.results
    warm = [s for s in run.rss if s[0] >= args.warmup]
    rss_warm = warm[0][1] if warm else float("nan")
    rss_end = run.rss[-1][1]
    rss_max = max((s[1] for s in warm), default=float("nan"))
    fds_warm = warm[0][2] if warm else 0
    fds_end = run.rss[-1][2]
    growth = (rss_end - rss_warm) / rss_warm * 100 if warm else float("nan")
    added = verdict["added"]
    streams = sum(1 for r in results if r.stream)
    ms = 1000.0
    events = sum(len(r.text.split()) for r in results)
    rows = [
        (
            "requests",
            f"{len(results)} ({streams} streamed) in {elapsed:.0f} s: "
            f"{len(results) / elapsed:.1f} requests/s, {events / elapsed:.0f} content chunks/s",
        ),
        (
            "the clients' event-loop lag p50 / p99 (a large lag means the clients set the pace)",
            f"{pct(run.client_lag, 0.5) * ms:.0f} ms / {pct(run.client_lag, 0.99) * ms:.0f} ms",
        ),
        (
            "CPU used (share of one core)",
            f"service {run.service_cpu * 100:.0f}%, bench clients "
            f"{run.bench_cpu * 100:.0f}% (of {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.1f} at the end)",
        ),
        ("lost", len(verdict["lost"])),
        ("truncated reported as complete", len(verdict["truncated_as_complete"])),
        ("over the attempt budget", len(verdict["over_budget"])),
        (
            "outcomes",
            ", ".join(f"{k}: {v}" for k, v in sorted(verdict["outcomes"].items())),
        ),
        (
            "added latency p50 / p99 (served at once, after warm-up)",
            f"{pct(added, 0.5) * ms:.1f} ms / {pct(added, 0.99) * ms:.1f} ms (n={len(added)})",
        ),
        (
            "service RSS after warm-up / max / end",
            f"{rss_warm:.0f} / {rss_max:.0f} / {rss_end:.0f} MiB ({growth:+.1f}%)",
        ),
        ("service open fds after warm-up / end", f"{fds_warm} / {fds_end}"),
        (
            f"failover to a healthy fallback, primary silent (first-token timeout "
            f"{FAILOVER_FIRST_TOKEN_TIMEOUT:g} s)",
            f"median {statistics.median(failover) * ms:.0f} ms, max {max(failover) * ms:.0f} ms "
            f"(n={len(failover)}; timeout + connect + fallback first token "
            f"{args.first_token_delay * ms:.0f} ms)",
        ),
        (
            "caller disconnect -> upstream connection closed",
            f"median {statistics.median(lags) * ms:.1f} ms, max {max(lags) * ms:.1f} ms "
            f"(n={len(lags)}; target 100 ms)",
        ),
    ]
    lines = [
        "## Resilience soak (bench/load_soak.py)",
        "",
        f"Command: `{command()}`",
        "",
        f"Machine: {machine()}. The service, the clients and each of the three "
        f"faulting upstreams run in processes of their own.",
        "",
        f"{args.clients} concurrent clients ({(1 - args.plain_share) * 100:.0f}% streaming), "
        f"{args.duration:g} s with {args.warmup:g} s warm-up, {args.fault_rate * 100:g}% of "
        f"upstream requests faulted (mixed: {', '.join(FAULTS)}). Upstream answers: "
        f"{args.chunks} chunks, first token after {args.first_token_delay * ms:.0f} ms, "
        f"{args.chunk_delay * ms:.0f} ms apart.",
        "",
        table(["measure", "value"], rows),
    ]
    for name in ("lost", "truncated_as_complete", "over_budget"):
        if verdict[name]:
            lines += ["", f"First {name}: {verdict[name][:5]}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds")
    parser.add_argument("--fault-rate", type=float, default=0.02)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds")
    parser.add_argument("--plain-share", type=float, default=0.0, help="non-streaming share")
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--chunk-delay", type=float, default=0.25, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.25, help="seconds")
    parser.add_argument("--failover-samples", type=int, default=5)
    parser.add_argument("--disconnect-samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--fake-child", choices=FAULTY, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_child:
        run_fake_child(args)
        return
    if args.warmup >= args.duration:
        parser.error("--warmup must be shorter than --duration")

    with contextlib.ExitStack() as stack:
        fakes = FakesChild(args)
        stack.callback(fakes.close)
        ups = {name: stack.enter_context(FakeUpstream()) for name in ("dead", "spare")}
        ups["spare"].default = Ok(
            "spare answer", first_token_delay=args.first_token_delay, chunk_delay=args.chunk_delay
        )
        urls = {**fakes.urls, **{name: up.base_url for name, up in ups.items()}}
        service = Service(service_config(urls))
        stack.callback(service.close)
        service.wait_ready()
        print(f"service ready on {service.url}; soaking for {args.duration:g} s", file=sys.stderr)
        started = time.monotonic()
        run = asyncio.run(soak(args, service))
        elapsed = time.monotonic() - started
        verdict = verify(run.results, fakes.records(), args.chunks, started + args.warmup)
        failover = asyncio.run(failover_time(service, ups["dead"], args.failover_samples))
        lags = asyncio.run(disconnect_lag(service, ups["dead"], args.disconnect_samples))
        text = report(args, verdict, run, failover, lags, elapsed)
        print(text)
        if not args.no_write:
            write_section(REPO / "BENCHMARKS.md", "soak", text)
        if args.json is not None:
            raw = {
                "lost": len(verdict["lost"]),
                "truncated_as_complete": len(verdict["truncated_as_complete"]),
                "over_budget": len(verdict["over_budget"]),
                "outcomes": dict(verdict["outcomes"]),
                "added_p50_s": pct(verdict["added"], 0.5),
                "added_p99_s": pct(verdict["added"], 0.99),
                "rss": run.rss,
                "failover_s": failover,
                "disconnect_lag_s": lags,
            }
            args.json.write_text(json.dumps(raw, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
